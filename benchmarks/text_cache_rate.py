"""Text-encoder caching rate alone: captions per second of ``text_cache.encode_captions`` on
``tiny-sd15`` (memory only, one CPU thread), repeated in one process.

    python benchmarks/text_cache_rate.py [--captions 1024] [--repeats 3] [--batch 1]

benchmarks/data_pipeline.py times the same call inside a training run, where 128 captions take a
tenth of a second and the rest of the run (the VAE, the steps) shares the machine; this one
encodes enough captions, several times, for a rate worth comparing between two trees (run it
alternately in each, with PYTHONPATH set to the tree). The captions are distinct (six words
drawn from a fixed list, seeded, and a number); the same captions every run. Prints one rate
per repeat (captions/s). Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.data import text_cache  # noqa: E402
from library.models import family, loading  # noqa: E402

WORDS = ("a", "photo", "of", "sks", "dog", "red", "blue", "house", "tree", "sky", "beach", "cat",
         "running", "sitting")


def captions(n: int) -> list[str]:
    rng = random.Random(0)
    return [", ".join(rng.sample(WORDS, 6)) + f" {i}" for i in range(n)]


def rates(n: int, repeats: int, batch: int) -> list[float]:
    """captions/s of each repeat of encoding ``n`` distinct captions ``batch`` at a time."""
    bundle = loading.load_model_bundle("tiny-sd15")
    fm = family.family_model_for(bundle, max_token_length=None)
    wanted = dict.fromkeys(captions(n))
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        got = text_cache.encode_captions(fm, wanted, "benchmark", clip_skip=None, batch_size=batch,
                                         device=torch.device("cpu"), autocast=contextlib.nullcontext,
                                         to_disk=False)
        out.append(n / (time.perf_counter() - t))
        assert len(got) == n
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--captions", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="captions per encoder call (vae_batch_size's default: 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    r = rates(args.captions, args.repeats, args.batch)
    print(f"text-encoder caching, {args.captions} captions, batch {args.batch}: "
          + " ".join(f"{x:.0f}" for x in r) + " captions/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
