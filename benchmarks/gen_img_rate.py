"""Images per second of gen_img's core (library/outputs/generation.py) on the built-in tiny models,
per family, on this machine's CPU (torch threads as given, default 1).

    python benchmarks/gen_img_rate.py [--models tiny-sd15 tiny-sdxl ...] [--images 8] [--steps 20]
                                      [--size 64] [--batch_size 1] [--threads 1]

The model loads once per family (not timed); one warm-up image, then ``--images`` images at
``--size`` px with ``--steps`` steps (SD: euler; FLUX.1 / SD3: their Euler sampler), rendered in
batches of ``--batch_size``, decoded, not written. docs/MEASUREMENTS.md quotes it.

``gpu_row(name, dry)``: benchmarks/gpu.py's generation rows (GPU_CASES: SD1.5 at 512 px and SDXL at
1024 px on the full-size random-weight architectures, bf16, 30 steps, euler, CFG 7.5, batch 1):
images/s and peak CUDA memory of gen_img's renderer, next to diffusers' own pipeline called on
the same components and scheduler with the same prompts (its own text encoding); ``dry``: the
tiny model at 64 px, 2 steps, one image, on the CPU.
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

MODELS = ("tiny-sd15", "tiny-sd2", "tiny-sdxl", "tiny-flux", "tiny-sd3", "tiny-chroma", "tiny-anima", "tiny-lumina")


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


GPU_CASES = {"sd15-gen-512": ("sd15-arch", "tiny-sd15", 512), "sdxl-gen-1024": ("sdxl-arch", "tiny-sdxl", 1024)}
GPU_STEPS, GPU_IMAGES, PROMPT, NEGATIVE = 30, 4, "a red cube", "blurry"


def _timed(render, n: int, cuda: bool) -> tuple[float, float | None]:
    """(images/s over n renders after one warm-up, peak allocated GiB)."""
    render()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(n):
        render()
    if cuda:
        torch.cuda.synchronize()
    rate_ = n / (time.perf_counter() - t0)
    return rate_, (torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None)


def gpu_row(name: str, dry: bool) -> dict:
    full, tiny, size = GPU_CASES[name]
    model, size, steps, n = (tiny, 64, 2, 1) if dry else (full, size, GPU_STEPS, GPU_IMAGES)
    cuda = torch.cuda.is_available()
    args = gen_options.parse_args(["--ckpt", model, "--outdir", os.devnull, "--prompt", f"{PROMPT} --n {NEGATIVE}",
                                   "--W", str(size), "--H", str(size), "--steps", str(steps), "--sampler", "euler",
                                   "--scale", "7.5", "--seed", "1", *([] if dry else ["--bf16"])])
    gen = generation.Generator(args)
    [job] = gen_options.plan_jobs(args, gen_options.read_prompts(args), gen.defaults)
    ours, ours_peak = _timed(lambda: gen.render([job]), n, cuda)
    pipe = gen.pipe  # diffusers' pipeline over the same components, with the scheduler just used
    pipe.set_progress_bar_config(disable=True)

    def diffusers_image():
        with torch.no_grad():
            pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=size, width=size, num_inference_steps=steps,
                 guidance_scale=7.5, generator=torch.Generator("cpu").manual_seed(1))
    theirs, theirs_peak = _timed(diffusers_image, n, cuda)
    return {"case": name, "model": model, "size": size, "steps": steps, "images": n, "images_s": ours,
            "peak_alloc_gib": ours_peak, "diffusers_images_s": theirs, "diffusers_peak_alloc_gib": theirs_peak}


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
