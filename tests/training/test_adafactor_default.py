"""An sd-scripts config that says only ``optimizer_type = "Adafactor"`` trains as it does there:
transformers' relative step (relative_step=True, scale_parameter=True, warmup_init=False), with
learning_rate used only as the initial lr reported before the first step, and the unet / text
encoder learning rates dropped.

The reference is transformers' published Adafactor update written out here in float64 from the
gradient and weights the optimizer was handed (recorded by a step pre-hook, nothing computed by
our code): for step t = 1 the second-moment decay is 1 - t^-0.8 = 0, so the moments are the
squared gradient (+ eps1 = 1e-30), factored over the last two dimensions for matrices and conv
kernels; the update g / sqrt(V) is divided by max(1, RMS(update)) (clip_threshold 1) and scaled
by the relative step min(1e-2, 1/sqrt(t)) x max(eps2 = 1e-3, RMS(weights before the step)).
"""
from __future__ import annotations

import math

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook


def _relative_step_update(w: torch.Tensor, g: torch.Tensor):
    """(the weights after transformers' Adafactor step 1 with its defaults, the clipped update
    before the step size), in float64."""
    w, g = w.double(), g.double()
    sq = g * g + 1e-30
    if g.dim() >= 2:
        row = sq.mean(dim=-1)                    # shape[:-1]
        col = sq.mean(dim=-2)                    # shape[:-2] + shape[-1:]
        v = row.unsqueeze(-1) * col.unsqueeze(-2) / row.mean(dim=-1, keepdim=True).unsqueeze(-1)
    else:
        v = sq
    u = g / v.sqrt()
    u = u / max(1.0, float(u.pow(2).mean().sqrt()))
    rms_w = float(w.pow(2).mean().sqrt())
    step = min(1e-2, 1.0 / math.sqrt(1)) * max(1e-3, rms_w)
    return w - step * u, u


def test_adafactor_alone_takes_the_relative_step_as_sd_scripts(train, dataset, tmp_path):
    from transformers.optimization import Adafactor

    cfg = tmp_path / "run.toml"
    cfg.write_text('[optimizer_arguments]\noptimizer_type = "Adafactor"\nlearning_rate = 0.5\n'
                   'text_encoder_lr = 0.2\n')
    seen = {}

    def record(optimizer, args, kwargs):
        if isinstance(optimizer, Adafactor):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        seen[p] = (p.detach().clone(), p.grad.detach().clone())

    handle = register_optimizer_step_pre_hook(record)
    try:
        rc, _, err, r = train("train_dreambooth", [
            "--config", cfg, "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir",
            dataset, "--output_dir", tmp_path / "out", "--resolution", "64",
            "--max_train_steps", "1", "--train_text_encoder", "--seed", "3"])
    finally:
        handle.remove()
    assert rc == 0, err
    warning = ("Adafactor with relative_step=True (sd-scripts' default): learning_rate 0.5 is "
               "used only as the initial lr reported before the first step")
    assert err.count(warning) == 1, err
    assert r.progress.lr_log == [0.5]  # the initial lr, reported for the first step
    trained = [p for m in (r.parts.bundle.unet, *r.parts.bundle.text_encoders) for p in m.parameters()
               if p.requires_grad]
    te = {id(p) for m in r.parts.bundle.text_encoders for p in m.parameters() if p.requires_grad}
    assert trained and te and set(map(id, seen)) == set(map(id, trained))
    worst, moved, steps = 0.0, 0, []
    for p, (before, grad) in seen.items():
        expected, clipped = _relative_step_update(before, grad)
        delta, want = p.detach().double() - before.double(), expected - before.double()
        n = float(want.norm())
        if n > 0:
            worst = max(worst, float((delta - want).norm()) / n)
            moved += 1
        steps.append((delta, clipped))
    assert moved > len(seen) // 2
    assert worst < 1e-4, worst
    # and no learning_rate step: that would move the tensors by 0.5 (unet) or 0.2 (text encoder)
    # times the clipped update; Adafactor's own step is at most 1e-2 x the weights' RMS (~1)
    sizes = [float(d.norm()) / float(u.norm()) for d, u in steps if float(u.norm()) > 0]
    assert sizes and max(sizes) < 0.02
