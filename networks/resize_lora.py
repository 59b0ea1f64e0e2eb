"""Resize a kohya LoRA/LoCon file to a lower rank by SVD of each module's delta.

    python networks/resize_lora.py --model in.safetensors --save_to out.safetensors --new_rank 4 \\
        [--new_conv_rank 2] [--dynamic_method sv_fro --dynamic_param 0.9] [--save_precision fp16] \\
        [--device cuda] [--verbose]

Flags are those of sd-scripts' networks/resize_lora.py. Each module's up @ down is factorised by
SVD and truncated; the new alpha is old_scale * new_rank, so alpha / rank (the module's scale) and
therefore the delta at full rank are preserved. The rank is new_rank (new_conv_rank for 3x3 convs),
or with --dynamic_method the smallest rank meeting the criterion, capped at new_rank; a module never
grows beyond its old rank. Differences from sd-scripts: docs/LORA_TOOLS.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from networks import lora_svd  # noqa: E402
from networks.lora import LoRAError  # noqa: E402


@dataclass
class Resized:
    name: str
    old_rank: int
    new_rank: int
    fro_retained: float
    sum_retained: float
    max_ratio: float


def resize_module(m: lora_svd.Module, rank_limit: int, method: str | None, param: float | None,
                  device=None) -> tuple[lora_svd.Module, Resized]:
    """The module at its new rank (alpha = old scale * new rank) and what was kept."""
    shape = m.weight_shape
    # SVD of the product without the scale: the scale is carried by the new alpha.
    U, S, Vh = lora_svd.factored_svd(m, device)
    # A zero module (S[0] <= MIN_SV) takes the requested rank like the others (its up factor is
    # S-weighted, so zero); sd-scripts gives it rank 1 and alpha scale * 1, so that whether a gradient
    # that is zero in exact arithmetic left exact zeros or float noise changed the file's ranks, its
    # ss_network_dim ("Dynamic") and an alpha that diffusers drops on SD1 U-Net modules. A dynamic
    # resize gives it rank 1 (dynamic_rank): its ranks vary anyway.
    rank = lora_svd.dynamic_rank(S, method, param) if method is not None else rank_limit
    rank = max(1, min(rank, rank_limit, m.rank, lora_svd.max_rank(shape)))
    down, up = lora_svd.factor(U, S, Vh, rank, shape)
    fro, total = lora_svd.retained(S, rank)
    max_ratio = float(S[0] / S[rank - 1]) if float(S[rank - 1]) > 0 else float("inf")
    new = lora_svd.Module(m.name, down, up, m.scale * rank)
    return new, Resized(m.name, m.rank, rank, fro, total, max_ratio)


def resize_modules(modules: dict[str, lora_svd.Module], new_rank: int, new_conv_rank: int,
                   method: str | None, param: float | None, device=None):
    out, reports = {}, []
    for name, m in modules.items():
        new, report = resize_module(m, new_conv_rank if m.is_conv3x3 else new_rank, method, param, device)
        out[name] = new
        reports.append(report)
    return out, reports


def _report(reports: list[Resized], verbose: bool) -> None:
    if verbose:
        for r in reports:
            print(f"{r.name:75} | rank {r.old_rank} -> {r.new_rank}, fro retained {r.fro_retained:.1%}, "
                  f"sum(S) retained {r.sum_retained:.1%}, max(S) ratio {r.max_ratio:0.1f}")
    fros = [r.fro_retained for r in reports]
    worst = min(reports, key=lambda r: r.fro_retained)
    old = sum(r.old_rank for r in reports)
    new = sum(r.new_rank for r in reports)
    print(f"resized {len(reports)} modules: total rank {old} -> {new}; Frobenius norm retained: mean "
          f"{statistics.mean(fros):.2%}, std {statistics.pstdev(fros):0.3f}, min {worst.fro_retained:.2%} "
          f"({worst.name})")


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Resize a kohya LoRA/LoCon file to a lower rank (SVD).")
    p.add_argument("--model", required=True, help="LoRA file to resize (.safetensors, .ckpt, .pt)")
    p.add_argument("--save_to", required=True, help="output file (.safetensors, .ckpt, .pt, .pth)")
    p.add_argument("--new_rank", type=int, default=4,
                   help="rank of the output's Linear/1x1 modules (with --dynamic_method: the maximum rank)")
    p.add_argument("--new_conv_rank", type=int, default=None,
                   help="rank of the output's 3x3 conv (LoCon) modules (default: --new_rank)")
    p.add_argument("--dynamic_method", default=None, choices=list(lora_svd.DYNAMIC_METHODS),
                   help="choose each module's rank by its singular values: sv_ratio (keep S_i >= S_max / "
                        "param), sv_cumulative (sum of kept S >= param * sum S), sv_fro (Frobenius norm "
                        "kept >= param); capped by --new_rank / --new_conv_rank")
    p.add_argument("--dynamic_param", type=float, default=None,
                   help="the criterion's parameter: sv_ratio >= 1, sv_fro / sv_cumulative in (0, 1]")
    p.add_argument("--save_precision", default=None, choices=["float", "fp16", "bf16"],
                   help="dtype of the output (default float)")
    p.add_argument("--device", default=None, help="device for the SVD (cpu, cuda, cuda:0; default cpu)")
    p.add_argument("--svd_lowrank_niter", type=int, default=None,
                   help="accepted for the kohya_ss GUI (iterations of an approximate SVD there): the SVD here "
                        "is exact and cheap, computed from the module's factors")
    p.add_argument("--verbose", action="store_true",
                   help="print every module's new rank and the fraction of its Frobenius norm kept")
    return p.parse_args(argv)


def run(args) -> None:
    new_conv_rank = args.new_conv_rank if args.new_conv_rank is not None else args.new_rank
    for option, value in (("--new_rank", args.new_rank), ("--new_conv_rank", new_conv_rank)):
        if value < 1:
            raise LoRAError(f"{option} {value}: must be >= 1")
    lora_svd.check_dynamic(args.dynamic_method, args.dynamic_param)
    if args.svd_lowrank_niter is not None:
        if args.svd_lowrank_niter < 0:
            raise LoRAError(f"--svd_lowrank_niter {args.svd_lowrank_niter}: must be >= 0")
        if args.svd_lowrank_niter > 0:
            print(f"note: --svd_lowrank_niter {args.svd_lowrank_niter}: not needed, the SVD is computed "
                  "exactly from each module's factors")
    lora_svd.check_lora_path("--model", args.model)
    lora_svd.check_save_to(args.save_to)
    device = lora_svd.parse_device(args.device)

    modules, metadata = lora_svd.read_lora(args.model, "resizing")
    resized, reports = resize_modules(modules, args.new_rank, new_conv_rank, args.dynamic_method,
                                      args.dynamic_param, device)
    _report(reports, args.verbose)

    old_dim = max(m.rank for m in modules.values())
    if args.dynamic_method:
        note = f"Dynamic resize with {args.dynamic_method}: {args.dynamic_param} from {old_dim}"
    else:
        conv = "" if new_conv_rank == args.new_rank else f" (conv: {new_conv_rank})"
        note = f"dimension is resized from {old_dim} to {args.new_rank}{conv}"
    metadata = lora_svd.rank_metadata(resized, lora_svd.add_comment(metadata, note))
    dtype = lora_svd.PRECISIONS[args.save_precision or "float"]
    lora_svd.save_lora(args.save_to, resized, metadata, dtype)
    print(f"saved {args.save_to}")


def main(argv=None) -> int:
    return lora_svd.tool_main(_parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
