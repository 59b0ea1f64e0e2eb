"""Captioning throughput (images/s) of the captioning scripts' path on the tiny test models:
``captioning.run`` (decode, processor, generate, atomic write) with BLIP, GIT, Florence-2 and a
LLaVA chat model built offline by tests/dataset_tools/tiny_captioners.py, at batch 1 and 8.

    python benchmarks/captioning_rate.py [--images 32] [--threads 1] [--device cpu]

The model load is outside the timing; each row is the best of ``--repeats`` runs over the same
images (captions overwritten). Tiny models measure the toolkit's overhead around generate, not
the speed of real captioners (a real BLIP-large or Qwen2.5-VL spends its time in the model).
Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.dataset_tools import caption_models, captioning  # noqa: E402
from tests.dataset_tools import tiny_captioners  # noqa: E402


def captioners(work: str, device: str) -> dict:
    """name -> captioner over a freshly built tiny model (BLIP with sd-scripts' beam settings)."""
    place = dict(device=device, precision="auto")
    out = {}
    blip = tiny_captioners.build_blip(os.path.join(work, "blip"))
    out["BLIP, beam search 3"] = caption_models.BlipCaptioner(
        caption_models.load(blip, "blip", "BlipForConditionalGeneration", **place),
        beam_search=True, num_beams=3, max_length=20, min_length=5)
    git = tiny_captioners.build_git(os.path.join(work, "git"))
    out["GIT, greedy"] = caption_models.GitCaptioner(
        caption_models.load(git, "git", "AutoModelForCausalLM", **place), max_length=20)
    florence = tiny_captioners.build_florence2(os.path.join(work, "florence2"))
    out["Florence-2 <CAPTION>, beams 3"] = caption_models.FlorenceCaptioner(
        caption_models.load_vlm(florence, "florence", True, **place),
        sampling=caption_models.Sampling(max_new_tokens=16, num_beams=3))
    llava = tiny_captioners.build_llava(os.path.join(work, "llava"))
    out["LLaVA chat, greedy"] = caption_models.ChatCaptioner(
        caption_models.load_vlm(llava, "llava", False, **place), prompt="describe this image .",
        sampling=caption_models.Sampling(max_new_tokens=16))
    return out


def rate(folder: str, captioner, batch: int, repeats: int) -> float:
    job = captioning.CaptionJob(folder, overwrite=True, batch_size=batch)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        n = len(captioning.run(job, captioner).written)
        best = max(best, n / (time.perf_counter() - start))
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as work:
        images = os.path.join(work, "images")
        os.makedirs(images)
        tiny_captioners.write_images(images, args.images, size=64)
        print(f"{args.images} images of 64 px, device {args.device}, {args.threads} thread(s)")
        print("| captioner | batch 1 | batch 8 |\n|---|---|---|")
        for name, captioner in captioners(work, args.device).items():
            r1, r8 = (rate(images, captioner, b, args.repeats) for b in (1, 8))
            print(f"| {name} | {r1:.1f} images/s | {r8:.1f} images/s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
