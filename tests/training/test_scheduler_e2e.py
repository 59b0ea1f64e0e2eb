"""lr_scheduler_power and lr_scheduler_num_cycles end to end: the learning rates a short run logs
(TensorBoard's lr/unet, read back with TensorBoard's own reader) against the float64 formula of
the curve, so an option the scheduler ignores fails."""
from __future__ import annotations

import math
import os

import pytest

from tests.outputs.test_tracking import events

LR, STEPS, WARMUP = 1e-3, 6, 1


def _curve(name, step, power=1.0, cycles=1):
    """The factor of optimizer step ``step`` (0-based): warmup rises linearly from 1/(w+1) to 1
    (docs/OPTIMIZERS.md), then the curve over the remaining steps."""
    if step < WARMUP:
        return (step + 1) / (WARMUP + 1)
    progress = min(1.0, (step - WARMUP) / (STEPS - WARMUP))
    if name == "polynomial":
        return (1.0 - progress) ** power
    return 0.5 * (1.0 + math.cos(math.pi * ((cycles * progress) % 1.0)))  # cosine_with_restarts


@pytest.mark.parametrize("scheduler,flags,kwargs", [
    ("polynomial", ["--lr_scheduler_power", "2.5"], {"power": 2.5}),
    ("cosine_with_restarts", ["--lr_scheduler_num_cycles", "2"], {"cycles": 2}),
])
def test_logged_learning_rates_follow_the_curve(train, dataset, tmp_path, scheduler, flags, kwargs):
    logs = tmp_path / "logs"
    rc, _, err, _ = train("train_lora", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
        "--output_dir", str(tmp_path / "out"), "--resolution", "64", "--max_train_steps", STEPS,
        "--network_dim", "2", "--network_train_unet_only", "--cache_latents",
        "--optimizer_type", "SGDNesterov", "--unet_lr", LR, "--lr_scheduler", scheduler,
        "--lr_warmup_steps", WARMUP, "--logging_dir", str(logs), *flags])
    assert rc == 0, err[-2000:]
    (run_dir,) = os.listdir(logs)
    logged = events(str(logs / run_dir))["lr/unet"]
    assert [s for s, _ in logged] == list(range(1, STEPS + 1))
    want = [LR * _curve(scheduler, s, **kwargs) for s in range(STEPS)]
    assert [v for _, v in logged] == pytest.approx(want, rel=1e-6, abs=1e-12)
    # the option changes the curve: the default's rates differ somewhere
    default = [LR * _curve(scheduler, s) for s in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(want, default)) > 0.05 * LR
