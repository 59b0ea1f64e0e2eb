"""A whole Lumina Image 2.0 model (Next-DiT, Gemma-2 and its tokenizer, FLUX.1's autoencoder) from
the sources sd-scripts takes, with the checks that need no weights.

Sources:
- ``tiny-lumina`` (tiny.py); ``gemma2`` / ``ae`` files replace its parts when given;
- a single transformer file in the original layout (``lumina-image-2.safetensors``; ComfyUI's
  ``model.diffusion_model.`` prefix too) with the ``gemma2`` and ``ae`` files sd-scripts requires;
- a diffusers ``Lumina2Pipeline`` folder (``transformer/`` a Lumina2Transformer2DModel,
  ``text_encoder/`` Gemma-2, ``tokenizer/``, ``vae/``), converted to the original layout on load;
  ``gemma2`` / ``ae`` replace its parts when given.

``check_sources`` reads only headers and configs: a transformer that is not Lumina 2's, a Gemma-2
file of another size or layout (or one whose width is not the transformer's caption width), an
autoencoder that is not FLUX.1's 16-channel one: one line each, before any weight loads.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from library import files, safetensors_file
from library.errors import ModelError, first_line
from library.models import embedded_config, fp8_storage
from library.models.families.flux import flux_ae
from library.models.families.lumina import layout, text, tiny
from library.models.families.lumina.nextdit import NextDiT, NextDiTConfig
from library.models.loading import path_identity, quiet_progress
from library.models.sd_checkpoint import read_state_dict

META_CONFIG_KEY = "sdtk.lumina_config"


@dataclass
class LuminaModel:
    layout: str  # "original" or "diffusers": where the transformer came from (saved back in it)
    variant = "lumina2"  # sd-scripts' MODEL_VERSION_LUMINA_V2 (library/models/modelspec.py)
    config: NextDiTConfig
    transformer: NextDiT
    gemma2: Any  # transformers Gemma2Model
    tokenizer: Any  # Gemma's tokenizer
    ae: Any  # diffusers AutoencoderKL, 16 latent channels
    identity: str  # cache key of the transformer source
    ae_identity: str


def _builtin_name(name_or_path: str) -> bool:
    return name_or_path in tiny.TINY_NAMES and not os.path.exists(os.path.expanduser(name_or_path))


def _diffusers_config(folder: str) -> dict | None:
    cfg = os.path.join(folder, "transformer", "config.json")
    try:
        with open(cfg, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return data if data.get("_class_name") == layout.DIFFUSERS_CLASS else None


def _header(path: str) -> tuple[dict, dict]:
    """(name -> shape, metadata) of a .safetensors file; ({}, {}) when it is not one."""
    try:
        _, header = safetensors_file.read_header(path)
    except (OSError, ValueError, struct.error):  # (a JSON or Unicode error is a ValueError)
        return {}, {}
    meta = header.pop("__metadata__", None) or {}
    return {k: tuple(v["shape"]) for k, v in header.items()}, meta


def is_lumina_source(name_or_path: str | None) -> bool:
    """Whether a built-in name, a file or a folder is a Lumina 2 transformer (names, keys or
    config; no weight read)."""
    if not name_or_path:
        return False
    if _builtin_name(str(name_or_path)):
        return True
    path = os.path.expanduser(str(name_or_path))
    if os.path.isdir(path):
        return _diffusers_config(path) is not None
    return os.path.isfile(path) and path.endswith((".safetensors", ".sft")) \
        and layout.original_keys(_header(path)[0]) is not None


def _transformer_config(path: str) -> NextDiTConfig:
    if os.path.isdir(path):
        cfg = _diffusers_config(path)
        assert cfg is not None, path  # check_sources read it
        shapes: dict[str, tuple] = {}
        for name in sorted(os.listdir(os.path.join(path, "transformer"))):
            if name.endswith(".safetensors"):
                shapes.update(_header(os.path.join(path, "transformer", name))[0])
        ffn = shapes.get("layers.0.feed_forward.linear_1.weight", (4 * cfg.get("hidden_size", 0),))[0]
        return layout.config_from_diffusers(cfg, ffn, path)
    shapes, meta = _header(path)
    names = layout.original_keys(shapes)
    if names is None:
        raise ModelError(f"pretrained_model_name_or_path: {path} is not a Lumina 2 transformer (no "
                         f"{layout.MARKER} or x_embedder.weight)")
    record = embedded_config.read_record(meta, META_CONFIG_KEY, path)
    return layout.config_from_shapes({k: shapes[v] for k, v in names.items()}, path, record)


def check_ae(path: str, channels: int) -> None:
    """An ``ae`` file's latent channels from its header: FLUX.1's autoencoder has ``channels`` (16)."""
    if os.path.isdir(path):
        return  # a diffusers vae folder: its config is checked by diffusers on load
    shapes, _ = _header(path)
    conv = shapes.get("decoder.conv_in.weight")
    if conv is None:
        raise ModelError(f"ae: {path} is not an autoencoder file (no decoder.conv_in.weight)")
    if len(conv) != 4 or conv[1] != channels or "quant_conv.weight" in shapes:
        raise ModelError(f"ae: {path} is not FLUX.1's autoencoder: its latents have {conv[1] if len(conv) == 4 else '?'} "
                         f"channels{' and it has quant convs' if 'quant_conv.weight' in shapes else ''}; "
                         f"Lumina 2 reads {channels}-channel latents (FLUX.1's ae.safetensors)")


def check_sources(name_or_path: str, gemma2: str | None, ae: str | None) -> NextDiTConfig:
    """The transformer's config, after checking the parts sd-scripts needs beside it and their
    headers; one line naming the option and file otherwise. No weight is read."""
    if _builtin_name(name_or_path):
        config = tiny.nextdit.TINY
    else:
        path = os.path.expanduser(name_or_path)
        config = _transformer_config(path)
        if not os.path.isdir(path):
            for opt, value in (("gemma2", gemma2), ("ae", ae)):
                if not value:
                    raise ModelError(f"{opt}: required with a single-file Lumina 2 transformer ({name_or_path}); "
                                     f"give the {opt} file (sd-scripts' --{opt})")
    for opt, value in (("gemma2", gemma2), ("ae", ae)):
        if value and not os.path.exists(os.path.expanduser(value)):
            raise ModelError(f"{opt}: no such file or directory: {value}")
    if gemma2 and not os.path.isdir(os.path.expanduser(gemma2)):
        width = text.config_of_header(os.path.expanduser(gemma2))["config"]["hidden_size"]
        if width != config.cap_feat_dim:
            raise ModelError(f"gemma2: {gemma2} is {width} wide; the Lumina 2 transformer reads "
                             f"{config.cap_feat_dim}-wide caption states")
    if ae:
        check_ae(os.path.expanduser(ae), config.in_channels)
    return config


def load_lumina(name_or_path: str, *, gemma2: str | None = None, ae: str | None = None,
                dtype: torch.dtype = torch.float32, tokenizer: str | None = None) -> LuminaModel:
    """The model from a built-in name, an original-layout file (+ gemma2, ae) or a diffusers folder."""
    config = check_sources(name_or_path, gemma2, ae)
    with quiet_progress():
        if _builtin_name(name_or_path):
            parts = tiny.build_tiny_lumina()
            kind, ident = "original", f"builtin:{name_or_path}:{tiny.SEED}"
            ae_ident = ident + ":ae"
            transformer = parts["transformer"]
        else:
            path = os.path.expanduser(name_or_path)
            ident, ae_ident = path_identity(path), None
            if os.path.isdir(path):
                kind, transformer, parts = "diffusers", _folder_transformer(path, config, dtype), _folder_parts(path, dtype)
                ae_ident = path_identity(os.path.join(path, "vae"))
            else:
                kind, transformer, parts = "original", _file_transformer(path, config, dtype), {}
        if gemma2:
            parts["gemma2"], tok = text.load_gemma2(os.path.expanduser(gemma2), dtype, tokenizer)
            parts["tokenizer"] = tok or parts.get("tokenizer")
        if parts.get("tokenizer") is None or tokenizer:
            parts["tokenizer"] = text.load_tokenizer(tokenizer)
        if ae:
            parts["ae"], ae_ident = flux_ae.load_ae(os.path.expanduser(ae), dtype), path_identity(os.path.expanduser(ae))
    for k in ("gemma2", "ae"):
        # nn.Module.to directly: diffusers' override only adds a warning about fp32-kept modules (none here)
        parts[k] = torch.nn.Module.to(parts[k], dtype).eval()
    assert ae_ident is not None  # check_sources refused a single file without ae
    return LuminaModel(kind, config, transformer.to(dtype).eval(), parts["gemma2"], parts["tokenizer"], parts["ae"],
                       ident, ae_ident)


def _build(config: NextDiTConfig, sd: dict, path: str, dtype: torch.dtype) -> NextDiT:
    with torch.device("meta"):
        model = NextDiT(config)
    expected = set(model.state_dict())
    missing, extra = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or extra:
        raise ModelError(f"{path}: not a Lumina 2 transformer of its own shape "
                         f"({'missing ' + missing[0] if missing else 'unexpected ' + extra[0]})")
    model.load_state_dict(fp8_storage.load_dtype(sd, dtype, path), strict=True, assign=True)
    return model


def _file_transformer(path: str, config: NextDiTConfig, dtype: torch.dtype) -> NextDiT:
    sd, _ = read_state_dict(path)
    names = layout.original_keys(sd)
    assert names is not None, path  # check_sources read its header
    return _build(config, {k: sd[v] for k, v in names.items()}, path, dtype)


def _folder_transformer(folder: str, config: NextDiTConfig, dtype: torch.dtype) -> NextDiT:
    sd = {}
    sub = os.path.join(folder, "transformer")
    for name in sorted(os.listdir(sub)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(sub, name), framework="pt") as f:
                sd.update({k: f.get_tensor(k) for k in f.keys()})
    return _build(config, layout.from_diffusers(sd, config), folder, dtype)


def _folder_parts(folder: str, dtype: torch.dtype) -> dict:
    # lazy: transformers' Gemma2Model only for a diffusers folder's own text encoder
    from transformers import Gemma2Model

    try:
        gemma2 = Gemma2Model.from_pretrained(folder, subfolder="text_encoder", local_files_only=True,
                                             torch_dtype=dtype)
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelError(f"{folder}: cannot load the diffusers Lumina 2 folder (text_encoder): {first_line(e)}") from None
    tok = text.load_tokenizer(os.path.join(folder, "tokenizer"), required=False)
    return {"gemma2": gemma2, "tokenizer": tok, "ae": flux_ae.load_ae(folder, dtype)}


def save_transformer(path: str, model: LuminaModel, state_dict: dict, metadata: dict, dtype=None) -> None:
    """The trained transformer in the layout it came from: an original-layout file (with this
    toolkit's config record) or a diffusers transformer folder (config.json and weights), each
    written one tensor at a time and atomically (a crash leaves the previous one as it was)."""
    meta = {k: str(v) for k, v in metadata.items()}
    meta[META_CONFIG_KEY] = json.dumps(_config_record(model.config))
    cast = lambda v: fp8_storage.cast_floating(v, dtype)  # noqa: E731
    if model.layout == "original":
        with files.atomic_path(path) as tmp:
            safetensors_file.save_streaming(state_dict, tmp, meta, cast)
        return
    with files.atomic_dir(path) as tmp:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(layout.diffusers_config(model.config), f, indent=2)
        safetensors_file.save_streaming(layout.to_diffusers(state_dict, model.config),
                                        os.path.join(tmp, "diffusion_pytorch_model.safetensors"), meta, cast)


def _config_record(config: NextDiTConfig) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.__dict__.items()}
