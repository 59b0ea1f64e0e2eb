"""Optional CUDA attention kernels (flash_attn, sageattention, xformers) that a family's option
asks for (Lumina 2's use_flash_attn / use_sage_attn, Anima's attn_mode): whether one can run here,
checked before any weight loads; one line naming the option otherwise."""
from __future__ import annotations

import importlib.util

import torch


def require(option: str, package: str, pip: str, fallback: str, error: type[Exception],
            cuda: bool | None = None) -> None:
    """Raise ``error`` (one line starting with ``option``) unless a CUDA device and ``package`` are
    here; ``fallback`` says what to do instead."""
    if not (torch.cuda.is_available() if cuda is None else cuda):
        raise error(f"{option}: {package}'s kernels run on CUDA only; this run has no CUDA device ({fallback})")
    if importlib.util.find_spec(package) is None:
        raise error(f"{option}: the {package} package is not installed (pip install {pip}), or {fallback}")
