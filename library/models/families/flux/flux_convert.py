"""A diffusers FLUX.1 transformer written as one BFL-layout file (tools/convert_diffusers_to_flux.py,
sd-scripts' tool of the same name): read by the model loader (library/models/families/flux/flux_checkpoint.py,
the one BFL <-> diffusers map), written by its streaming BFL writer, atomically.
"""
from __future__ import annotations

import os
import struct

import torch

from library import safetensors_file
from library.errors import ModelError
from library.models import fp8_storage
from library.models.families.flux import flux_checkpoint


def _inputs(source: str) -> list[str]:
    if os.path.isdir(source):
        return [os.path.join(root, f) for root, _, files in os.walk(source) for f in files]
    return flux_checkpoint.shard_files(source)


def _header_keys(path: str) -> list[str]:
    """The tensor names of a safetensors file ([] when it is not one: the reader then says why)."""
    try:
        return [k for k in safetensors_file.read_header(path)[1] if k != "__metadata__"]
    except (OSError, ValueError, struct.error):
        return []


def check_paths(source: str, save_to: str) -> None:
    """Before anything is read: the source exists, the output is a .safetensors file that is
    none of the inputs (nor inside the input folder)."""
    if not os.path.exists(source):
        raise ModelError(f"--diffusers_path {source}: not found")
    if not save_to.lower().endswith((".safetensors", ".sft")):
        raise ModelError(f"--save_to {save_to}: must be a .safetensors file")
    if os.path.isdir(save_to):
        raise ModelError(f"--save_to {save_to}: is a folder")
    target = os.path.realpath(save_to)
    if os.path.isdir(source) and target.startswith(os.path.realpath(source) + os.sep):
        raise ModelError(f"--save_to {save_to}: is inside --diffusers_path {source}; write it elsewhere")
    if any(os.path.realpath(f) == target for f in _inputs(source)):
        raise ModelError(f"--save_to {save_to}: is an input file; write it elsewhere")


def diffusers_to_bfl_file(source: str, save_to: str, dtype: torch.dtype | None = None) -> flux_checkpoint.TransformerWeights:
    """Read a diffusers FLUX.1 transformer (a FLUX folder, its transformer/ folder, or the first of
    its shards) and write it to ``save_to`` in the BFL layout, floating tensors in ``dtype`` (None:
    as stored). A tensor that would not be finite in ``dtype`` stops the conversion by name before
    anything is written."""
    check_paths(source, save_to)
    if os.path.isfile(source) and flux_checkpoint.layout_of(_header_keys(source)) == "bfl":
        raise ModelError(f"--diffusers_path {source}: already a FLUX.1 transformer in the BFL layout")
    weights = flux_checkpoint.read_transformer(source, None)
    if weights.layout != "diffusers":
        raise ModelError(f"--diffusers_path {source}: already a FLUX.1 transformer in the BFL layout")
    fp8_storage.check_finite_as(weights.state_dict, dtype, source)
    flux_checkpoint.save_flux_transformer(save_to, weights.state_dict, "bfl", weights.config, dtype=dtype)
    return weights
