"""WD tagger throughput: images per second of ``wd_tagger.tag_folder`` (read, preprocess, score,
write the caption) on the tiny SmilingWolf-layout tagger of tools/make_tiny_tagger.py, on the CPU
(or CUDA when onnxruntime-gpu is installed).

    python benchmarks/tagger_throughput.py [--images 64] [--size 768x512] [--repeats 3]

The images are random RGB PNGs of one size, made once in a temporary folder (nothing is
downloaded); each configuration (batch size, loader threads) tags the whole folder ``--repeats``
times after one warm-up run, and the median rate is printed with the preprocessing alone (decode,
pad, resize) for scale. The tiny model costs almost nothing, so the rate is the pipeline's around
it: a real tagger (a ConvNeXt or ViT of 100-300 M parameters) adds its own time per image.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.dataset_tools import wd_model, wd_tagger  # noqa: E402
from library.dataset_tools.wd_tags import TagOptions  # noqa: E402
from tools.make_tiny_tagger import build_smilingwolf  # noqa: E402

CONFIGS = ((1, None), (8, None), (8, 2))  # (batch size, loader threads)


def make_folder(folder: str, n: int, w: int, h: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
            os.path.join(folder, f"{i:04d}.png"))


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: file cache, onnxruntime's first run
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="WD tagger throughput on a tiny tagger.")
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--size", default="768x512", help="WxH of the test images")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    w, h = (int(v) for v in args.size.lower().split("x"))
    quiet = logging.getLogger("quiet")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, images = os.path.join(tmp, "model"), os.path.join(tmp, "images")
        os.makedirs(images)
        build_smilingwolf(model_dir)
        make_folder(images, args.images, w, h)
        model = wd_model.load(model_dir, wd_model.SMILINGWOLF, quiet)
        print(f"{args.images} images of {w}x{h}, onnxruntime {model.session.get_providers()[0]}")
        paths = wd_tagger.list_images(images, False)
        pre = timed(lambda: [wd_tagger.load_image(q, model.size) for q in paths], args.repeats)
        print(f"preprocessing alone: {args.images / pre:.1f} images/s")
        for batch, workers in CONFIGS:
            out = wd_tagger.OutputOptions(batch_size=batch, max_data_loader_n_workers=workers)
            t = timed(lambda: wd_tagger.tag_folder(images, model, TagOptions(), out, log=quiet),
                      args.repeats)
            print(f"batch {batch}, loader threads {workers or 0}: {args.images / t:.1f} images/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
