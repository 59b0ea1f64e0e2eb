"""FLUX.1 full fine-tuning through the entry scripts on the built-in tiny-flux (64 px, 2 steps).

- the first micro-step's loss equals an independent float64 recomputation: the image encoded by a
  fresh copy of the tiny autoencoder, the sample's generator drawing its noise and then its
  sigma (sd-scripts' sigma table, shift 3), x_t = (1 - sigma) x0 + sigma noise, the initial
  transformer's output (a fresh copy, float64, dev's guidance 3.5), target noise - x0 (raw);
- the saved transformer is one file in BFL's layout that reloads equal to the trained weights;
- batch 2 == batch 1 with gradient accumulation 2 (same global batch, SGD);
- the options this family cannot honour fail before any weight loads, in one line.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from library.run.run_state import HOOKS


def flux_args(data, out, *extra):
    return ["--pretrained_model_name_or_path", "tiny-flux", "--train_data_dir", data,
            "--output_dir", out, "--resolution", "64", "--max_train_steps", "2",
            "--learning_rate", "1e-3", "--cache_latents", "--seed", "7", *extra]


def _reference_loss(run, epoch, i, mask=None):
    """The flow-matching loss of sample i in ``epoch`` with the initial weights, in float64
    (``mask``: the latent-size (h, w) mask multiplying the elementwise loss before its mean)."""
    from library.data import step_plan
    from library.models.families.flux import flux, flux_ae, flux_text, tiny_flux

    parts = tiny_flux.build_tiny_flux("dev")  # the initial weights (fixed seed), a fresh copy
    model = parts["transformer"].double().eval()
    ae, clip_l, t5_model = parts["ae"].double(), parts["clip_l"].double(), parts["t5"].double()
    item = run.tset.samples[i]
    assert not run.tset.flip(i, epoch)
    rgb = np.asarray(Image.open(item.path).convert("RGB"), dtype=np.float64)
    pixels = torch.from_numpy(rgb / 127.5 - 1.0).permute(2, 0, 1)[None]
    with torch.no_grad():
        x0 = flux_ae.encode_latents(ae, pixels)  # (mean - shift) * scale
        g = torch.Generator().manual_seed(step_plan.derive_seed("sample", 7, epoch, i))
        noise = torch.randn(tuple(x0.shape[1:]), generator=g)[None].double()
        u = float(torch.rand(1, generator=g))  # weighting_scheme uniform: sigma's table index
        index = min(int(u * 1000), 999)
        t, s = (1000 - index) / 1000, 3.0  # discrete_flow_shift 3.0
        sigma = s * t / (1 + (s - 1) * t)
        x_t = (1 - sigma) * x0 + sigma * noise
        tokens = flux_text.tokenize(parts["clip_tokenizer"], parts["t5_tokenizer"],
                                    [run.tset.caption(i, epoch)], 512)
        cond = flux_text.encode(clip_l, t5_model, tokens, False)
        h, w = x0.shape[2] // 2, x0.shape[3] // 2
        out = model(flux.pack_latents(x_t), flux.image_ids(h, w, 1).double(), cond.t5_out.double(),
                    torch.zeros(1, cond.t5_out.shape[1], 3, dtype=torch.float64),
                    torch.tensor([sigma], dtype=torch.float64), cond.l_pooled.double(),
                    torch.tensor([3.5], dtype=torch.float64))
        v = flux.unpack_latents(out, h, w)
    err = (v - (noise - x0)) ** 2
    return float((err if mask is None else err * mask).mean())


def test_flux_full_finetune_loss_and_saved_transformer(dataset, tmp_path, train):
    from library.models.families.flux import flux_checkpoint
    from library.models.families.flux.tiny_flux import build_tiny_flux

    losses = []

    def first_loss(run, epoch, idx, loss):
        losses.append((epoch, list(idx), float(loss.detach())))
        return loss

    out = tmp_path / "out"
    with HOOKS.add(after_micro_step=first_loss):
        rc, stdout, err, run = train("train_dreambooth", flux_args(
            dataset, str(out), "--model_prediction_type", "raw"))
    assert rc == 0, err
    assert sorted(os.listdir(out)) == ["last.safetensors"]
    assert len(losses) == 2
    epoch, idx, loss = losses[0]
    ref = _reference_loss(run, epoch, idx[0])
    assert loss == pytest.approx(ref, rel=1e-4, abs=1e-7)

    # one file in BFL's layout, reloading equal to the trained weights, which moved
    path = str(out / "last.safetensors")
    weights = flux_checkpoint.read_transformer(path)
    assert weights.layout == "bfl" and weights.variant == "dev"
    assert "double_blocks.0.img_attn.qkv.weight" in weights.state_dict
    reloaded, _ = flux_checkpoint.load_transformer(path)
    trained = run.parts.bundle.unet.state_dict()
    assert reloaded.state_dict().keys() == trained.keys()
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, trained[k].float()), k
    initial = build_tiny_flux("dev")["transformer"].state_dict()
    assert not torch.equal(initial["img_in.weight"], trained["img_in.weight"])


def _final_weights(train, dataset, out, *extra):
    rc, _, err, run = train("finetune", flux_args(
        dataset, out, "--optimizer_type", "SGD", "--learning_rate", "0.5", *extra))
    assert rc == 0, err
    return {k: v.detach().clone() for k, v in run.parts.bundle.unet.state_dict().items()}, run


def test_flux_batch_2_equals_batch_1_with_accumulation_2(dataset, tmp_path, train):
    a, ra = _final_weights(train, dataset, str(tmp_path / "a"), "--train_batch_size", "2")
    b, rb = _final_weights(train, dataset, str(tmp_path / "b"), "--gradient_accumulation_steps", "2")
    assert ra.progress.loss_log == pytest.approx(rb.progress.loss_log, rel=1e-5)
    initial = build_initial()
    moved = 0
    for k in a:
        scale = float((a[k] - initial[k]).abs().max())
        moved += scale > 0
        assert float((a[k] - b[k]).abs().max()) <= 1e-5 * max(scale, 1e-3), k
    assert moved > len(a) // 2


def build_initial():
    from library.models.families.flux.tiny_flux import build_tiny_flux

    return build_tiny_flux("dev")["transformer"].state_dict()


@pytest.fixture
def no_flux_loading(monkeypatch, no_weight_loading):
    """Fails the test if FLUX weights (or any model's) are loaded."""
    from library.models.families.flux import flux_loading

    def refuse(*a, **k):
        raise AssertionError("FLUX weights were loaded before the options were checked")

    monkeypatch.setattr(flux_loading, "load_flux", refuse)


@pytest.mark.parametrize("extra, message", [
    (["--zero_terminal_snr"], "zero_terminal_snr: not with the FLUX.1 model"),
    (["--v_parameterization"], "v_parameterization: not with the FLUX.1 model"),
    (["--vae", "x.safetensors"], "vae: not with the FLUX.1 model"),
    (["--num_last_block_to_freeze", "2"], "num_last_block_to_freeze: not with the FLUX.1 model"),
    (["--clip_g", "x.safetensors"], "clip_g: SD3's CLIP-G"),
    (["--timestep_sampling", "logit"], "timestep_sampling"),
    (["--loss_type", "huber"], "huber_schedule snr: loss_type huber with the FLUX.1 model takes"),
])
def test_flux_unsupported_options_fail_before_loading(dataset, tmp_path, run_script, no_flux_loading,
                                                      extra, message):
    rc, _, err = run_script("train_dreambooth", flux_args(dataset, str(tmp_path / "o"), *extra))
    assert rc != 0 and message in err and "Traceback" not in err


def test_flux_options_refused_with_an_sd_model(dataset, tmp_path, run_script, no_weight_loading):
    rc, _, err = run_script("train_dreambooth", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset, "--output_dir",
        str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "2", "--guidance_scale", "1.0"])
    assert rc != 0 and "guidance_scale: an option of Chroma and FLUX.1 models" in err


def test_flux_lora_with_an_sd_network_module_refused_in_one_line(dataset, tmp_path, run_script, no_flux_loading):
    # an explicit SD module (unset means the family's LoRA: networks.lora_flux)
    rc, _, err = run_script("train_lora", flux_args(dataset, str(tmp_path / "o"), "--network_module", "networks.lora"))
    assert rc != 0 and 'FLUX.1 trains with network_module = "networks.lora_flux"' in err and "Traceback" not in err


def _flux_opts(dataset, *argv):
    from library.config.parse import parse_args

    return parse_args("train_dreambooth", ["--pretrained_model_name_or_path", "tiny-flux",
                                           "--train_data_dir", dataset, "--resolution", "64",
                                           "--max_train_steps", "2", "--output_dir", "unused",
                                           *[str(a) for a in argv]])


# option -> (settings both runs share, the changed setting): what the flow-matching loss reads
LOSS_OPTION_CASES = {
    "timestep_sampling": ([], ["--timestep_sampling", "shift"]),
    "sigmoid_scale": (["--timestep_sampling", "sigmoid"], ["--sigmoid_scale", "2.0"]),
    "discrete_flow_shift": ([], ["--discrete_flow_shift", "1.0"]),
    "model_prediction_type": ([], ["--model_prediction_type", "raw"]),
    "weighting_scheme": ([], ["--weighting_scheme", "logit_normal"]),
    "logit_mean": (["--weighting_scheme", "logit_normal"], ["--logit_mean", "1.0"]),
    "logit_std": (["--weighting_scheme", "logit_normal"], ["--logit_std", "0.5"]),
    "mode_scale": (["--weighting_scheme", "mode"], ["--mode_scale", "0.5"]),
}


def _loss_of(opts):
    """(sigmas, per-sample loss) of four fixed samples under the run's flow losses."""
    from library.training.flow_loss import FlowLosses
    from library.training.flow_loss import flow_options

    losses = FlowLosses(opts, flow_options(opts, "flux"))
    latents = torch.randn(4, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    pred = torch.randn(4, 16, 8, 8, generator=torch.Generator().manual_seed(2))
    d = losses.draw(latents, [torch.Generator().manual_seed(10 + k) for k in range(4)])
    return d.sigmas, losses.per_sample_loss(pred, latents, d)


@pytest.mark.parametrize("name", sorted(LOSS_OPTION_CASES))
def test_flux_loss_options_change_the_loss(dataset, name):
    shared, changed = LOSS_OPTION_CASES[name]
    s0, l0 = _loss_of(_flux_opts(dataset, *shared))
    s1, l1 = _loss_of(_flux_opts(dataset, *shared, *changed))
    assert not torch.equal(l0, l1), name
    if name != "model_prediction_type":
        assert not torch.equal(s0, s1), name


@pytest.fixture(scope="module")
def flux_bundle():
    from library.models.flow_family import load_from_options
    from types import SimpleNamespace

    return load_from_options(SimpleNamespace(pretrained_model_name_or_path="tiny-flux", clip_l=None,
                                             t5xxl=None, ae=None))


@pytest.mark.parametrize("name, changed", [
    ("guidance_scale", ["--guidance_scale", "1.0"]),
    ("t5xxl_max_token_length", ["--t5xxl_max_token_length", "16"]),
    ("apply_t5_attn_mask", ["--apply_t5_attn_mask"]),
])
def test_flux_text_and_guidance_options_change_the_prediction(dataset, flux_bundle, name, changed):
    from library.models.flow_family import family_model_for

    def prediction(opts):
        fm = family_model_for(flux_bundle, opts)
        with torch.no_grad():
            cond = fm.encode(fm.tokenize(["a red square"]), None)
            x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3))
            return cond, fm.unet_forward(x, torch.tensor([0.7]), cond)

    c0, p0 = prediction(_flux_opts(dataset))
    c1, p1 = prediction(_flux_opts(dataset, *changed))
    assert c0.hidden_states.shape[1] == 512  # dev's default T5 length
    if name == "t5xxl_max_token_length":
        assert c1.hidden_states.shape[1] == 16
    assert not torch.allclose(p0, p1), name


def test_flux_trains_from_single_files(dataset, tmp_path, train):
    """A BFL transformer file with sd-scripts' clip_l, t5xxl and ae files trains like the
    built-in (the same weights: the same first loss) and saves back one BFL file."""
    from library.models.families.flux import flux_saving
    from library.models.families.flux.tiny_flux import build_tiny_flux

    paths = flux_saving.save_single_files(build_tiny_flux("dev"), str(tmp_path))
    losses = {}

    def record(key):
        def f(run, epoch, idx, loss):
            losses.setdefault(key, float(loss.detach()))
            return loss
        return f

    with HOOKS.add(after_micro_step=record("builtin")):
        rc, _, err, _ = train("train_dreambooth", flux_args(dataset, str(tmp_path / "a")))
    assert rc == 0, err
    args = flux_args(dataset, str(tmp_path / "b"), "--clip_l", paths["clip_l"], "--t5xxl",
                     paths["t5xxl"], "--ae", paths["ae"])
    args[1] = paths["transformer"]
    with HOOKS.add(after_micro_step=record("files")):
        rc, _, err, run = train("train_dreambooth", args)
    assert rc == 0, err
    assert losses["files"] == pytest.approx(losses["builtin"], rel=1e-6)
    from library.models.families.flux import flux_checkpoint

    assert flux_checkpoint.read_transformer(str(tmp_path / "b" / "last.safetensors")).layout == "bfl"
    # without the text encoder files: one line before loading
    rc, _, err, _ = train("train_dreambooth", args[:-6])
    assert rc != 0 and "clip_l: required with a single-file FLUX.1 transformer" in err


def test_flux_diffusers_folder_saves_a_transformer_folder(dataset, tmp_path, train):
    """A diffusers FLUX folder trains and its transformer is saved back in the diffusers layout
    (a folder with config.json), reloading equal to the trained weights."""
    from library.models.families.flux import flux_checkpoint, flux_saving
    from library.models.families.flux.tiny_flux import build_tiny_flux

    src = str(tmp_path / "flux-diffusers")
    flux_saving.save_diffusers_folder(build_tiny_flux("dev"), "dev", src)
    args = flux_args(dataset, str(tmp_path / "out"))
    args[1] = src
    rc, _, err, run = train("finetune", args)
    assert rc == 0, err
    saved = tmp_path / "out" / "last"
    assert (saved / "config.json").is_file()
    reloaded, w = flux_checkpoint.load_transformer(str(saved))
    assert w.layout == "diffusers"
    trained = run.parts.bundle.unet.state_dict()
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, trained[k]), k


def test_flux_resume_is_exact(dataset, tmp_path, train):
    """4 steps in one run == 2 steps, a training state, and a resumed run of the other 2: the
    same transformer bit for bit (one thread)."""
    from safetensors.torch import load_file

    def args(out, *extra):
        a = flux_args(dataset, str(tmp_path / out), *extra)
        a[a.index("--max_train_steps") + 1] = "4"
        return a

    rc, _, err, _ = train("train_dreambooth", args("a", "--save_every_n_steps", "2", "--save_state"))
    assert rc == 0, err
    rc, out, err, _ = train("train_dreambooth", args(
        "b", "--resume", str(tmp_path / "a" / "last-step00000002-state")))
    assert rc == 0, err
    a = load_file(str(tmp_path / "a" / "last.safetensors"))
    b = load_file(str(tmp_path / "b" / "last.safetensors"))
    mid = load_file(str(tmp_path / "a" / "last-step00000002.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["img_in.weight"], mid["img_in.weight"])  # the resumed steps trained


def test_flux_fused_backward_pass_equals_the_plain_step(dataset, tmp_path, train):
    """fused_backward_pass (each parameter stepped in its gradient hook) trains the same FLUX.1
    transformer as the plain AdamW step (no clipping in either)."""
    def weights(out, *extra):
        rc, _, err, run = train("train_dreambooth", flux_args(
            dataset, str(tmp_path / out), "--optimizer_type", "AdamW", "--max_grad_norm", "0", *extra))
        assert rc == 0, err
        return {k: v.detach().clone() for k, v in run.parts.bundle.unet.state_dict().items()}

    plain, fused = weights("plain"), weights("fused", "--fused_backward_pass")
    initial = build_initial()
    for k in plain:
        moved = float((plain[k] - initial[k]).abs().max())
        assert moved > 0, k
        assert float((plain[k] - fused[k]).abs().max()) <= 1e-6 * max(moved, 1e-3), k


def test_flux_train_text_encoder_has_no_effect_as_in_flux_train(dataset, tmp_path, train):
    """flux_train.py has no train_text_encoder (the GUI's fine-tune tab writes it true; sd-scripts
    ignores a config's key): one warning, CLIP-L and T5 untouched and out of the optimizer, the
    transformer trained; learning_rate_te warned likewise."""
    from library.models.families.flux.tiny_flux import build_tiny_flux

    rc, _, err, run = train("train_dreambooth", flux_args(dataset, str(tmp_path / "o"), "--train_text_encoder",
                                                          "--learning_rate_te", "1e-3", "--max_train_steps", "1"))
    assert rc == 0, err
    assert "option train_text_encoder has no effect with the FLUX.1 model" in err
    assert "text_encoder_lr (learning_rate_te) has no effect with the flux model" in err
    fresh = build_tiny_flux("dev")
    for name, te in (("clip_l", run.parts.bundle.text_encoders[0]), ("t5", run.parts.bundle.text_encoders[1])):
        ref = fresh[name].state_dict()
        assert all(torch.equal(v, ref[k]) for k, v in te.state_dict().items()), name
        assert not any(p.requires_grad for p in te.parameters()), name
    ref = fresh["transformer"].state_dict()
    assert any(not torch.equal(v, ref[k]) for k, v in run.parts.bundle.unet.state_dict().items())
