"""Lumina Image 2.0 through the entry scripts on tiny-lumina (64 px, 2-4 steps): a LoRA with the
system prompt and samples (lumina_train_network.py), exact resume, the text-encoder cache on disk,
full fine-tuning saved in the source layout (lumina_train.py) and its fused backward pass equal to
the plain step, sd-scripts' loss weighting recomputed in float64, the flow formulas Lumina adds
against float64 references, and the one-line refusals."""
from __future__ import annotations

import math
import os
import runpy
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.models.families.lumina import home
from library.models.families.lumina import tiny
from library.training import flow_loss, flow_matching
from tests.conftest import read
from tests.helpers import options_from_values

SYSTEM = "You are an assistant"


def args(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", "2", "--cache_latents", "--seed", "7",
            "--network_dim", "4", "--network_alpha", "4", "--learning_rate", "1e-2", *extra]


def test_lora_with_system_prompt_and_samples(dataset, tmp_path, train):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of sks dog --n blurry --w 64 --h 64 --s 2 --d 5\n")
    out = tmp_path / "out"
    rc, _, err, run = train("train_lora", args("tiny-lumina", dataset, str(out), "--system_prompt", SYSTEM,
                                               "--sample_prompts", str(prompts), "--sample_every_n_steps", "2"))
    assert rc == 0, err
    sd, meta = read(str(out / "last.safetensors"))
    names = {k.split(".")[0] for k in sd}
    assert "lora_unet_layers_1_attention_qkv" in names and "lora_te_layers_0_self_attn_q_proj" in names
    assert len(names) == 25 + 21  # every transformer block Linear and Gemma-2's attention and MLP
    saved, trained = load_file(str(out / "last.safetensors")), run.parts.method.network.state_dict()
    assert all(torch.equal(saved[k], v.detach().float()) for k, v in trained.items())
    assert (meta["ss_network_module"], meta["ss_base_model_version"], meta["modelspec.architecture"],
            meta["ss_timestep_sampling"], meta["ss_discrete_flow_shift"], meta["ss_model_prediction_type"]) == \
        ("networks.lora_lumina", "lumina2", "lumina-2/lora", "shift", "6.0", "raw")  # sd-scripts' Lumina defaults
    fm = run.parts.family_model
    assert fm.system_prompt == SYSTEM and fm.tokenize(["a dog"])[0].shape == (1, 256)
    assert any(f.endswith(".png") for f in os.listdir(out / "sample"))


def test_lora_resume_is_bit_identical(dataset, tmp_path, train):
    # network_module named: a resume of a run that left it unset is refused (the state records the
    # family's module, the resumed options the schema's default; a shared resume-check issue)
    extra = ["--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state", "--timestep_sampling",
             "nextdit_shift", "--network_module", "networks.lora_lumina"]
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    rc, _, err, u = train("train_lora", args("tiny-lumina", dataset, whole, *extra))
    assert rc == 0, err
    state = os.path.join(whole, "last-step00000002-state")
    rc, _, err, r = train("train_lora", args("tiny-lumina", dataset, resumed, *extra, "--resume", state))
    assert rc == 0, err
    assert r.progress.global_step == 4 and r.progress.loss_log == u.progress.loss_log
    a, b = load_file(os.path.join(whole, "last.safetensors")), load_file(os.path.join(resumed, "last.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_text_encoder_cache_on_disk_is_reused(dataset, tmp_path, train):
    cache = str(tmp_path / "cache")
    extra = ["--cache_text_encoder_outputs_to_disk", "--network_train_unet_only", "--cache_dir", cache]

    def entries():
        return sorted(f for f in os.listdir(cache) if f.startswith("te-"))

    rc, _, err, run = train("train_lora", args("tiny-lumina", dataset, str(tmp_path / "a"), *extra,
                                               "--system_prompt", SYSTEM))
    assert rc == 0, err
    first = entries()
    assert len(first) == 2  # make_sample_dataset's two captions
    tensors, _ = read(os.path.join(cache, first[0]))
    assert set(tensors) == {"hidden_states", "mask"} and tensors["hidden_states"].shape == (256, 32)
    mtimes = [os.path.getmtime(os.path.join(cache, f)) for f in first]
    rc, _, err, _ = train("train_lora", args("tiny-lumina", dataset, str(tmp_path / "b"), *extra,
                                             "--system_prompt", SYSTEM))
    assert rc == 0 and entries() == first
    assert [os.path.getmtime(os.path.join(cache, f)) for f in first] == mtimes  # reused, not rewritten
    # another system prompt is another encoding: new entries beside the old ones
    rc, _, err, _ = train("train_lora", args("tiny-lumina", dataset, str(tmp_path / "c"), *extra))
    assert rc == 0 and len(entries()) == 4


def test_full_finetune_saves_the_original_layout(dataset, tmp_path, run_script, monkeypatch):
    out = tmp_path / "full"
    argv = ["lumina_train.py", "--pretrained_model_name_or_path", "tiny-lumina", "--train_data_dir", dataset,
            "--output_dir", str(out), "--resolution", "64", "--max_train_steps", "2", "--cache_latents",
            "--learning_rate", "1e-3", "--seed", "7"]
    from tests.conftest import reset_accelerate
    reset_accelerate()
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        runpy.run_path("lumina_train.py", run_name="__main__")
    assert e.value.code == 0
    sd = load_file(str(out / "last.safetensors"))
    before = tiny.build_tiny_lumina()["transformer"].state_dict()
    assert sd.keys() == before.keys()
    assert not torch.equal(sd["layers.0.attention.qkv.weight"], before["layers.0.attention.qkv.weight"])


def test_refusals_are_one_line(dataset, tmp_path, run_script):
    out = str(tmp_path / "o")
    rc, _, err = run_script("train_lora", args("tiny-lumina", dataset, out, "--t5xxl", "t5.safetensors"))
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and "t5xxl: not with the Lumina 2 model" in errors[0], err
    flux = tmp_path / "flux_lora.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 64),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(192, 4),
               "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(4.0)}, str(flux))
    rc, _, err = run_script("train_lora", args("tiny-lumina", dataset, out, "--network_weights", str(flux)))
    assert rc == 2 and "lora_unet_double_blocks_0_img_attn_qkv" in err, err
    assert "Traceback" not in err
    rc, _, err = run_script("train_lora", args("tiny-lumina", dataset, out, "--use_flash_attn"))
    assert rc == 2 and "use_flash_attn" in err and "Traceback" not in err, err


def test_nextdit_shift_and_defaults_against_float64():
    """nextdit_shift: sigma = e^mu u / (e^mu u + 1 - u), u ~ U[0, 1) clamped to 1e-7, mu linear in the
    2x2-patch count through (256, 0.5) and (4096, 1.15) (sd-scripts' lumina_train_util)."""
    o = flow_matching.FlowOptions(family="lumina", timestep_sampling="nextdit_shift")
    assert flow_matching.variate_kind(o) == "uniform"
    u = torch.tensor([0.0, 0.25, 0.5, 0.9], dtype=torch.float64)
    seq = (128 // 2) * (96 // 2)
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (seq - 256)
    want = [math.exp(mu) / (math.exp(mu) + (1 / max(x, 1e-7) - 1)) for x in u.tolist()]
    sigmas, t = flow_matching.sigmas_from_variates(o, u, seq)
    assert torch.allclose(sigmas, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0) and torch.equal(sigmas, t)
    # unset options take sd-scripts' Lumina defaults; set ones win
    opts = options_from_values("train_lora", {"pretrained_model_name_or_path": "tiny-lumina"})
    f = flow_loss.flow_options(opts, "lumina")
    assert (f.timestep_sampling, f.discrete_flow_shift, f.model_prediction_type) == ("shift", 6.0, "raw")
    opts = options_from_values("train_lora", {"pretrained_model_name_or_path": "tiny-lumina",
                                              "discrete_flow_shift": 3.0})
    assert flow_loss.flow_options(opts, "lumina").discrete_flow_shift == 3.0


def test_family_model_reverses_time_and_velocity():
    """unet_forward(x, sigma) = -NextDiT(x, 1 - sigma): the raw loss against noise - x0 is sd-scripts'
    Lumina loss (output against x0 - noise)."""
    parts = tiny.build_tiny_lumina()
    fm = home.LuminaFamilyModel(parts["transformer"], [parts["gemma2"]], [parts["tokenizer"]],
                                        system_prompt=SYSTEM)
    ids, mask = fm.tokenize(["a dog"])
    with torch.no_grad():
        cond = fm.encode([ids, mask], None)
        x = torch.randn(1, 16, 8, 8)
        sigma = torch.tensor([0.3])
        got = fm.unet_forward(x, sigma, cond)
        want = -parts["transformer"](x, torch.tensor([0.7]), cond.hidden_states, mask)
    assert torch.allclose(got, want, atol=1e-6)


def test_text_options_change_the_encoding():
    """system_prompt puts "<system_prompt> <Prompt Start> " before the caption (its tokens first, then
    the caption's), gemma2_max_token_length sets the padded length (rounded up to 8)."""
    class Bundle:
        parts = tiny.build_tiny_lumina()
        unet, text_encoders, tokenizers = parts["transformer"], [parts["gemma2"]], [parts["tokenizer"]]

    def model(**values):
        return home.family_model(Bundle, options_from_values("train_lora", {
            "pretrained_model_name_or_path": "tiny-lumina", **values}))

    plain, with_system = model().tokenize(["a dog"]), model(system_prompt="are").tokenize(["a dog"])
    tok = Bundle.tokenizers[0]
    assert plain[0].shape == (1, 256) and plain[1].sum() == 3  # BOS, "a", " dog"
    n = int(with_system[1].sum())
    assert with_system[0][0, :n].tolist() == tok("are <Prompt Start> a dog").input_ids
    assert int(with_system[0][0, n - 1]) == int(plain[0][0, 2])  # " dog" last (the caption follows)
    short = model(gemma2_max_token_length=20).tokenize(["a dog"])
    assert short[0].shape == (1, 24)
    with torch.no_grad():
        a = model().encode(plain, None).hidden_states
        b = model(system_prompt="are").encode(with_system, None).hidden_states
    assert not torch.allclose(a[0, :3], b[0, :3])


def test_negative_prompts_have_no_system_prompt():
    """sd-scripts' samples tokenize the negative prompt without the system prompt (is_negative)."""
    parts = tiny.build_tiny_lumina()
    fm = home.LuminaFamilyModel(parts["transformer"], [parts["gemma2"]], [parts["tokenizer"]],
                                     system_prompt=SYSTEM)
    neg = fm.for_negative_prompts()
    assert fm.system_prompt == SYSTEM and neg.system_prompt == ""
    assert neg.tokenize(["blurry"])[0][0].tolist() == parts["tokenizer"](
        "blurry", padding="max_length", max_length=256).input_ids


def test_block_swap_equals_without(dataset, tmp_path, train):
    """blocks_to_swap over the joint layers (sd-scripts' Lumina trainer has it disabled): 2 AdamW
    steps of a full fine-tune equal the unswapped run bit for bit."""
    def weights(out, *extra):
        rc, _, err, run = train("train_dreambooth", ["--pretrained_model_name_or_path", "tiny-lumina",
                                                     "--train_data_dir", dataset, "--output_dir", out,
                                                     "--resolution", "64", "--max_train_steps", "2", "--seed", "7",
                                                     "--cache_latents", "--learning_rate", "1e-3",
                                                     "--optimizer_type", "AdamW", "--max_grad_norm", "0", *extra])
        assert rc == 0, err
        return {k: v.detach().clone() for k, v in run.parts.bundle.unet.state_dict().items()}, err

    (plain, _), (swapped, err) = weights(str(tmp_path / "a")), weights(str(tmp_path / "b"), "--blocks_to_swap", "1")
    assert "blocks_to_swap 1:" in err, err
    initial = tiny.build_tiny_lumina()["transformer"].state_dict()
    assert not torch.equal(plain["layers.1.attention.qkv.weight"], initial["layers.1.attention.qkv.weight"])
    assert all(torch.equal(plain[k], swapped[k]) for k in plain)


def test_gen_img_renders_tiny_lumina(tmp_path, monkeypatch):
    """gen_img.py through the family registry: a Lumina 2 image with a negative prompt (CFG)."""
    out = tmp_path / "gen"
    monkeypatch.setattr(sys, "argv", ["gen_img.py", "--ckpt", "tiny-lumina", "--prompt", "a dog --n blurry",
                                      "--W", "64", "--H", "64", "--steps", "2", "--outdir", str(out)])
    with pytest.raises(SystemExit) as e:
        runpy.run_path("gen_img.py", run_name="__main__")
    assert e.value.code in (0, None)
    assert [f for f in os.listdir(out) if f.endswith(".png")]


@pytest.mark.parametrize("prediction", ["raw", "sigma_scaled"])
def test_weighting_scheme_weights_only_the_sigma_scaled_loss(prediction):
    """sd-scripts' Lumina loss for one batch, recomputed in float64: lumina_train_network's
    get_noise_pred_and_target takes its weighting from lumina_train_util.apply_model_prediction_type,
    which returns one only for sigma_scaled; raw is the mean of (NextDiT(x_t, 1 - sigma) - (x0 - n))^2,
    unweighted, whatever weighting_scheme says (so FlowSpec.weights_raw_loss is False). sigma_scaled:
    the weight sigma^-2 (sigma_sqrt) times the clean-latent loss (x_t + sigma NextDiT - x0)^2 (home.py
    says why the target is x0, not sd-scripts' x0 - n). The weight is 1 / sigma^2 >= 1.02 here, far
    beyond float32 roundoff, so a weight wrongly applied or left out fails."""
    opts = options_from_values("train_lora", {"pretrained_model_name_or_path": "tiny-lumina",
                                              "weighting_scheme": "sigma_sqrt", "model_prediction_type": prediction})
    losses = flow_loss.FlowLosses(opts, flow_loss.flow_options(opts, "lumina"))
    parts = tiny.build_tiny_lumina()
    fm = home.LuminaFamilyModel(parts["transformer"], [parts["gemma2"]], [parts["tokenizer"]], system_prompt=SYSTEM)
    x0 = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ids, mask = fm.tokenize(["a dog", "a red cat"])
        cond = fm.encode([ids, mask], None)
        d = losses.draw(x0, [torch.Generator().manual_seed(s) for s in (5, 6)])
        got = losses.per_sample_loss(fm.unet_forward(losses.noisy_latents(x0, d), d.timesteps, cond), x0, d)
        dit = parts["transformer"].double()
        s = d.sigmas.double().view(-1, 1, 1, 1)
        x0d, n = x0.double(), d.noise.double()
        xt = (1 - s) * x0d + s * n
        out = dit(xt, 1 - s.flatten(), cond.hidden_states.double(), mask)
    assert float(s.max()) < 0.99  # every weight 1 / sigma^2 is above 1.02
    if prediction == "raw":
        want = ((out - (x0d - n)) ** 2).mean(dim=(1, 2, 3))
    else:
        want = s.flatten() ** -2 * ((xt + s * out - x0d) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=0), (got, want)
    assert not flow_matching.flow_spec("lumina").weights_raw_loss


def test_fused_backward_pass_full_finetune_equals_the_plain_step(dataset, tmp_path, train):
    """lumina_train.py's fused_backward_pass (each parameter stepped in its gradient hook) trains the
    same transformer as the plain AdamW step (no clipping in either), as FLUX.1's test shows it."""
    def weights(out, *extra):
        rc, _, err, run = train("finetune", [
            "--pretrained_model_name_or_path", "tiny-lumina", "--train_data_dir", dataset, "--output_dir",
            str(tmp_path / out), "--resolution", "64", "--max_train_steps", "2", "--cache_latents", "--seed", "7",
            "--learning_rate", "1e-3", "--optimizer_type", "AdamW", "--max_grad_norm", "0", *extra])
        assert rc == 0, err
        assert type(run.parts.stepper).__name__ == ("FusedStepper" if extra else "PlainStepper")
        return {k: v.detach().clone() for k, v in run.parts.bundle.unet.state_dict().items()}

    plain, fused = weights("plain"), weights("fused", "--fused_backward_pass")
    initial = tiny.build_tiny_lumina()["transformer"].state_dict()
    assert plain.keys() == fused.keys() == initial.keys()
    for k in plain:
        moved = float((plain[k] - initial[k]).abs().max())
        if k == "norm_final.weight":  # in the released weights, never used (nextdit.py)
            assert moved == 0 and torch.equal(fused[k], initial[k])
            continue
        assert moved > 0, k
        # AdamW's first steps move each element by about the rate; the two orders of the same float32
        # update differ in the last bits
        assert float((plain[k] - fused[k]).abs().max()) <= 1e-6 * max(moved, 1e-3), k
