"""Weighted merge of whole SD1 / SD2 / SDXL checkpoints (sd-scripts' tools/merge_models.py).

Per tensor: sum_i ratio_i * x_i, in the compute dtype (``--precision``), saved in
``--saving_precision``; ratios default to 1 / n. sd-scripts' rules are kept: old-style text
encoder keys (``cond_stage_model.transformer.encoder.``) are read as ``...text_model.encoder.``;
a key the first file has and a later one lacks takes the first file's value at that file's
ratio (a warning names it); keys only later files have are left out (``--show_skipped`` lists
them); ``--unet_only`` merges the U-Net and copies the VAE and text encoders from the first file.
The tensors are read onto ``--device`` (default the CPU) and summed there.
Stronger than sd-scripts: every file is checked before any tensor is read (a missing file, a
non-safetensors file, another model family or a differently shaped tensor is one line naming
it), non-floating tensors are copied from the first file, and the output is checked finite in
its dtype and written atomically.
"""
from __future__ import annotations

import json
import logging
import os

import torch
from safetensors import safe_open

from library import safetensors_file
from library.errors import ModelError, first_line
from library.files import atomic_path
from library.models import fp8_storage, sd_checkpoint

logger = logging.getLogger("sdtk")

PRECISIONS = {"float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_TE_KEY_RENAMES = tuple(
    (f"cond_stage_model.transformer.{part}", f"cond_stage_model.transformer.text_model.{part}")
    for part in ("embeddings.", "encoder.", "final_layer_norm."))
_NOT_UNET = ("first_stage_model", "cond_stage_model", "conditioner.")


def canonical_key(key: str) -> str:
    """The key with sd-scripts' old-style SD1 text-encoder prefix renamed."""
    for old, new in _TE_KEY_RENAMES:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def is_unet_key(key: str) -> bool:
    return not any(marker in key for marker in _NOT_UNET)


class _Source:
    """One input file: its keys (canonical -> as stored), shapes, family, and an open handle."""

    def __init__(self, path: str, device: torch.device):
        if not os.path.isfile(path):
            raise ModelError(f"--models {path}: no such file")
        if not path.endswith(".safetensors"):
            raise ModelError(f"--models {path}: not a .safetensors file (convert it with "
                             "tools/convert_diffusers20_original_sd.py)")
        try:
            self.handle = safe_open(path, framework="pt", device=str(device))
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ModelError(f"--models {path}: not a readable safetensors file ({first_line(e)})") from None
        self.path = path
        self.keys = {canonical_key(k): k for k in self.handle.keys()}
        self.shapes = {k: tuple(self.handle.get_slice(stored).get_shape()) for k, stored in self.keys.items()}
        meta_tensors = {k: torch.empty(s, device="meta") for k, s in self.shapes.items()}
        self.family = sd_checkpoint.detect_family(meta_tensors, path)
        self.metadata = self.handle.metadata() or {}

    def tensor(self, key: str) -> torch.Tensor:
        return self.handle.get_tensor(self.keys[key])


def check_sources(sources: list[_Source]) -> None:
    """One family, and one shape per key the first file and a later one share."""
    first = sources[0]
    for src in sources[1:]:
        if src.family != first.family:
            raise ModelError(f"--models: {src.path} is a {src.family} model but {first.path} is {first.family}")
        for key, shape in src.shapes.items():
            if key in first.shapes and first.shapes[key] != shape:
                raise ModelError(f"--models: {key} is {list(first.shapes[key])} in {first.path} but {list(shape)} "
                                 f"in {src.path}")


def merge(paths: list[str], ratios: list[float] | None, compute: torch.dtype = torch.float32,
          unet_only: bool = False, show_skipped: bool = False,
          device: torch.device = torch.device("cpu")) -> tuple[dict, dict[str, str]]:
    """(merged tensors in the compute dtype, on ``device``, metadata); see the module docstring."""
    if ratios is None:
        ratios = [1.0 / len(paths)] * len(paths)
    if len(ratios) != len(paths):
        raise ModelError(f"--ratios: {len(ratios)} value(s) given for {len(paths)} file(s) in --models")
    sources = [_Source(p, device) for p in paths]
    check_sources(sources)
    first = sources[0]
    merged: dict[str, torch.Tensor] = {}
    for key in first.keys:
        value = first.tensor(key)
        if not value.is_floating_point() or (unet_only and not is_unet_key(key)):
            merged[key] = value.to(compute) if value.is_floating_point() else value
            continue
        acc = ratios[0] * value.to(compute)
        for src, ratio in zip(sources[1:], ratios[1:]):
            if key in src.keys:
                acc = acc + ratio * src.tensor(key).to(compute)
            else:
                logger.warning("%s: %s is missing; the first model's value is used at its ratio %g",
                               src.path, key, ratio)
                acc = acc + ratio * value.to(compute)
        merged[key] = acc
    for src in sources[1:]:
        for key in src.keys:
            if key not in first.keys and show_skipped:
                logger.info("Skip: %s (not in %s)", key, first.path)
    metadata = {"sdtk.merged_from": json.dumps([[os.path.basename(p), r] for p, r in zip(paths, ratios)])}
    if sd_checkpoint.META_CONFIG_KEY in first.metadata:  # tiny / custom architectures reload offline
        metadata[sd_checkpoint.META_CONFIG_KEY] = first.metadata[sd_checkpoint.META_CONFIG_KEY]
    return merged, metadata


def output_path(output: str) -> str:
    """sd-scripts' rule: ``.safetensors`` appended when the name lacks it."""
    return output if output.endswith(".safetensors") else output + ".safetensors"


def save(merged: dict, metadata: dict[str, str], path: str, dtype: torch.dtype) -> None:
    """Cast, check finite (nothing is written otherwise) and write atomically."""
    out = {k: fp8_storage.cast_floating(v, dtype).contiguous().cpu() for k, v in merged.items()}
    fp8_storage.check_finite_as(out, None, path)
    with atomic_path(path) as tmp:
        safetensors_file.save(out, tmp, metadata=metadata)
