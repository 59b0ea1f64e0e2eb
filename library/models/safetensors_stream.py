"""A .safetensors file written one tensor at a time (sd-scripts' ``mem_eff_save``): the header
is computed from the shapes and dtypes, then each tensor is cast, moved to the host and written
before the next one is touched, so a save never holds a second copy of the whole model (a
float32 model saved as bf16 on a GPU would otherwise be copied whole to the host first).

The file is a standard safetensors file (8-byte little-endian header length, the JSON header
with ``__metadata__``, padded with spaces to 8 bytes, then the data in header order), read by
``safetensors`` like any other.

    save_streaming(tensors, path, metadata, convert)   tensors: {name: tensor}; convert(t) -> t
"""
from __future__ import annotations

import json
import struct

import torch

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
          torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


def save_streaming(tensors: dict, path: str, metadata: dict | None = None, convert=None) -> None:
    """Write ``{name: tensor}`` to ``path``; ``convert`` (each tensor -> the tensor to store, e.g.
    a dtype cast) is applied to one tensor at a time, twice per tensor: once on the meta device
    for the header's shape and dtype, once for the data."""
    convert = convert or (lambda t: t)
    header, offset = {}, 0
    for name, t in tensors.items():
        m = convert(torch.empty(t.shape, dtype=t.dtype, device="meta"))
        n = m.numel() * m.element_size()
        header[name] = {"dtype": DTYPES[m.dtype], "shape": list(m.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, t in tensors.items():
            v = convert(t.detach()).contiguous().cpu()
            if v.numel():
                f.write(v.reshape(-1).view(torch.uint8).numpy().tobytes())
            del v  # before the next tensor is converted
