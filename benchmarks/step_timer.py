"""Times the optimizer steps of an in-process training run (shared by benchmarks/gpu.py and
benchmarks/ddp_scaling.py).

``timed_run(script, args, sync)`` runs an entry script through ``library.cli.main`` and records
the clock when training starts and after every step (``library.outputs.tracking``'s hooks, which the loop
calls once per step, after the update: library.outputs.tracking.Reporter). ``sync`` waits for the device first (CUDA kernels are
asynchronous), so a step's time is its real duration. Returns the step durations and the Run.
"""
from __future__ import annotations

import os
import sys
import time

from accelerate.state import AcceleratorState, GradientState, PartialState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library import cli  # noqa: E402
from library.outputs import tracking  # noqa: E402
from library.run import trainer  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def timed_run(script: str, args: list, sync=lambda: None):
    """(step durations in seconds, the Run) of one training run; raises on a failed run."""
    marks: list[float] = []
    runs: list = []
    R = tracking.Reporter  # the loop calls its before_training / after_step once per step
    real_before, real_after, real_run = R.before_training, R.after_step, trainer.run

    def before(rep, *a, **k):
        out = real_before(rep, *a, **k)
        sync()
        marks.append(time.perf_counter())
        return out

    def after(rep, *a, **k):
        sync()
        marks.append(time.perf_counter())
        return real_after(rep, *a, **k)

    def keep(opts, method):
        r = real_run(opts, method)
        runs.append(r)
        return r

    R.before_training, R.after_step, trainer.run = before, after, keep
    try:
        _reset_accelerate()
        rc = cli.main(script, [str(a) for a in args])
    finally:
        R.before_training, R.after_step, trainer.run = real_before, real_after, real_run
    if rc != 0:
        raise SystemExit(f"{script} failed (exit {rc}); its error is printed above")
    return [b - a for a, b in zip(marks, marks[1:])], runs[0] if runs else None


def _reset_accelerate():
    """A second run in the same process needs a fresh Accelerate state."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def median(xs: list) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
