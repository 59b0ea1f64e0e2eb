"""Start-up benchmark: time from launching `python train_lora.py` to its first optimizer step.

    python benchmarks/startup.py [--runs 3]

Compares, each as the median of --runs fresh processes on this machine:
  bare import      python -c "import torch, diffusers, transformers" (`import diffusers` is
                   lazy: it does not load diffusers' model code, which any trainer needs)
  first step       python train_lora.py on tiny-sd15 (1 step, 4 images of 64 px), measured from
                   before the process is spawned until its log line "first step done" arrives
The README quotes what this printed. Nothing is downloaded; the dataset is generated in a temp dir.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.make_sample_dataset import make_sample_dataset  # noqa: E402

BARE = "import torch, diffusers, transformers"


def env():
    e = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return e


def time_command(args) -> float:
    t = time.perf_counter()
    subprocess.run(args, cwd=ROOT, env=env(), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def time_to_first_step(data_dir: str, out_dir: str) -> float:
    args = [sys.executable, "train_lora.py", "--pretrained_model_name_or_path", "tiny-sd15",
            "--train_data_dir", data_dir, "--resolution", "64", "--output_dir", out_dir,
            "--max_train_steps", "1", "--network_dim", "4"]
    t = time.perf_counter()
    p = subprocess.Popen(args, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    buf = b""
    elapsed = None
    while True:
        chunk = p.stderr.read1(4096) if hasattr(p.stderr, "read1") else p.stderr.read(1)
        if not chunk:
            break
        buf += chunk
        if elapsed is None and b"first step done" in buf:
            elapsed = time.perf_counter() - t
    p.wait()
    if p.returncode != 0 or elapsed is None:
        raise SystemExit(f"train_lora.py failed (rc {p.returncode}):\n{buf.decode(errors='replace')[-2000:]}")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        make_sample_dataset(os.path.join(tmp, "data"), n_images=4, size=64, repeats=1)
        bare = [time_command([sys.executable, "-c", BARE]) for _ in range(args.runs)]
        first = [time_to_first_step(os.path.join(tmp, "data"), os.path.join(tmp, f"out{i}"))
                 for i in range(args.runs)]
    b, f = (statistics.median(x) for x in (bare, first))

    # lazy: --help loads this module before torch; torch is imported when main() runs
    import torch

    print(f"machine: {platform.machine()}, {os.cpu_count()} cpu(s), python {platform.python_version()}, "
          f"torch {torch.__version__}")
    print(f"bare import (torch, diffusers, transformers): {b:.2f} s")
    print(f"train_lora.py first step (tiny-sd15):         {f:.2f} s")
    print(f"first step - bare import: {f - b:.2f} s (target: under 1.5 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
