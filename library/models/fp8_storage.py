"""Weights stored in float8 (``flux1-dev-fp8.safetensors``, ``t5xxl_fp8_e4m3fn.safetensors``):
up-cast on load to the dtype the model is built in.

This is storage only; computing with an fp8 frozen base (``fp8_base``) is library/models/fp8.py.
"""
from __future__ import annotations

import torch

from library.errors import ModelError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def load_dtype(state_dict: dict, dtype: torch.dtype | None, path: str) -> dict:
    """Every floating tensor in ``dtype`` (float8-stored ones up-cast; None: as stored). ComfyUI's *scaled* fp8
    files (each weight times a ``scale_weight``) are refused by name: read as plain fp8 their
    weights would be wrong."""
    if "scaled_fp8" in state_dict or any(k.endswith(".scale_weight") for k in state_dict):
        raise ModelError(f"{path}: a scaled-fp8 checkpoint (scale_weight tensors); use an unscaled one "
                         "(fp16, bf16 or plain float8_e4m3fn)")
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in state_dict.items()}
