"""Weighted merge of SD1 / SD2 / SDXL checkpoints (sd-scripts' tools/merge_models.py and its flags).

    python tools/merge_models.py --models a.safetensors b.safetensors [c.safetensors ...] \\
        [--ratios 0.7 0.3] --output merged.safetensors [--unet_only] [--precision float|fp16|bf16] \\
        [--saving_precision float|fp16|bf16] [--show_skipped] [--device cpu]

Each tensor is sum_i ratio_i * x_i (ratios default to 1 / n). The rules and checks are
library/models/checkpoint_merge.py.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library import log  # noqa: E402
from library.errors import UserError  # noqa: E402

PRECISIONS = ("float", "fp16", "bf16")  # sd-scripts' choices (checkpoint_merge.PRECISIONS: their dtypes)


def _parse_args(argv):
    precisions = list(PRECISIONS)
    p = argparse.ArgumentParser(description="Merge SD1/SD2/SDXL checkpoints with weights.")
    p.add_argument("--models", nargs="+", required=True, help="the .safetensors checkpoints to merge")
    p.add_argument("--output", required=True, help="the merged file (.safetensors is appended when missing)")
    p.add_argument("--ratios", nargs="+", type=float, default=None,
                   help="one ratio per model (default 1/n each)")
    p.add_argument("--unet_only", action="store_true", help="merge the U-Net only; VAE and text encoders from the first model")
    p.add_argument("--device", default="cpu", help="device the tensors are summed on (cpu, cuda, ...; default cpu)")
    p.add_argument("--precision", default="float", choices=precisions, help="dtype of the sums (default float)")
    p.add_argument("--saving_precision", default="float", choices=precisions, help="dtype of the output (default float)")
    p.add_argument("--show_skipped", action="store_true", help="list the keys of later models that the first lacks")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    log.setup_logging(True)
    # lazy: torch (seconds) is imported once the flags are parsed, not for --help
    from library.models import checkpoint_merge, placement

    path = checkpoint_merge.output_path(args.output)
    try:
        merged, metadata = checkpoint_merge.merge(args.models, args.ratios,
                                                  checkpoint_merge.PRECISIONS[args.precision],
                                                  args.unet_only, args.show_skipped,
                                                  placement.parse_device(args.device))
        checkpoint_merge.save(merged, metadata, path, checkpoint_merge.PRECISIONS[args.saving_precision])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"saved {path}: {len(merged)} tensors from {len(args.models)} models")
    return 0


if __name__ == "__main__":
    sys.exit(main())
