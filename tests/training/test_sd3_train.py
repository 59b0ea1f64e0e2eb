"""SD3 full fine-tuning through the entry scripts on the built-in tiny-sd3 (64 px, 2 steps): the
first micro-step's loss against an independent float64 recomputation (a fresh copy of the
initial weights; the sample's generator draws its noise and then u; weighting_scheme uniform,
training_shift 1: timestep floor(1000 u), sigma = t / 1000; the MMDiT given 1000 sigma, 77 zero
tokens in T5's place; prediction x_t - sigma * output against x0), and the saved single file
reloading with the trained MMDiT and the untouched VAE."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from library.run.run_state import HOOKS


def sd3_args(data, out, *extra):
    return ["--pretrained_model_name_or_path", "tiny-sd3", "--train_data_dir", data,
            "--output_dir", out, "--resolution", "64", "--max_train_steps", "2",
            "--learning_rate", "1e-3", "--cache_latents", "--seed", "7", *extra]


def _reference_loss(run, epoch, i, mask=None):
    from library.data import step_plan
    from library.models import sd3_builtins, sd3_text

    c = sd3_builtins.build_builtin("tiny-sd3")  # the initial weights (fixed seed), a fresh copy
    mmdit, vae = c["mmdit"].double().eval(), c["vae"].double()
    clip_l, clip_g = c["clip_l"].double(), c["clip_g"].double()
    item = run.tset.samples[i]
    assert not run.tset.flip(i, epoch)
    rgb = np.asarray(Image.open(item.path).convert("RGB"), dtype=np.float64)
    pixels = torch.from_numpy(rgb / 127.5 - 1.0).permute(2, 0, 1)[None]
    with torch.no_grad():
        x0 = (vae.encode(pixels).latent_dist.mean - 0.0609) * 1.5305
        g = torch.Generator().manual_seed(step_plan.derive_seed("sample", 7, epoch, i))
        noise = torch.randn(tuple(x0.shape[1:]), generator=g)[None].double()
        u = float(torch.rand(1, generator=g))
        t = min(int(u * 1000), 999)
        sigma = t / 1000
        x_t = (1 - sigma) * x0 + sigma * noise
        toks = sd3_text.tokenize([run.tset.caption(i, epoch)], c["tokenizer_l"], c["tokenizer_g"])
        l_states = clip_l(toks.l_ids, output_hidden_states=True)
        g_states = clip_g(toks.g_ids, output_hidden_states=True)
        lg = torch.cat([l_states.hidden_states[-2], g_states.hidden_states[-2]], dim=-1)
        pooled = torch.cat([l_states.text_embeds, g_states.text_embeds], dim=-1)
        width = mmdit.config.context_dim
        context = torch.cat([torch.nn.functional.pad(lg, (0, width - lg.shape[-1])),
                             torch.zeros(1, 77, width, dtype=torch.float64)], dim=1)
        out = mmdit(x_t, torch.tensor([float(t)], dtype=torch.float64), pooled, context)
    err = (x_t - sigma * out - x0) ** 2
    return float((err if mask is None else err * mask).mean())


def test_sd3_full_finetune_loss_and_saved_file(dataset, tmp_path, train):
    from library.models import sd3_checkpoint

    losses = []

    def record(run, epoch, idx, loss):
        losses.append((epoch, list(idx), float(loss.detach())))
        return loss

    out = tmp_path / "out"
    with HOOKS.add(after_micro_step=record):
        rc, _, err, run = train("finetune", sd3_args(dataset, str(out)))
    assert rc == 0, err
    epoch, idx, loss = losses[0]
    assert loss == pytest.approx(_reference_loss(run, epoch, idx[0]), rel=1e-4, abs=1e-7)

    m = sd3_checkpoint.load_sd3(str(out / "last.safetensors"))
    trained = run.parts.bundle.unet.state_dict()
    for k, v in m.mmdit.state_dict().items():
        assert torch.equal(v, trained[k]), k
    from library.models import sd3_builtins

    initial = sd3_builtins.build_builtin("tiny-sd3")
    for k, v in m.vae.state_dict().items():
        assert torch.equal(v, initial["vae"].state_dict()[k]), k
    assert not torch.equal(initial["mmdit"].state_dict()["x_embedder.proj.weight"],
                           trained["x_embedder.proj.weight"])


@pytest.mark.parametrize("extra, message", [
    (["--t5xxl", "t5.safetensors"], "t5xxl: not with the SD3 model"),
    (["--guidance_scale", "2.0"], "guidance_scale: not with the SD3 model"),
    (["--v_pred_like_loss", "0.5"], "v_pred_like_loss: not with the SD3 model"),
])
def test_sd3_unsupported_options_fail_before_loading(dataset, tmp_path, run_script, extra, message):
    rc, _, err = run_script("finetune", sd3_args(dataset, str(tmp_path / "o"), *extra))
    assert rc != 0 and message in err and "Traceback" not in err


def test_sd3_batch_2_equals_batch_1_with_accumulation_2_and_resume_is_exact(dataset, tmp_path, train):
    """Batch 2 == batch 1 with gradient accumulation 2 (SGD); 4 steps in one run == 2 steps, a
    training state and a resumed run of the other 2, bit for bit (one thread)."""
    from safetensors.torch import load_file

    from library.models import sd3_builtins

    def final(out, *extra):
        rc, _, err, run = train("finetune", sd3_args(dataset, str(tmp_path / out), "--optimizer_type",
                                                     "SGD", "--learning_rate", "0.5", *extra))
        assert rc == 0, err
        return {k: v.detach().clone() for k, v in run.parts.bundle.unet.state_dict().items()}

    a, b = final("bs2", "--train_batch_size", "2"), final("ga2", "--gradient_accumulation_steps", "2")
    initial = sd3_builtins.build_builtin("tiny-sd3")["mmdit"].state_dict()
    moved = 0
    for k in a:
        scale = float((a[k] - initial[k]).abs().max())
        moved += scale > 0
        assert float((a[k] - b[k]).abs().max()) <= 1e-5 * max(scale, 1e-3), k
    assert moved > len(a) // 2

    four = ["--max_train_steps", "4"]
    final("full", *four, "--save_every_n_steps", "2", "--save_state")
    final("resumed", *four, "--resume", str(tmp_path / "full" / "last-step00000002-state"))
    x = load_file(str(tmp_path / "full" / "last.safetensors"))
    y = load_file(str(tmp_path / "resumed" / "last.safetensors"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    mid = load_file(str(tmp_path / "full" / "last-step00000002.safetensors"))
    key = "model.diffusion_model.x_embedder.proj.weight"
    assert not torch.equal(mid[key], x[key])  # the resumed steps trained


def test_sd3_options_change_the_loss_or_the_encoding(dataset):
    """training_shift moves SD3's drawn timesteps (and the loss); apply_lg_attn_mask changes the
    CLIP states of a padded caption; neither is read by FLUX.1's loss."""
    from types import SimpleNamespace

    from library.config.parse import parse_args
    from library.models.flow_family import family_model_for, load_from_options
    from library.training.flow_loss import flow_options
    from library.training.flow_loss import FlowLosses

    def opts(*argv):
        return parse_args("finetune", sd3_args(dataset, "unused", *argv))

    def draw(o):
        losses = FlowLosses(o, flow_options(o, "sd3"))
        latents = torch.randn(4, 16, 8, 8, generator=torch.Generator().manual_seed(1))
        d = losses.draw(latents, [torch.Generator().manual_seed(10 + k) for k in range(4)])
        return d.timesteps

    t1, t3 = draw(opts()), draw(opts("--training_shift", "3.0"))
    assert bool((t3 >= t1).all()) and bool((t3 > t1).any())  # a shift above 1 moves toward noise
    bundle = load_from_options(SimpleNamespace(pretrained_model_name_or_path="tiny-sd3", clip_l=None,
                                               clip_g=None, ae=None, allow_pickle=False))

    def states(o):
        fm = family_model_for(bundle, o)
        with torch.no_grad():
            return fm.encode(fm.tokenize(["a red square"]), None).hidden_states

    assert not torch.allclose(states(opts()), states(opts("--apply_lg_attn_mask")))
