"""Safetensors files that are the same, byte for byte, whichever process writes them.

safetensors (0.8) writes the ``__metadata__`` of a file in the order of a per-process hash map, so
two runs that train the same weights wrote different bytes. ``save`` writes the file with
safetensors and then rewrites its header with the metadata keys sorted (the tensors' entries and
data are untouched: their offsets count from the end of the header). Every writer of a
safetensors file (models, LoRA files, states, caches) calls it. ``save_streaming`` writes a file
one tensor at a time (sd-scripts' ``mem_eff_save``): the header is computed from the shapes and
dtypes, then each tensor is converted (cast, moved to the host) and written before the next one
is touched, so a save never holds a second copy of the whole model.
"""
from __future__ import annotations

import json
import os
import shutil
import struct

_ALIGN = 8  # safetensors pads its header with spaces to a multiple of 8 bytes
# safetensors' dtype names (torch dtype names -> the header's)
DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
          "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int64": "I64", "int32": "I32",
          "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def save(tensors: dict, path: str, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` with a reproducible header."""
    # lazy: the checkpoint modules that write files are imported before torch on the dry run's path
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)
    if metadata:
        sort_metadata(path)


def read_header(path: str) -> tuple[int, dict]:
    """(header length in bytes, the header as written: key order kept)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def sort_metadata(path: str) -> None:
    """Rewrite ``path``'s header with ``__metadata__`` first and its keys sorted."""
    n, header = read_header(path)
    meta = header.pop("__metadata__", None)
    if meta is None:
        return
    write_header(path, n, {"__metadata__": dict(sorted(meta.items())), **header})


def write_header(path: str, old_length: int, header: dict) -> None:
    """Replace the header of ``path`` (``old_length`` bytes now) by ``header``: in place, padded
    with spaces, where it fits; else the file is rewritten beside and moved over it."""
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(text) <= old_length:
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(text + b" " * (old_length - len(text)))
        return
    text += b" " * (-(8 + len(text)) % _ALIGN)
    tmp = f"{path}.header"
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        src.seek(8 + old_length)
        dst.write(struct.pack("<Q", len(text)))
        dst.write(text)
        shutil.copyfileobj(src, dst, 1 << 24)
    os.replace(tmp, path)


def save_streaming(tensors: dict, path: str, metadata: dict | None = None, convert=None) -> None:
    """Write ``{name: tensor}`` to ``path`` one tensor at a time, the header as ``save`` writes it;
    ``convert`` (each tensor -> the tensor to store, e.g. a dtype cast) is applied to one tensor at
    a time, twice per tensor: once on the meta device for the header's shape and dtype, once for
    the data."""
    import torch  # lazy: the checkpoint modules that write files are imported before torch (dry run)

    convert = convert or (lambda t: t)
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = dict(sorted((k, str(v)) for k, v in metadata.items()))
    for name, t in tensors.items():
        m = convert(torch.empty(t.shape, dtype=t.dtype, device="meta"))
        n = m.numel() * m.element_size()
        header[name] = {"dtype": DTYPES[str(m.dtype).removeprefix("torch.")], "shape": list(m.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, t in tensors.items():
            v = convert(t.detach()).contiguous().cpu()
            if v.numel():
                f.write(v.reshape(-1).view(torch.uint8).numpy().tobytes())
            del v  # before the next tensor is converted
