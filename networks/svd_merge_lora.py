"""Merge several kohya LoRA/LoCon files, each with a ratio, into one LoRA of a chosen rank (SVD).

    python networks/svd_merge_lora.py --models a.safetensors b.safetensors --ratios 1.0 0.5 \\
        --save_to merged.safetensors --new_rank 16 [--new_conv_rank 8] [--save_precision fp16] \\
        [--precision float] [--device cuda] [--no_metadata]

Flags are those of sd-scripts' networks/svd_merge_lora.py. Per module the weighted
sum of the deltas, sum_i ratio_i * up_i @ down_i * alpha_i / rank_i, is formed in float32 (as the
stacked factors, exact) and factorised by SVD at new_rank (new_conv_rank for 3x3 convs), never above the sum of the input ranks
(the sum's rank cannot exceed it); alpha = rank. Unlike sd-scripts the factors are not clamped at
the 0.99 quantile, so at sufficient rank the result equals the weighted sum.

--lbws '[...]' (one JSON list per file, sd-scripts' LoRA Block Weight lists: 17 or 26 values for
SD1/SD2, 12 or 20 for SDXL; networks/lora_blocks.py) multiplies each module's delta by its block's
weight before the sum (text-encoder modules by BASE).
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from networks import lora_blocks, lora_svd  # noqa: E402
from networks.lora import LoRAError  # noqa: E402


def svd_merge(inputs: list[lora_svd.LoRAInput], new_rank: int, new_conv_rank: int,
              device=None) -> tuple[dict[str, lora_svd.Module], float]:
    """The merged modules and the mean fraction of the summed deltas' Frobenius norm they keep.
    The weighted sum is the inputs stacked (lora_svd.concat: exact), then truncated by its SVD."""
    out: dict[str, lora_svd.Module] = {}
    kept = []
    for name, m in lora_svd.concat(inputs).items():
        shape = m.weight_shape
        rank = min(new_conv_rank if m.is_conv3x3 else new_rank, m.rank, lora_svd.max_rank(shape))
        U, S, Vh = lora_svd.factored_svd(m, device)  # m.scale is 1
        down, up = lora_svd.factor(U, S, Vh, rank, shape)
        out[name] = lora_svd.Module(name, down, up, float(rank))
        kept.append(lora_svd.retained(S, rank)[0])
    return out, sum(kept) / len(kept)


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Merge kohya LoRA files into one LoRA of a given rank (SVD).")
    p.add_argument("--models", nargs="+", required=True, help="LoRA files (.safetensors, .ckpt, .pt)")
    p.add_argument("--ratios", nargs="+", type=float, default=None, help="one ratio per file (default 1.0 each)")
    p.add_argument("--save_to", required=True, help="output LoRA file (.safetensors, .ckpt, .pt, .pth)")
    lora_svd.add_lbws(p)
    p.add_argument("--new_rank", type=int, default=4, help="rank of the output's Linear/1x1 modules (default 4)")
    p.add_argument("--new_conv_rank", type=int, default=None,
                   help="rank of the output's 3x3 conv modules (default: --new_rank)")
    p.add_argument("--save_precision", default=None, choices=["float", "fp16", "bf16"],
                   help="dtype of the output (default float)")
    p.add_argument("--precision", default="float", choices=["float", "fp16", "bf16"],
                   help="sd-scripts' merge dtype; the sum and the SVD are always float32 here (more exact), "
                        "fp16/bf16 are accepted with a note")
    p.add_argument("--device", default=None, help="device for the sums and SVDs (cpu, cuda; default cpu)")
    p.add_argument("--no_metadata", action="store_true", help="write only the minimum ss_* metadata (no modelspec.*)")
    return p.parse_args(argv)


def run(args) -> None:
    ratios = args.ratios if args.ratios is not None else [1.0] * len(args.models)
    if len(ratios) != len(args.models):
        raise LoRAError(f"--ratios: {len(ratios)} value(s) given for {len(args.models)} file(s) in --models")
    new_conv_rank = args.new_conv_rank if args.new_conv_rank is not None else args.new_rank
    for option, value in (("--new_rank", args.new_rank), ("--new_conv_rank", new_conv_rank)):
        if value < 1:
            raise LoRAError(f"{option} {value}: must be >= 1")
    lora_svd.check_save_to(args.save_to)
    device = lora_svd.parse_device(args.device)
    if args.precision != "float":
        print(f"note: --precision {args.precision}: the deltas are summed and factorised in float32")

    lbws = lora_blocks.parse_lbws(args.lbws, len(args.models)) if args.lbws else None
    inputs = lora_svd.read_inputs(args.models, ratios)
    if lbws:
        inputs = lora_svd.block_weighted(inputs, *lbws)
    modules, kept = svd_merge(inputs, args.new_rank, new_conv_rank, device)

    metadata = lora_svd.common_metadata(inputs)
    parts = " + ".join(f"{r:g} x {os.path.basename(p)}" for p, r in zip(args.models, ratios))
    metadata = lora_svd.add_comment(metadata, f"svd_merge_lora: {parts} at rank {args.new_rank}"
                                              + (f" (conv: {new_conv_rank})" if new_conv_rank != args.new_rank else "")
                                              + (f", block weights {' '.join(args.lbws)}" if args.lbws else ""))
    metadata = lora_svd.rank_metadata(modules, metadata)
    if not args.no_metadata:
        metadata = lora_svd.lora_modelspec(metadata, args.save_to,
                                           [lora_svd.title_of(i.path, i.metadata) for i in inputs])
    lora_svd.save_lora(args.save_to, modules, metadata, lora_svd.PRECISIONS[args.save_precision or "float"])
    print(f"merged {len(inputs)} files into {len(modules)} modules; Frobenius norm of the summed deltas "
          f"retained: mean {kept:.2%}; saved {args.save_to}")


def main(argv=None) -> int:
    return lora_svd.tool_main(_parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
