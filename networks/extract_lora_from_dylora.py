"""Cut LoRA files of lower ranks out of a DyLoRA file (sd-scripts' networks/extract_lora_from_dylora.py).

    python networks/extract_lora_from_dylora.py --model dylora.safetensors --save_to out.safetensors --unit 4

A DyLoRA (networks.dylora) is trained so that its first r ranks alone are a LoRA of rank r, for
every multiple r of its unit: for r = unit, 2 unit, ... below the file's rank this writes
``<save_to stem>-<r, 4 digits><ext>`` with each module's first r rows of ``lora_down`` and first r
columns of ``lora_up``, alpha unchanged (as sd-scripts), ``ss_network_dim`` = r and the comment
"split from DyLoRA, rank R to r". Beyond sd-scripts: the sshs_* hashes are those of each written
file (sd-scripts writes them into the input's metadata), writes are atomic, errors are one line.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from networks import lora_svd  # noqa: E402
from networks.lora import LoRAError  # noqa: E402


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Cut LoRA files of each rank (multiples of --unit) out of a DyLoRA.")
    p.add_argument("--model", required=True, help="DyLoRA file (.safetensors, .ckpt, .pt)")
    p.add_argument("--save_to", required=True, help="base output name: <stem>-<rank>.<ext> per rank")
    p.add_argument("--unit", type=int, required=True, help="rank step: the DyLoRA's network_args unit")
    return p.parse_args(argv)


def split(modules: dict[str, lora_svd.Module], unit: int) -> tuple[int, list[tuple[int, dict]]]:
    """(the file's rank, [(r, modules cut to rank r)] for r = unit, 2 unit, ... < rank)."""
    ranks = {m.rank for m in modules.values()}
    max_rank = max(ranks)
    out = []
    for r in range(unit, max_rank, unit):
        out.append((r, {name: lora_svd.Module(name, m.down[:r].contiguous(), m.up[:, :r].contiguous(), m.alpha)
                        for name, m in modules.items()}))
    return max_rank, out


def run(args) -> None:
    if args.unit < 1:
        raise LoRAError(f"--unit {args.unit}: must be >= 1")
    lora_svd.check_lora_path("--model", args.model)
    lora_svd.check_save_to(args.save_to)
    modules, metadata = lora_svd.read_lora(args.model, "cutting its rank")
    if len({m.rank for m in modules.values()}) > 1:
        raise LoRAError(f"{args.model}: modules of different ranks; a DyLoRA file has one rank for all")
    max_rank, parts = split(modules, args.unit)
    if not parts:
        raise LoRAError(f"--unit {args.unit}: no rank below the file's rank {max_rank} to cut")
    if max_rank % args.unit:
        raise LoRAError(f"--unit {args.unit} does not divide the file's rank {max_rank}")
    stem, ext = os.path.splitext(args.save_to)
    old = metadata.get("ss_training_comment", "")
    for r, cut in parts:
        meta = dict(metadata)
        meta["ss_training_comment"] = f"split from DyLoRA, rank {max_rank} to {r}; {old}"
        meta["ss_network_dim"] = str(r)
        path = f"{stem}-{r:04d}{ext}"
        lora_svd.save_lora(path, cut, meta, None)
        print(f"saved {path}")


def main(argv=None) -> int:
    return lora_svd.tool_main(_parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
