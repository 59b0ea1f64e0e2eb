"""Weights stored in float8 (``flux1-dev-fp8.safetensors``, ``t5xxl_fp8_e4m3fn.safetensors``):
up-cast on load to the dtype the model is built in.

This is storage only; computing with an fp8 frozen base (``fp8_base``) is library/models/fp8.py.
Also the storage dtypes of sd-scripts' file tools' ``--save_precision``.
"""
from __future__ import annotations

import torch

from library.errors import ModelError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# sd-scripts' --save_precision names (library/utils.py str_to_dtype) that a safetensors file can hold
SAVE_PRECISIONS = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
                   "float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
                   "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e4m3fn": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}


def save_dtype(name: str | None) -> torch.dtype | None:
    """--save_precision -> dtype (None: as stored); one line naming the flag for anything else."""
    if name is None:
        return None
    if name not in SAVE_PRECISIONS:
        raise ModelError(f"--save_precision {name!r}: expected one of {', '.join(SAVE_PRECISIONS)}")
    return SAVE_PRECISIONS[name]


def check_finite_as(tensors: dict, dtype: torch.dtype | None, source: str) -> None:
    """Every floating tensor finite once stored in ``dtype`` (None: as it is), else one line naming
    it: a conversion is stopped before anything is written."""
    for key, value in tensors.items():
        if value.is_floating_point() and not torch.isfinite(value.to(dtype or value.dtype).float()).all():
            cast = f" in {str(dtype).removeprefix('torch.')}" if dtype is not None else ""
            raise ModelError(f"{source}: {key} has non-finite values{cast}; not written")


def cast_floating(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` when it is a floating tensor (None: as it is); other tensors unchanged."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def load_dtype(state_dict: dict, dtype: torch.dtype | None, path: str) -> dict:
    """Every floating tensor in ``dtype`` (float8-stored ones up-cast; None: as stored). ComfyUI's *scaled* fp8
    files (each weight times a ``scale_weight``) are refused by name: read as plain fp8 their
    weights would be wrong."""
    if "scaled_fp8" in state_dict or any(k.endswith(".scale_weight") for k in state_dict):
        raise ModelError(f"{path}: a scaled-fp8 checkpoint (scale_weight tensors); use an unscaled one "
                         "(fp16, bf16 or plain float8_e4m3fn)")
    return {k: cast_floating(v, dtype) for k, v in state_dict.items()}
