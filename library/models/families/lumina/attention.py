"""use_flash_attn / use_sage_attn (sd-scripts' Lumina options): the attention kernel of the
Next-DiT's blocks, checked before any weight loads.

- flash: ``flash_attn``'s kernels on CUDA; a key mask runs as the variable-length kernel over each
  sample's own tokens (padded query rows get zeros; the transformer drops them).
- sage: ``sageattention``'s ``sageattn`` on CUDA, per sample over its own tokens. It has no backward
  pass (sd-scripts: "Sage Attention only supports inference"), so forwards that record gradients
  (training) use torch's SDPA and the no-grad ones (samples, validation) use sage.
Without the package or CUDA the option is refused with one line.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from library.errors import UserError
from library.models import kernels


class AttentionError(UserError, ValueError):
    """An attention option this machine cannot honour; one line."""


def check(use_flash_attn: bool, use_sage_attn: bool, cuda: bool | None = None) -> str | None:
    """"flash", "sage" or None (SDPA); one line when the kernel does not exist here."""
    if use_flash_attn and use_sage_attn:
        raise AttentionError("use_flash_attn and use_sage_attn: choose one attention kernel")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for flag, name, package, pip in ((use_flash_attn, "flash", "flash_attn", "flash-attn"),
                                     (use_sage_attn, "sage", "sageattention", "sageattention")):
        if not flag:
            continue
        kernels.require(f"use_{name}_attn", package, pip, "drop the option: SDPA is used", AttentionError, cuda)
        return name
    return None


def _varlen(q, k, v, mask, run):
    """run(q_i, k_i, v_i) (tokens, heads, dim) over each sample's own tokens; zeros elsewhere."""
    out = torch.zeros_like(q)
    for i in range(q.shape[0]):
        keep = mask[i].bool().nonzero().flatten() if mask is not None else slice(None)
        out[i, keep] = run(q[i, keep], k[i, keep], v[i, keep]).to(q.dtype)
    return out


def flash(q, k, v, mask, scale):
    """q, k, v (B, L, H, D) -> (B, L, H, D)."""
    # lazy: an optional CUDA package, imported only when the option chose it
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    if mask is None:
        return flash_attn_func(q, k, v, softmax_scale=scale)

    def run(qi, ki, vi):
        n = torch.tensor([0, qi.shape[0]], dtype=torch.int32, device=qi.device)
        return flash_attn_varlen_func(qi, ki, vi, n, n, qi.shape[0], qi.shape[0], softmax_scale=scale)

    return _varlen(q, k, v, mask, run)


def sage(q, k, v, mask, scale):
    if torch.is_grad_enabled():  # no backward pass in sageattention: SDPA where gradients are recorded
        attn_mask = None if mask is None else mask.bool()[:, None, None, :]
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=attn_mask, scale=scale).transpose(1, 2)
    # lazy: an optional CUDA package, imported only when the option chose it
    from sageattention import sageattn

    def run(qi, ki, vi):
        return sageattn(qi[None], ki[None], vi[None], tensor_layout="NHD", is_causal=False, sm_scale=scale)[0]

    return _varlen(q, k, v, mask, run)


KERNELS = {"flash": flash, "sage": sage}


def set_kernel(model, name: str | None) -> None:
    """Every attention of the Next-DiT ``model`` runs with the named kernel (None: SDPA)."""
    for module in model.modules():
        if hasattr(module, "kernel") and hasattr(module, "qkv"):
            module.kernel = KERNELS[name] if name else None
