"""Images per second of gen_img's core (library/outputs/generation.py) on the built-in tiny models,
per family, on this machine's CPU (torch threads as given, default 1).

    python benchmarks/gen_img_rate.py [--models tiny-sd15 tiny-sdxl ...] [--images 8] [--steps 20]
                                      [--size 64] [--batch_size 1] [--threads 1]

The model loads once per family (not timed); one warm-up image, then ``--images`` images at
``--size`` px with ``--steps`` steps (SD: euler; FLUX.1 / SD3: their Euler sampler), rendered in
batches of ``--batch_size``, decoded, not written. docs/MEASUREMENTS.md quotes it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library.outputs import gen_options, generation  # noqa: E402

MODELS = ("tiny-sd15", "tiny-sd2", "tiny-sdxl", "tiny-flux", "tiny-sd3")


def rate(model: str, images: int, steps: int, size: int, batch_size: int) -> float:
    args = gen_options.parse_args(["--ckpt", model, "--outdir", os.devnull, "--prompt", "a red cube --n blurry",
                                   "--W", str(size), "--H", str(size), "--steps", str(steps), "--sampler", "euler",
                                   "--seed", "1", "--images_per_prompt", str(images), "--batch_size", str(batch_size)])
    gen = generation.Generator(args)
    jobs = gen_options.plan_jobs(args, gen_options.read_prompts(args), gen.defaults)
    gen.render(jobs[:1])  # warm-up
    t0 = time.perf_counter()
    for batch in gen_options.batches(jobs, batch_size):
        gen.render(batch)
    return images / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="*", default=list(MODELS))
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"| model | images/s ({a.size} px, {a.steps} steps, batch {a.batch_size}, {a.threads} thread(s)) |")
    print("|---|---|")
    for m in a.models:
        print(f"| {m} | {rate(m, a.images, a.steps, a.size, a.batch_size):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
