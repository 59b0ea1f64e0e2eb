"""train_lora on Anima (sd-scripts' anima_train_network.py) through the entry script, on tiny-anima
(64 px): the LoRA file in sd-scripts' layout and metadata with both caches on disk, exact resume,
Anima's flow rules against float64 formulas (its own defaults: sigmoid draws, shift 1, the raw
velocity; the DiT takes sigma; the samples' shifted linear schedule), and the refusals before any
weight loads; a sample image."""
from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.models.families.anima import tiny
from library.training import flow_loss, flow_matching, flow_sampling
from networks import lora_anima
from tests.conftest import read
from tests.helpers import make_opts


def anima_args(data, out, *extra):
    return ["--pretrained_model_name_or_path", "tiny-anima", "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", "2", "--cache_latents", "--seed", "7",
            "--network_dim", "4", "--network_alpha", "4", "--learning_rate", "1e-2", *extra]


def _expected_names() -> set[str]:
    """sd-scripts' default targets, written out: every attention projection and MLP layer of each block."""
    layers = [f"{a}_{p}_proj" for a in ("self_attn", "cross_attn") for p in ("q", "k", "v", "output")] + \
        ["mlp_layer1", "mlp_layer2"]
    return {f"lora_unet_blocks_{i}_{layer}" for i in range(2) for layer in layers}


def test_anima_lora_trains_with_caches_and_writes_sd_scripts_layout(dataset, tmp_path, train):
    out = str(tmp_path / "out")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red shape --w 64 --h 64 --s 3 --l 2.0 --d 5 --n blurry\n")
    rc, _, err, run = train("train_lora", anima_args(dataset, out, "--cache_latents_to_disk",
                                                     "--cache_text_encoder_outputs_to_disk",
                                                     "--sample_prompts", str(prompts), "--sample_every_n_steps", "2"))
    assert rc == 0, err
    # a sample with CFG on the shifted linear schedule, decoded by the Qwen-Image VAE
    assert len([f for f in os.listdir(os.path.join(out, "sample")) if f.endswith(".png")]) == 1
    sd, meta = read(os.path.join(out, "last.safetensors"))
    assert {k.split(".")[0] for k in sd} == _expected_names()
    assert all(float(sd[k].abs().max()) > 0 for k in sd if k.endswith("lora_up.weight"))  # every module trained
    assert (meta["ss_network_module"], meta["ss_base_model_version"], meta["modelspec.architecture"],
            meta["ss_timestep_sampling"], meta["ss_discrete_flow_shift"]) == \
        ("networks.lora_anima", "anima", "anima-preview/lora", "sigmoid", "1.0")
    assert "ss_model_prediction_type" not in meta  # sd-scripts' Anima trainer records none
    assert (meta["modelspec.implementation"], meta["modelspec.prediction_type"]) == \
        ("https://huggingface.co/circlestone-labs/Anima", "epsilon")  # sd-scripts 48d368fa's sai_model_spec
    # Qwen3 frozen, the caches on disk beside the images
    assert not any(p.requires_grad for p in run.parts.bundle.text_encoders[0].parameters())
    cache = os.path.join(dataset, "2_sks shape", ".sdcache")
    assert len(os.listdir(cache)) >= 4  # 2 latents + 2 text entries
    # the file builds sd-scripts' network on a fresh tiny-anima
    net, _ = lora_anima.create_network_from_weights(1.0, os.path.join(out, "last.safetensors"), None, None,
                                                    tiny.build()["dit"])
    assert {lora.lora_name for lora in net.unet_loras} == _expected_names()


def test_anima_lora_resume_is_bit_identical(dataset, tmp_path, train):
    args = ["--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state", "--cache_text_encoder_outputs"]
    whole = str(tmp_path / "whole")
    rc, _, err, u = train("train_lora", anima_args(dataset, whole, *args))
    assert rc == 0, err
    state = os.path.join(whole, "last-step00000002-state")
    resumed = str(tmp_path / "resumed")
    rc, _, err, r = train("train_lora", anima_args(dataset, resumed, *args, "--resume", state))
    assert rc == 0, err
    assert r.progress.global_step == 4 and r.progress.loss_log == u.progress.loss_log
    a, b = load_file(os.path.join(whole, "last.safetensors")), load_file(os.path.join(resumed, "last.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    mid = load_file(os.path.join(whole, "last-step00000002.safetensors"))
    assert not torch.equal(mid["lora_unet_blocks_0_self_attn_q_proj.lora_up.weight"],
                           a["lora_unet_blocks_0_self_attn_q_proj.lora_up.weight"])


def test_anima_flow_rules_against_float64():
    opts = make_opts("train_lora", pretrained_model_name_or_path="tiny-anima")
    o = flow_loss.flow_options(opts, "anima")
    assert (o.timestep_sampling, o.discrete_flow_shift, o.model_prediction_type) == ("sigmoid", 1.0, "raw")
    # sigmoid: sigma = 1 / (1 + exp(-scale n)), n the sample generator's first normal draw
    gens = [torch.Generator().manual_seed(s) for s in (3, 4, 5)]
    drawn = flow_matching.sample_timesteps(o, gens, (8, 8))
    n = torch.tensor([torch.randn(1, generator=torch.Generator().manual_seed(s)).item() for s in (3, 4, 5)],
                     dtype=torch.float64)
    want = 1 / (1 + torch.exp(-n))
    assert torch.allclose(drawn.sigmas.double(), want, rtol=0, atol=1e-7)
    assert torch.equal(drawn.model_timesteps, drawn.sigmas)  # the DiT takes sigma itself
    # shift with an explicit discrete_flow_shift: s sigma / (1 + (s - 1) sigma)
    opts = make_opts("train_lora", pretrained_model_name_or_path="tiny-anima", timestep_sampling="shift",
                     discrete_flow_shift=3.0, sigmoid_scale=1.5)
    o = flow_loss.flow_options(opts, "anima")
    drawn = flow_matching.sample_timesteps(o, [torch.Generator().manual_seed(s) for s in (3, 4, 5)], (8, 8))
    base = 1 / (1 + torch.exp(-1.5 * n))
    assert torch.allclose(drawn.sigmas.double(), 3 * base / (1 + 2 * base), rtol=0, atol=1e-7)
    # raw prediction: the velocity against noise - x0, weight 1 (weighting_scheme uniform)
    x0, noise, out = torch.randn(2, 16, 2, 2), torch.randn(2, 16, 2, 2), torch.randn(2, 16, 2, 2)
    pred, target, weight = flow_matching.prediction_and_target(o, out, None, x0, noise, torch.tensor([0.3, 0.6]))
    assert torch.equal(pred, out) and torch.equal(target, noise - x0) and torch.equal(weight, torch.ones(2))
    # weighting_scheme weights the raw loss (sd-scripts' compute_loss_weighting_for_anima): cosmap
    o = flow_loss.flow_options(make_opts("train_lora", pretrained_model_name_or_path="tiny-anima",
                                         weighting_scheme="cosmap"), "anima")
    s = torch.tensor([0.3, 0.6], dtype=torch.float64)
    _, _, weight = flow_matching.prediction_and_target(o, out, None, x0, noise, s.float())
    assert torch.allclose(weight.double(), 2 / (math.pi * (1 - 2 * s + 2 * s * s)), rtol=1e-6, atol=0)
    assert ("weighting_scheme" not in dict(flow_matching.ignored_options(o)))
    # samples: linspace(1, 0, steps + 1) shifted by 3 (sd-scripts' do_sample), ends kept
    sig = flow_sampling.schedule("anima", 4, (8, 8))
    t = [1 - i / 4 for i in range(5)]
    assert sig == pytest.approx([3 * s / (1 + 2 * s) for s in t], abs=1e-15)


@pytest.mark.parametrize("extra, message", [
    (["--fp8_base"], "fp8_base: not with the Anima model tiny-anima: sd-scripts' Anima trainer does not support"),
    (["--apply_t5_attn_mask"], "apply_t5_attn_mask: not with the Anima model tiny-anima: FLUX.1 / SD3's T5-XXL"),
    (["--model_prediction_type", "raw"], "model_prediction_type: not with the Anima model"),
    # another family's own option (Lumina 2's), though Anima's folder names no other family
    (["--gemma2", "g.safetensors"], "gemma2: not with the Anima model tiny-anima: a Lumina 2 option"),
    (["--system_prompt", "x"], "system_prompt: not with the Anima model tiny-anima: a Lumina 2 option"),
    # attn_mode's kernels: sageattn cannot train; flash / xformers need CUDA and their package
    (["--attn_mode", "sageattn"], "attn_mode sageattn: sageattention has no backward pass"),
    pytest.param(["--attn_mode", "flash"], "attn_mode flash: ", marks=pytest.mark.skipif(
        torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None, reason="flash_attn runs here")),
])
def test_anima_refusals_are_one_line(dataset, tmp_path, run_script, extra, message):
    rc, _, err = run_script("train_lora", anima_args(dataset, str(tmp_path / "o"), *extra))
    assert rc == 2 and message in err, err
    assert len([ln for ln in err.splitlines() if ln.startswith("error")]) == 1


def test_other_family_lora_and_methods_are_refused(dataset, tmp_path, run_script):
    flux = {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 64),
            "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(192, 4),
            "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(4.0)}
    path = str(tmp_path / "flux.safetensors")
    save_file(flux, path)
    rc, _, err = run_script("train_lora", anima_args(dataset, str(tmp_path / "o"), "--network_weights", path))
    # refused from the file's header, before the model loads
    assert rc == 2 and "lora_unet_double_blocks_0_img_attn_qkv is no module of an Anima LoRA" in err, err
    assert "network_module: unset" in err and "transformer LoRA modules" not in err
    rc, _, err = run_script("train_textual_inversion", ["--pretrained_model_name_or_path", "tiny-anima",
                                                        "--train_data_dir", dataset, "--output_dir", str(tmp_path / "f"),
                                                        "--resolution", "64", "--max_train_steps", "1",
                                                        "--token_string", "sks", "--init_word", "shape"])
    assert rc == 2 and "does not train Anima" in err, err
    rc, _, err = run_script("train_lora", ["--pretrained_model_name_or_path", "tiny-flux", "--train_data_dir", dataset,
                                           "--output_dir", str(tmp_path / "g"), "--qwen3", str(tmp_path),
                                           "--max_train_steps", "1", "--resolution", "64"])
    assert rc == 2 and "qwen3: not with the FLUX.1 model tiny-flux: an Anima option" in err, err


def test_anima_trains_from_files_and_its_text_lengths_matter(dataset, tmp_path, train):
    """The DiT file without its adapter + llm_adapter_path + a qwen3 folder + a diffusers VAE folder +
    t5_tokenizer_path train exactly as tiny-anima (same weights); qwen3_max_token_length and
    t5_max_token_length change what the DiT sees (the first loss)."""
    m = tiny.build()
    from library.models.families.anima import weights

    weights.save_dit(m["dit"], str(tmp_path / "full.safetensors"))
    sd = load_file(str(tmp_path / "full.safetensors"))
    save_file({k[4:]: v for k, v in sd.items() if not k.startswith("net.llm_adapter.")}, str(tmp_path / "dit.safetensors"))
    save_file({k[len("net.llm_adapter."):]: v for k, v in sd.items() if k.startswith("net.llm_adapter.")},
              str(tmp_path / "adapter.safetensors"))
    for name in ("qwen3", "qwen3_tokenizer"):
        m[name].save_pretrained(tmp_path / "qwen3")
    m["vae"].save_pretrained(tmp_path / "vae")
    m["t5_tokenizer"].save_pretrained(tmp_path / "t5")
    lengths = ["--qwen3_max_token_length", "16", "--t5_max_token_length", "12", "--max_train_steps", "1"]
    rc, _, err, a = train("train_lora", anima_args(dataset, str(tmp_path / "a"), *lengths))
    assert rc == 0, err
    files = anima_args(dataset, str(tmp_path / "b"), *lengths, "--llm_adapter_path", str(tmp_path / "adapter.safetensors"),
                       "--qwen3", str(tmp_path / "qwen3"), "--vae", str(tmp_path / "vae"),
                       "--t5_tokenizer_path", str(tmp_path / "t5"))
    files[1] = str(tmp_path / "dit.safetensors")
    rc, _, err, b = train("train_lora", files)
    assert rc == 0, err
    # same weights; a loaded Qwen3 may attend with another kernel than a built one (float32 ulps)
    assert b.progress.loss_log == pytest.approx(a.progress.loss_log, rel=1e-5)
    for opt in ("--qwen3_max_token_length", "--t5_max_token_length"):
        other = list(lengths)
        other[other.index(opt) + 1] = "4"
        rc, _, err, c = train("train_lora", anima_args(dataset, str(tmp_path / opt[2:]), *other))
        assert rc == 0, err
        assert c.progress.loss_log != a.progress.loss_log, opt
