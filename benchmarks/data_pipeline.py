"""Data-pipeline benchmark on tiny-sd15: caching throughput and the data share of a training step.

    python benchmarks/data_pipeline.py [--images 32] [--size 128] [--steps 30]

Runs train_lora in this process twice on a generated dataset (in a temp dir) with
``cache_latents_to_disk``, ``cache_text_encoder_outputs`` and ``flip_aug``:
  run 1   fills the caches: latent caching throughput in images/s (VAE encodes, flips included)
          and text-encoder caching in captions/s;
  run 2   the disk cache is complete: reload rate in entries/s (no VAE call), and the data share
          of a step = time spent fetching a micro-batch's latents and text conditioning
          (``BatchLoss._latents`` + ``BatchLoss._text``) / the training loop's time.
The cache stage is timed in ``cache_stage.latents`` and ``cache_stage.text``
(library/data/cache_stage.py).
The README quotes what this printed. Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch
from accelerate.state import AcceleratorState, GradientState, PartialState
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from library import cli  # noqa: E402
from library.data import cache_stage  # noqa: E402
from library.run import stages, trainer  # noqa: E402
from library.training.batch_loss import BatchLoss  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Timers:
    def __init__(self):
        self.t: dict[str, float] = {}
        self.n: dict[str, int] = {}

    def wrap(self, owner, name: str, key: str):
        """Time every call of ``owner.name`` (a class or module attribute) under ``key``;
        -> the original, to put back."""
        real = getattr(owner, name)
        timers = self

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                timers.t[key] = timers.t.get(key, 0.0) + time.perf_counter() - start
                timers.n[key] = timers.n.get(key, 0) + 1

        setattr(owner, name, timed)
        return real


def timed_calls() -> list[tuple[object, str, str]]:
    """What is timed, as (owner, attribute, key): the cache stage's two caches, a micro-step's
    latents and text conditioning, the training loop."""
    return [(cache_stage, "latents", "cache_latents"), (cache_stage, "text", "cache_text"),
            (BatchLoss, "_latents", "sample_latents"), (BatchLoss, "_text", "text_conditioning"),
            (stages.Run, "train", "train")]


def write_dataset(folder: str, n: int, size: int) -> None:
    """n distinct images (seeded noise over a colour gradient) with 5-tag captions."""
    os.makedirs(folder, exist_ok=True)
    for i in range(n):
        rng = np.random.RandomState(i)
        ramp = np.linspace(0, 255, size, dtype=np.float64)[None, :, None]
        img = np.clip(ramp + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(os.path.join(folder, f"img_{i:03d}.png"))
        with open(os.path.join(folder, f"img_{i:03d}.caption"), "w") as f:
            f.write(f"sks, tag{i}, red, blue, green")


def one_run(args_list, timers):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    captured = {}
    real_run = trainer.run

    def spy(opts, method):
        captured["run"] = real_run(opts, method)
        return captured["run"]

    trainer.run = spy
    try:
        rc = cli.main("train_lora", args_list)
    finally:
        trainer.run = real_run
    if rc != 0:
        raise SystemExit(f"train_lora failed with status {rc}")
    return captured["run"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=32)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()

    timed = timed_calls()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        write_dataset(os.path.join(tmp, "data", "1_sks"), a.images, a.size)
        base = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir",
                os.path.join(tmp, "data"), "--resolution", str(a.size), "--max_train_steps",
                str(a.steps), "--network_dim", "4", "--network_train_unet_only",
                "--cache_latents_to_disk", "--cache_text_encoder_outputs", "--flip_aug",
                "--shuffle_caption", "--train_batch_size", "2", "--vae_batch_size", "4"]
        results = []
        for i in range(2):
            timers = Timers()
            originals = [(owner, name, timers.wrap(owner, name, key)) for owner, name, key in timed]
            try:
                run = one_run(base + ["--output_dir", os.path.join(tmp, f"out{i}")], timers)
            finally:
                for owner, name, real in originals:
                    setattr(owner, name, real)
            results.append((timers, run))

    (t1, run1), (t2, run2) = results
    n_lat = len(run1.parts.caches.latents)
    n_txt = len(run1.parts.caches.text)
    data_t = t2.t["sample_latents"] + t2.t["text_conditioning"]
    loop_t = t2.t["train"]
    print(f"dataset: {a.images} images of {a.size} px, tiny-sd15, 1 CPU thread, batch 2, {a.steps} steps")
    print(f"latent caching: {n_lat} latents (with flips) in {t1.t['cache_latents']:.2f} s = "
          f"{n_lat / t1.t['cache_latents']:.1f} images/s")
    print(f"text-encoder caching: {n_txt} caption variants in {t1.t['cache_text']:.2f} s"
          f" = {n_txt / t1.t['cache_text']:.1f} captions/s")
    print(f"latent cache reload from disk: {len(run2.parts.caches.latents)} entries in {t2.t['cache_latents']:.2f} s = "
          f"{len(run2.parts.caches.latents) / t2.t['cache_latents']:.0f} entries/s")
    print(f"data share of the training loop (caches on): {data_t:.3f} s of {loop_t:.2f} s = "
          f"{100 * data_t / loop_t:.2f}% ({1000 * data_t / a.steps:.2f} ms per step of "
          f"{1000 * loop_t / a.steps:.0f} ms)")


if __name__ == "__main__":
    main()
