"""Anima full fine-tuning (sd-scripts' anima_train.py) on tiny-anima (64 px, 2-4 steps): sd-scripts'
per-part learning rates as optimizer groups against a hand-written table of its rules, two SGD steps
against float64 arithmetic over the gradients the run produced (a part at 0 exactly unchanged),
the fused backward pass against the plain one, exact resume, the saved file in the released layout;
and the thin entry scripts."""
from __future__ import annotations

import os
import runpy
import sys

import pytest
import torch
from safetensors.torch import load_file

from library.models.families.anima import home, tiny, weights
from tests.conftest import reset_accelerate
from tests.helpers import options_from_values

RATES = {"learning_rate": 1e-2, "self_attn_lr": 2e-2, "cross_attn_lr": 1.5e-2, "mlp_lr": 0.0, "mod_lr": 5e-3,
         "llm_adapter_lr": 0.0}


def full_args(data, out, *extra):
    return ["--pretrained_model_name_or_path", "tiny-anima", "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", "2", "--cache_latents", "--seed", "7", *extra]


def rate_args(rates=RATES):
    return [a for k, v in rates.items() for a in (f"--{k}", str(v))]


def _expected_parts(dit) -> dict[str, str]:
    """sd-scripts' get_anima_param_groups written out for tiny-anima's modules (2 blocks): each name's part."""
    out = {}
    for i in range(dit.config.num_blocks):
        b = f"blocks.{i}."
        for attn in ("self_attn", "cross_attn"):
            for t in ("q_proj", "k_proj", "v_proj", "output_proj", "q_norm", "k_norm"):
                out[f"{b}{attn}.{t}.weight"] = attn
        for t in ("layer1", "layer2"):
            out[f"{b}mlp.{t}.weight"] = "mlp"
        for sub in ("self_attn", "cross_attn", "mlp"):  # adaln_modulation_self_attn: mod, not self_attn
            for j in (1, 2):
                out[f"{b}adaln_modulation_{sub}.{j}.weight"] = "mod"
    for j in (1, 2):
        out[f"final_layer.adaln_modulation.{j}.weight"] = "mod"  # ".adaln_modulation" matches it too
    for name in ("x_embedder.proj.1.weight", "t_embedder.1.linear_1.weight", "t_embedder.1.linear_2.weight",
                 "final_layer.linear.weight", "t_embedding_norm.weight"):
        out[name] = "base"
    for name, _ in dit.llm_adapter.named_parameters():
        out["llm_adapter." + name] = "llm_adapter"  # its blocks' self_attn / mlp too: llm_adapter comes first
    return out


def test_part_groups_follow_sd_scripts_rules():
    dit = tiny.build()["dit"]
    opts = options_from_values("train_dreambooth", {"pretrained_model_name_or_path": "tiny-anima", **RATES,
                                                    "cross_attn_lr": None})
    groups, names = home.param_groups(dit, opts)
    parts = _expected_parts(dit)
    assert set(parts) == {n for n, _ in dit.named_parameters()}
    lr = {"base": 1e-2, "self_attn": 2e-2, "cross_attn": 1e-2, "mod": 5e-3}  # unset: learning_rate; 0: frozen
    assert names == ["base", "self_attn", "cross_attn", "mod"]  # sd-scripts' order, frozen parts left out
    by_id = {id(p): n for n, p in dit.named_parameters()}
    got = {by_id[id(p)]: g["lr"] for g in groups for p in g["params"]}
    assert got == {n: lr[part] for n, part in parts.items() if part in lr}
    assert all(p.requires_grad == (parts[n] in lr) for n, p in dit.named_parameters())
    everything = options_from_values("train_dreambooth", {"pretrained_model_name_or_path": "tiny-anima",
                                                          "learning_rate": 1e-3, **{k: 0.0 for k in home.PART_RATES}})
    groups, names = home.param_groups(tiny.build()["dit"], everything)
    assert names == ["base"]  # only the base part is left (x_embedder, t_embedder, final linear, t norm)
    nothing = everything.replace(learning_rate=0.0)
    with pytest.raises(weights.AnimaModelError, match="nothing to train"):
        home.param_groups(tiny.build()["dit"], nothing)


class GradRecorder:
    """torch.optim.SGD.step wrapped: each step's (lr, gradient in float64) per parameter, before the update."""

    def __init__(self, monkeypatch):
        self.steps: list[dict] = []
        real = torch.optim.SGD.step

        def step(opt, *a, **k):
            self.steps.append({id(p): (g["lr"], p.grad.detach().double().clone())
                               for g in opt.param_groups for p in g["params"] if p.grad is not None})
            return real(opt, *a, **k)

        monkeypatch.setattr(torch.optim.SGD, "step", step)


def test_two_sgd_steps_are_plain_sgd_per_part(dataset, tmp_path, train, monkeypatch):
    """w2 = w0 - lr_part (g0 + g1) in float64 over the run's own gradients; mlp and the LLM adapter
    (rate 0) get no gradient and stay bit for bit; the saved file holds the trained weights."""
    rec = GradRecorder(monkeypatch)
    out = tmp_path / "full"
    rc, _, err, run = train("train_dreambooth", full_args(dataset, str(out), "--optimizer_type", "SGD",
                                                          "--max_grad_norm", "0", *rate_args()))
    assert rc == 0, err
    assert len(rec.steps) == 2
    dit, w0 = run.parts.bundle.unet, tiny.build()["dit"].state_dict()
    parts = _expected_parts(dit)
    lr = {"base": 1e-2, "self_attn": 2e-2, "cross_attn": 1.5e-2, "mod": 5e-3}
    eps = torch.finfo(torch.float32).eps
    for name, p in dit.named_parameters():
        w2, start = p.detach().double(), w0[name].double()
        if parts[name] not in lr:
            assert torch.equal(p.detach(), w0[name]), name
            assert all(id(p) not in s for s in rec.steps), name
            continue
        (lr0, g0), (lr1, g1) = rec.steps[0][id(p)], rec.steps[1][id(p)]
        assert lr0 == lr1 == lr[parts[name]], name
        want = start - lr0 * g0 - lr1 * g1
        # two float32 updates, each rounded once (half an ulp of a value at most |w| + |lr g|)
        bound = eps * (start.abs() + lr0 * (g0.abs() + g1.abs()) + want.abs())
        assert ((w2 - want).abs() <= bound).all(), name
        assert not torch.equal(p.detach(), w0[name]) or float((g0 + g1).abs().max()) == 0, name
    saved = load_file(str(out / "last.safetensors"))
    assert set(saved) == {"net." + k for k in dit.state_dict()}
    assert all(torch.equal(saved["net." + n], p.detach()) for n, p in dit.named_parameters())


def test_fused_backward_equals_the_plain_step(dataset, tmp_path, train):
    """fused_backward_pass steps each tensor in its gradient hook, group by group: the same weights
    as the plain optimizer step (SGD, one thread; DESIGN.md's per-tensor measure, bound 1e-5)."""
    def weights_of(out, *extra):
        rc, _, err, run = train("train_dreambooth", full_args(dataset, out, "--optimizer_type", "SGD",
                                                              "--max_grad_norm", "0", *rate_args(), *extra))
        assert rc == 0, err
        return {k: v.detach().clone() for k, v in run.parts.bundle.unet.state_dict().items()}

    plain, fused = weights_of(str(tmp_path / "a")), weights_of(str(tmp_path / "b"), "--fused_backward_pass")
    w0 = tiny.build()["dit"].state_dict()
    assert not torch.equal(plain["blocks.0.self_attn.q_proj.weight"], w0["blocks.0.self_attn.q_proj.weight"])
    assert torch.equal(fused["blocks.0.mlp.layer1.weight"], w0["blocks.0.mlp.layer1.weight"])
    for k in plain:
        rel = float((fused[k].double() - plain[k].double()).norm() / max(float(plain[k].double().norm()), 1e-4))
        assert rel <= 1e-5, (k, rel)


def test_resume_is_bit_identical(dataset, tmp_path, train):
    extra = ["--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state", "--optimizer_type", "AdamW",
             *rate_args()]
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    rc, _, err, u = train("train_dreambooth", full_args(dataset, whole, *extra))
    assert rc == 0, err
    state = os.path.join(whole, "last-step00000002-state")
    rc, _, err, r = train("train_dreambooth", full_args(dataset, resumed, *extra, "--resume", state))
    assert rc == 0, err
    assert r.progress.global_step == 4 and r.progress.loss_log == u.progress.loss_log
    a, b = load_file(os.path.join(whole, "last.safetensors")), load_file(os.path.join(resumed, "last.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_entry(script: str, argv: list, monkeypatch) -> None:
    """Run an entry script as ``python script argv`` in-process; it must exit 0."""
    monkeypatch.setattr(sys, "argv", [script, *argv])
    reset_accelerate()
    with pytest.raises(SystemExit) as e:
        runpy.run_path(script, run_name="__main__")
    reset_accelerate()
    assert e.value.code == 0


def test_anima_train_py_saves_the_released_layout(dataset, tmp_path, monkeypatch):
    """anima_train.py (folders: train_dreambooth) writes net.* keys and sd-scripts' metadata; the file
    loads back as an Anima DiT."""
    out = tmp_path / "script"
    run_entry("anima_train.py", full_args(dataset, str(out), "--learning_rate", "1e-3"), monkeypatch)
    path = str(out / "last.safetensors")
    from library import safetensors_file
    _, header = safetensors_file.read_header(path)
    meta = header["__metadata__"]
    assert (meta["format"], meta["modelspec.architecture"], meta["modelspec.implementation"],
            meta["ss_base_model_version"]) == ("pt", "anima-preview", home.IMPLEMENTATION, "anima")
    back = weights.load_dit(path)
    assert back.state_dict().keys() == tiny.build()["dit"].state_dict().keys()


def test_part_rates_warn_with_a_lora_and_are_refused_elsewhere(dataset, tmp_path, run_script, caplog):
    from tests.training.test_anima_lora import anima_args
    rc, _, err = run_script("train_lora", anima_args(dataset, str(tmp_path / "l"), "--mlp_lr", "0",
                                                       "--max_train_steps", "1"))
    assert rc == 0, err
    assert "option mlp_lr has no effect with an Anima network" in err, err
    rc, _, err = run_script("train_dreambooth", ["--pretrained_model_name_or_path", "tiny-flux", "--train_data_dir",
                                                 dataset, "--output_dir", str(tmp_path / "f"), "--mod_lr", "1e-4",
                                                 "--max_train_steps", "1", "--resolution", "64"])
    assert rc == 2 and "mod_lr: not with the FLUX.1 model" in err and "Traceback" not in err, err


def test_memory_options_reach_the_model_and_keep_the_loss(dataset, tmp_path, train):
    """split_attn, vae_chunk_size, vae_disable_cache and attn_mode torch through the entry script (a
    LoRA, latents encoded by the chunked VAE): set on the loaded parts, the same losses as without
    them (float32: the latents and attention agree to a few ulps, so the losses to 1e-5 relative)."""
    from tests.training.test_anima_lora import anima_args

    def run(out, *extra):
        rc, _, err, r = train("train_lora", anima_args(dataset, str(tmp_path / out), *extra))
        assert rc == 0, err
        return r

    plain = run("plain")
    tuned = run("tuned", "--split_attn", "--vae_chunk_size", "6", "--vae_disable_cache", "--attn_mode", "sdpa")
    blocks = tuned.parts.bundle.unet.blocks
    assert all(b.self_attn.split and b.cross_attn.split and b.self_attn.kernel is None for b in blocks)
    vae = tuned.parts.bundle.flow.vae
    assert {m.chunk_rows for m in vae.modules() if hasattr(m, "chunk_rows")} == {6}
    assert vae._feat_map is None
    a, b = plain.progress.loss_log, tuned.progress.loss_log
    assert len(a) == len(b) == 2
    assert all(abs(float(x) - float(y)) <= 1e-5 * abs(float(x)) for x, y in zip(a, b)), (a, b)


def test_anima_train_network_py_is_train_lora(dataset, tmp_path, monkeypatch):
    """anima_train_network.py: sd-scripts' name for an Anima LoRA (train_lora.py; networks.lora_anima)."""
    from tests.training.test_anima_lora import anima_args

    out = tmp_path / "alias"
    run_entry("anima_train_network.py", anima_args(dataset, str(out), "--max_train_steps", "1"), monkeypatch)
    sd = load_file(str(out / "last.safetensors"))
    assert "lora_unet_blocks_0_self_attn_q_proj.lora_down.weight" in sd
