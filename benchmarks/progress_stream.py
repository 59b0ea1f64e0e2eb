"""The progress stream's cost (progress_file + control_file) on the tiny model's training step.

    python benchmarks/progress_stream.py [--steps 40] [--repeats 3]

Trains the built-in tiny-sd15 LoRA at 64 px (cached latents, one CPU thread) ``repeats`` times
with and without ``--progress_file`` / ``--control_file``, alternating, and prints the median step
time of each (benchmarks/step_timer.py: the clock at every step's report, so a step's time holds
the stream's write and the control file's poll), then the cost of the two per-step calls alone
(``ProgressStream.event("step", ...)`` and ``ControlChannel.poll()``), timed over 10,000 calls.
docs/PERFORMANCE.md quotes the numbers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.step_timer import timed_run  # noqa: E402
from library.outputs import progress_stream  # noqa: E402
from tools.make_sample_dataset import make_sample_dataset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="sdtk-progress-bench-")
    data = os.path.join(tmp, "data")
    make_sample_dataset(data, n_images=4, size=64, repeats=5)
    base = ["--pretrained_model_name_or_path", "tiny-sd15", "--resolution", "64",
            "--cache_latents", "--network_dim", "4", "--learning_rate", "1e-3",
            "--max_train_steps", a.steps, "--train_data_dir", data, "--seed", "1"]
    times = {"without": [], "with": []}
    for r in range(a.repeats):
        for kind in ("without", "with"):
            out = os.path.join(tmp, f"out-{kind}-{r}")
            extra = [] if kind == "without" else [
                "--progress_file", os.path.join(out, "progress.jsonl"),
                "--control_file", os.path.join(out, "control")]
            steps, _ = timed_run("train_lora", base + ["--output_dir", out] + extra)
            times[kind] += steps[1:]  # the first step builds the optimizer state
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"tiny-sd15 LoRA 64 px, {a.steps} steps x {a.repeats} runs each, median step time:")
    for k in ("without", "with"):
        print(f"  {k:7s} progress stream: {med[k] * 1e3:.2f} ms")
    print(f"  difference: {(med['with'] - med['without']) * 1e3:+.2f} ms "
          f"({(med['with'] / med['without'] - 1) * 100:+.1f} %)")
    stream = progress_stream.ProgressStream(os.path.join(tmp, "micro.jsonl"))
    ctl_path = os.path.join(tmp, "micro-control")
    open(ctl_path, "w").close()
    ctl = progress_stream.ControlChannel(ctl_path)
    n = 10000
    t0 = time.perf_counter()
    for i in range(n):
        stream.event("step", step=i, epoch=1, loss=0.1234567, lr=1e-3, grad_norm=0.5, samples_seen=i)
    t1 = time.perf_counter()
    for _ in range(n):
        ctl.poll()
    t2 = time.perf_counter()
    stream.close()
    print(f"per step: event('step') {(t1 - t0) / n * 1e6:.1f} us, control poll "
          f"{(t2 - t1) / n * 1e6:.1f} us")


if __name__ == "__main__":
    main()
