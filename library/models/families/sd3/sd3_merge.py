"""An SD3 / SD3.5 transformer file and separate VAE / CLIP-L / CLIP-G / T5-XXL files merged into one
all-in-one single file (tools/merge_sd3_safetensors.py, sd-scripts' tool of the same name).

The keys are sd-scripts': the transformer under ``model.diffusion_model.``, the VAE (original
layout) under ``first_stage_model.``, the encoders (transformers layout) under
``text_encoders.{clip_l,clip_g,t5xxl}.transformer.``; keys that already carry their prefix are
kept. The metadata is the transformer file's (as sd-scripts; it holds ``sdtk.sd3_config`` for
files this toolkit wrote, so tiny or custom sizes load offline). Beyond sd-scripts: each file is
checked, from its header, to be the component its flag says (a CLIP file given as --t5xxl, a
diffusers-layout VAE, widths that do not fit the transformer are refused by name); a component
the transformer file already holds is replaced whole by the separate file (as the loader prefers
a separate file), where sd-scripts would overwrite key by key; the output is written one tensor
at a time, atomically, never over an input.
"""
from __future__ import annotations

import os
import struct

import torch

from library import safetensors_file
from library.errors import first_line
from library.files import atomic_path
from library.models import fp8_storage, sd_checkpoint
from library.models.families.sd3 import sd3, sd3_checkpoint, sd3_vae
from library.models.families.sd3.sd3 import SD3ModelError

PREFIX = {"dit": sd3.PREFIX, "vae": sd3_vae.PREFIX, **sd3_checkpoint.TE_PREFIX}
# what a component's keys in an all-in-one file start with (SAI's files also have e.g. text_encoders.clip_g.logit_scale)
OWNER = {"vae": sd3_vae.PREFIX, "clip_l": "text_encoders.clip_l.", "clip_g": "text_encoders.clip_g.",
         "t5xxl": "text_encoders.t5xxl."}
FLAGS = {"dit": "--dit", "vae": "--vae", "clip_l": "--clip_l", "clip_g": "--clip_g", "t5xxl": "--t5xxl"}
_CLIP_MARKER = "text_model.encoder.layers.0.self_attn.q_proj.weight"
_CLIP_WIDTH = "text_model.embeddings.token_embedding.weight"
_T5_MARKER = "encoder.block.0.layer.0.SelfAttention.q.weight"
_VAE_MARKER = "encoder.conv_out.weight"
_VAE_DIFFUSERS = "encoder.conv_norm_out.weight"  # diffusers' AutoencoderKL names (the LDM layout has encoder.norm_out)


def _shapes(path: str, flag: str) -> dict[str, list[int]]:
    """The file's tensor shapes by key, from its header alone."""
    if not os.path.isfile(path):
        raise SD3ModelError(f"{flag} {path}: file not found")
    if not path.lower().endswith((".safetensors", ".sft")):
        raise SD3ModelError(f"{flag} {path}: not a .safetensors file")
    try:
        length, header = safetensors_file.read_header(path)
    except (OSError, ValueError, struct.error) as e:
        raise SD3ModelError(f"{flag} {path}: not a readable safetensors file ({first_line(e)})") from None
    if not isinstance(header, dict):
        raise SD3ModelError(f"{flag} {path}: not a readable safetensors file")
    entries = {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    end = max((int(v.get("data_offsets", [0, 0])[1]) for v in entries.values()), default=0)
    if os.path.getsize(path) < 8 + length + end:
        raise SD3ModelError(f"{flag} {path}: truncated ({os.path.getsize(path)} bytes, its header needs "
                            f"{8 + length + end})")
    return {k: v.get("shape", []) for k, v in entries.items()}


def _component(shapes: dict, which: str) -> dict:
    """The keys of ``which`` in a file, without its prefix (all keys when none carries it)."""
    prefix = PREFIX[which]
    if any(k.startswith(prefix) for k in shapes):
        return {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}
    return shapes


def _check_kind(which: str, path: str, shapes: dict) -> None:
    flag, part = FLAGS[which], _component(shapes, which)
    other = next((w for w, prefix in OWNER.items() if w != which and any(k.startswith(prefix) for k in shapes)), None)
    if other is not None and which != "dit" and not any(k.startswith(OWNER[which]) for k in shapes):
        raise SD3ModelError(f"{flag} {path}: holds {other} weights ({OWNER[other]}*), not {which}")
    if which == "dit":
        if sd3_checkpoint.detect_variant(dict.fromkeys(shapes)) is None:
            raise SD3ModelError(f"{flag} {path}: not an SD3 transformer (no joint_blocks.0.x_block.attn.qkv)")
    elif which == "vae":
        if _VAE_DIFFUSERS in part:
            raise SD3ModelError(f"{flag} {path}: a VAE in diffusers' layout; the all-in-one file needs the "
                                "original layout (ae.safetensors, encoder.down.0...)")
        if _VAE_MARKER not in part:
            raise SD3ModelError(f"{flag} {path}: not a VAE in the original layout (no {_VAE_MARKER})")
    elif which in ("clip_l", "clip_g"):
        if _CLIP_MARKER not in part:
            raise SD3ModelError(f"{flag} {path}: not a CLIP text encoder in transformers' layout (no {_CLIP_MARKER})")
    elif _T5_MARKER not in part:
        raise SD3ModelError(f"{flag} {path}: not a T5 encoder in transformers' layout (no {_T5_MARKER})")


def _check_widths(parts: dict[str, tuple[str, dict]]) -> None:
    """The encoders against the transformer: CLIP-L's + CLIP-G's pooled widths make its pooled
    input (y_embedder), CLIP-L the narrower; T5's width is its context input (context_embedder)."""
    dit = sd3.strip_prefix(parts["dit"][1])
    pooled, context = dit.get("y_embedder.mlp.0.weight"), dit.get("context_embedder.weight")
    widths = {}
    for which in ("clip_l", "clip_g"):
        if which in parts:
            clip = _component(parts[which][1], which)
            proj = clip.get("text_projection.weight")
            widths[which] = proj[0] if proj else clip[_CLIP_WIDTH][1]
    if len(widths) == 2 and pooled and widths["clip_l"] + widths["clip_g"] != pooled[1]:
        raise SD3ModelError(f"--clip_l {parts['clip_l'][0]} and --clip_g {parts['clip_g'][0]}: pooled widths "
                            f"{widths['clip_l']} + {widths['clip_g']}, the transformer takes {pooled[1]}")
    if len(widths) == 2 and widths["clip_l"] > widths["clip_g"]:
        raise SD3ModelError(f"--clip_l {parts['clip_l'][0]} is wider than --clip_g {parts['clip_g'][0]} "
                            "(swapped?)")
    if "t5xxl" in parts and context:
        width = _component(parts["t5xxl"][1], "t5xxl")[_T5_MARKER][1]
        if width != context[1]:
            raise SD3ModelError(f"--t5xxl {parts['t5xxl'][0]}: T5 of width {width}, the transformer's context "
                                f"input is {context[1]} wide")


def _read(path: str) -> tuple[dict, dict]:
    return sd_checkpoint.read_state_dict(path)  # a file that cannot be read: one ModelError line


def _prefixed(sd: dict, which: str) -> dict:
    prefix = PREFIX[which]
    return {(k if k.startswith(prefix) else prefix + k): v for k, v in sd.items()}


def merge(files: dict[str, str], output: str, dtype: torch.dtype | None = None, log=print) -> int:
    """files: {"dit": path, and any of "vae", "clip_l", "clip_g", "t5xxl"}; -> the number of
    tensors written to ``output`` (floating ones in ``dtype``; None: as stored)."""
    if not output.lower().endswith(".safetensors"):
        raise SD3ModelError(f"--output {output}: must be a .safetensors file")
    if os.path.isdir(output):
        raise SD3ModelError(f"--output {output}: is a folder")
    parts = {which: (path, _shapes(path, FLAGS[which])) for which, path in files.items() if path}
    for which, (path, shapes) in parts.items():
        _check_kind(which, path, shapes)
        if os.path.exists(output) and os.path.samefile(path, output):
            raise SD3ModelError(f"--output {output}: is {FLAGS[which]}; write the merged file elsewhere")
    _check_widths(parts)
    dit_sd, metadata = _read(parts["dit"][0])
    dit_keys = list(dit_sd)
    merged = {}
    for key, value in dit_sd.items():
        owner = next((w for w, prefix in OWNER.items() if key.startswith(prefix)), None)
        if owner is not None and owner in parts:
            continue  # replaced by the separate file
        kept = owner is not None or key.startswith((sd3.PREFIX, "text_encoders."))
        merged[key if kept else sd3.PREFIX + key] = value
    del dit_sd
    for which in ("vae", "clip_l", "clip_g", "t5xxl"):
        if which not in parts:
            continue
        if any(k.startswith(OWNER[which]) for k in dit_keys):
            log(f"{FLAGS[which]}: replaces the {which} weights of --dit {parts['dit'][0]}")
        merged.update(_prefixed(_read(parts[which][0])[0], which))
    fp8_storage.check_finite_as(merged, dtype, output)
    with atomic_path(output) as tmp:
        safetensors_file.save_streaming(merged, tmp, metadata, lambda t: fp8_storage.cast_floating(t, dtype))
    return len(merged)
