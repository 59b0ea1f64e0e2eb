"""Calibration of the memory estimate's activation count for FLUX.1 on the CPU, one full-width
block at a time (a whole FLUX.1 dev does not fit a CPU test machine).

    python benchmarks/flux_block_memory.py [--resolution 512] [--blocks double single] [--bf16]

For one FLUX.1 dev double block and one single block (hidden 3072, 24 heads, MLP 12288, the
real RoPE axes), at ``--resolution`` px (image tokens (px/16)^2 plus 512 T5 tokens), each in a
fresh process: the bytes autograd saves for backward as the estimate counts them
(library/training/memory_estimate.py ``_SavedCounter``: distinct storages, parameters excluded)
and the measured growth of the process's peak resident set over its resident set before the
forward (Linux VmHWM, reset through /proc/self/clear_refs), through a forward and a backward
with the block's weights frozen (the input gradient only: the block's parameters and their
gradients are not activations). Each block runs once and twice in a row (same weights): the
growth per counted byte from one to two (``factor_per_saved_byte``) is what
``ACTIVATION_FACTOR`` (0.85, fitted on sd15-arch's U-Net) stands for, and what remains
(``transient_bytes``) the backward's temporary buffers of one block. The per-block parameter
count is printed beside the hand count of the layer shapes. One JSON line per block.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from library.models.families.flux import flux  # noqa: E402
from library.training.host_memory import resident_bytes, return_large_frees, trim_heap  # noqa: E402
from library.training.memory_estimate import _SavedCounter  # noqa: E402


def _hand_count(kind: str, h: int = 3072, m: int = 12288, hd: int = 128) -> int:
    def lin(i, o):
        return i * o + o

    if kind == "double":
        return 2 * (lin(h, 6 * h) + lin(h, 3 * h) + 2 * hd + lin(h, h) + lin(h, m) + lin(m, h))
    return lin(h, 3 * h + m) + lin(h + m, h) + 2 * hd + lin(h, 3 * h)


def measure(kind: str, resolution: int, bf16: bool, repeats: int) -> dict:
    """In this process: the counted saved bytes and the measured peak growth of ``repeats``
    applications of one block in a row (the same weights; each application saves its own
    activations, as consecutive blocks of the model do)."""
    return_large_frees()
    cfg = flux.FLUX_DEV
    torch.manual_seed(0)
    if kind == "double":
        block = flux.DoubleStreamBlock(cfg.hidden_size, cfg.num_heads, cfg.mlp_ratio, cfg.qkv_bias)
    else:
        block = flux.SingleStreamBlock(cfg.hidden_size, cfg.num_heads, cfg.mlp_ratio)
    block.requires_grad_(False)
    n_params = sum(p.numel() for p in block.parameters())
    side = resolution // 16
    n_img, n_txt = side * side, 512
    dtype = torch.bfloat16 if bf16 else torch.float32
    img = torch.randn(1, n_img, cfg.hidden_size, requires_grad=True)
    txt = torch.randn(1, n_txt, cfg.hidden_size, requires_grad=True)
    vec = torch.randn(1, cfg.hidden_size)
    ids = torch.cat((flux.text_ids(n_txt, 1), flux.image_ids(side, side, 1)), dim=1)
    pe = flux.EmbedND(cfg.head_dim, cfg.theta, cfg.axes_dim)(ids)
    keys = {p.untyped_storage()._cdata for p in block.parameters()}
    counter = _SavedCounter(keys, None)
    trim_heap()
    before = resident_bytes()
    with open("/proc/self/clear_refs", "w") as f:  # the peak from here on
        f.write("5")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with counter.hooks(), autocast:
        if kind == "double":
            a, b = img, txt
            for _ in range(repeats):
                a, b = block(a, b, vec, pe)
            out = a.float().square().mean() + b.float().square().mean()
        else:
            x = torch.cat((txt, img), dim=1)
            for _ in range(repeats):
                x = block(x, vec, pe)
            out = x.float().square().mean()
    saved = counter.total()
    out.backward()
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return {"block": kind, "repeats": repeats, "resolution": resolution, "tokens": n_img + n_txt,
            "dtype": str(dtype).replace("torch.", ""), "params": n_params,
            "params_hand_count": _hand_count(kind), "saved_bytes": saved,
            "peak_growth_bytes": hwm - before}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--blocks", nargs="*", default=["double", "single"], choices=["double", "single"])
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (default float32)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(measure(a.child, a.resolution, a.bf16, a.repeats)), flush=True)
        return 0
    for kind in a.blocks:  # each in a fresh process: the peaks do not mix
        rows = []
        for repeats in (1, 2):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--resolution",
                   str(a.resolution), "--repeats", str(repeats)] + (["--bf16"] if a.bf16 else [])
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                print(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}",
                      file=sys.stderr)
                return 1
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        one, two = rows
        # per block: the slope from one application to two (the transient of the backward,
        # one block's worth, is in both and cancels); the intercept is that transient
        slope = (two["peak_growth_bytes"] - one["peak_growth_bytes"]) / (two["saved_bytes"] - one["saved_bytes"])
        print(json.dumps({**one, "saved_bytes_2": two["saved_bytes"],
                          "peak_growth_bytes_2": two["peak_growth_bytes"],
                          "factor_per_saved_byte": round(slope, 3),
                          "transient_bytes": int(one["peak_growth_bytes"] - slope * one["saved_bytes"])}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
