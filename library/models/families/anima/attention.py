"""attn_mode / split_attn (sd-scripts' Anima options): how the DiT's blocks attend, checked before
any weight loads.

- ``attn_mode`` torch / sdpa (sd-scripts' old name): PyTorch's SDPA, the default. flash:
  ``flash_attn``'s ``flash_attn_func``; xformers: ``xformers.ops.memory_efficient_attention``; each on
  CUDA with its package installed, refused in one line otherwise. sageattn is refused: it has no
  backward pass (sd-scripts: "sageattn does not support training").
- ``split_attn``: the attention one sample at a time (the DiT's attentions have no mask, so each
  sample's rows are exactly what the batched call computes for it).

The LLM adapter keeps SDPA with its masks whatever attn_mode says (sd-scripts' adapter calls SDPA).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from library.errors import UserError
from library.models import kernels

PACKAGES = {"flash": ("flash_attn", "flash-attn"), "xformers": ("xformers", "xformers")}


class AttentionError(UserError, ValueError):
    """An attn_mode this machine cannot honour; one line."""


def kernel(mode: str | None, cuda: bool | None = None) -> str | None:
    """attn_mode's kernel: "flash", "xformers" or None (SDPA); one line where it cannot run here."""
    if mode in (None, "torch", "sdpa"):
        return None
    if mode == "sageattn":
        raise AttentionError("attn_mode sageattn: sageattention has no backward pass (sd-scripts: inference "
                             "only), so it cannot train; use attn_mode torch, flash or xformers")
    package, pip = PACKAGES[mode]
    kernels.require(f"attn_mode {mode}", package, pip, "attn_mode torch uses SDPA", AttentionError, cuda)
    return mode


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def flash(q, k, v):
    """q, k, v (B, H, L, D) -> (B, H, L, D) through flash_attn's (B, L, H, D) kernel."""
    # lazy: an optional CUDA package, imported only when attn_mode chose it
    from flash_attn import flash_attn_func

    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def xformers(q, k, v):
    """q, k, v (B, H, L, D) -> (B, H, L, D) through xformers' (B, L, H, D) kernel."""
    # lazy: an optional CUDA package, imported only when attn_mode chose it
    import xformers.ops as xops

    def blhd(t):
        return t.transpose(1, 2).contiguous()

    return xops.memory_efficient_attention(blhd(q), blhd(k), blhd(v)).transpose(1, 2)


KERNELS = {None: sdpa, "flash": flash, "xformers": xformers}


def attend(q, k, v, kernel_name: str | None = None, split: bool = False):
    """Unmasked attention of q, k, v (B, H, L, D) with the named kernel; ``split``: per sample."""
    run = KERNELS[kernel_name]
    if split and q.shape[0] > 1:
        return torch.cat([run(q[i:i + 1], k[i:i + 1], v[i:i + 1]) for i in range(q.shape[0])])
    return run(q, k, v)


def configure(dit, kernel_name: str | None, split: bool) -> None:
    """Every attention of the DiT's blocks attends with ``kernel_name`` (None: SDPA), per sample
    when ``split``."""
    for block in dit.blocks:
        for attn in (block.self_attn, block.cross_attn):
            attn.kernel, attn.split = kernel_name, split
