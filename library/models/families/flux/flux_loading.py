"""A whole FLUX.1 model (transformer, CLIP-L, T5-XXL, autoencoder, tokenizers) from the sources
sd-scripts takes, and the diffusers folder writer.

Sources:
- a built-in name: ``tiny-flux`` (dev: guidance input) or ``tiny-flux-schnell`` (library/models/families/flux/tiny_flux.py);
- a single transformer file in the BFL layout (``flux1-dev.safetensors``, also fp8-stored, also
  with the ``model.diffusion_model.`` prefix) with separate ``clip_l``, ``t5xxl`` and ``ae`` files;
- a diffusers FLUX folder (``transformer/``, ``text_encoder/``, ``text_encoder_2/``, ``vae/``,
  ``tokenizer/``, ``tokenizer_2/``); its transformer is converted to the BFL layout on load.
The variant (dev / schnell) comes from the weights (flux_checkpoint.variant_of).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer

from library.errors import ModelError, first_line
from library.models import clip_l_file
from library.models import t5
from library.models.families.flux import flux_ae, flux_checkpoint, tiny_flux
from library.models.families.flux.flux import Flux, FluxConfig
from library.models.loading import path_identity, quiet_progress

logger = logging.getLogger("sdtk")


@dataclass
class FluxModel:
    variant: str  # "dev" | "schnell"
    layout: str  # the transformer's source layout, "bfl" or "diffusers": saved back in it
    config: FluxConfig
    transformer: Flux
    clip_l: Any  # transformers CLIPTextModel (its pooled output is the vector input)
    t5: Any  # transformers T5EncoderModel
    ae: Any  # diffusers AutoencoderKL, 16 latent channels
    clip_tokenizer: Any
    t5_tokenizer: Any
    t5_max_length: int  # t5xxl_max_token_length default of the variant: dev 512, schnell 256
    identity: str  # cache key of the transformer source
    ae_identity: str


def is_flux_source(path: str) -> bool:
    """Whether ``path`` (a file or a diffusers folder) holds a FLUX.1 transformer, from its keys."""
    if os.path.isdir(path):
        cfg = os.path.join(path, "transformer", "config.json")
        if not os.path.isfile(cfg):
            return False
        try:
            with open(cfg, encoding="utf-8") as f:
                return json.load(f).get("_class_name") == "FluxTransformer2DModel"
        except (OSError, json.JSONDecodeError):
            return False
    if not path.endswith((".safetensors", ".sft")):
        return False
    try:
        with safe_open(path, framework="pt") as f:
            return flux_checkpoint.layout_of(f.keys()) is not None
    except Exception:  # noqa: BLE001 - not a readable safetensors file: not a FLUX one either
        return False


def load_flux(name_or_path: str, *, clip_l: str | None = None, t5xxl: str | None = None, ae: str | None = None,
              dtype: torch.dtype = torch.float32, t5_tokenizer: str | None = None) -> FluxModel:
    """Load a FLUX.1 model from a built-in name, a BFL single file (+ clip_l, t5xxl, ae) or a
    diffusers folder (whose components clip_l / t5xxl / ae replace when given)."""
    with quiet_progress():
        path = os.path.expanduser(name_or_path)
        if name_or_path in tiny_flux.TINY_FLUX_NAMES:
            if not os.path.exists(path):
                return _builtin(name_or_path, clip_l, t5xxl, ae, dtype)
            logger.warning("pretrained_model_name_or_path: %s is an existing path; using it instead of the "
                           "built-in model of the same name", name_or_path)
        if not os.path.exists(path):
            raise ModelError(f"pretrained_model_name_or_path: no such file or directory: {name_or_path}")
        if os.path.isdir(path):
            return _folder(path, clip_l, t5xxl, ae, dtype, t5_tokenizer)
        return _single_file(path, clip_l, t5xxl, ae, dtype, t5_tokenizer)


def _builtin(name: str, clip_l, t5xxl, ae, dtype: torch.dtype) -> FluxModel:
    """A built-in model; ``clip_l`` / ``t5xxl`` / ``ae`` files replace its components when given
    (as for a diffusers folder)."""
    variant = tiny_flux.TINY_FLUX_NAMES[name]
    c = tiny_flux.build_tiny_flux(variant)
    for k in ("transformer", "clip_l", "t5", "ae"):
        # nn.Module.to directly: diffusers' override only adds a warning about fp32-kept modules (none here)
        c[k] = torch.nn.Module.to(c[k], dtype)
    ident = f"builtin:{name}:{tiny_flux.SEED}"
    ae_ident = ident + ":ae"
    if clip_l:
        c["clip_l"], c["clip_tokenizer"] = clip_l_file.load_clip_l(os.path.expanduser(clip_l), dtype)
    if t5xxl:
        c["t5"], tok = t5.load_t5(os.path.expanduser(t5xxl), dtype)
        c["t5_tokenizer"] = tok or c["t5_tokenizer"]
    if ae:
        c["ae"], ae_ident = flux_ae.load_ae(os.path.expanduser(ae), dtype), path_identity(os.path.expanduser(ae))
    return FluxModel(variant, "bfl", c["transformer"].config, c["transformer"], c["clip_l"], c["t5"], c["ae"],
                     c["clip_tokenizer"], c["t5_tokenizer"], t5.T5_MAX_LENGTH[variant], ident, ae_ident)


def _single_file(path, clip_l, t5xxl, ae, dtype, t5_tokenizer) -> FluxModel:
    for opt, value in (("clip_l", clip_l), ("t5xxl", t5xxl), ("ae", ae)):
        if not value:
            raise ModelError(f"{opt}: required with a single-file FLUX.1 transformer ({path}); give the {opt} file")
        if not os.path.exists(os.path.expanduser(value)):
            raise ModelError(f"{opt}: no such file or directory: {value}")
    model, w = flux_checkpoint.load_transformer(path, dtype)
    te, clip_tok = clip_l_file.load_clip_l(os.path.expanduser(clip_l), dtype)
    t5_model, t5_tok = t5.load_t5(os.path.expanduser(t5xxl), dtype)
    if t5_tokenizer or t5_tok is None:
        t5_tok = t5.load_t5_tokenizer(t5_tokenizer)
    vae = flux_ae.load_ae(os.path.expanduser(ae), dtype)
    return FluxModel(w.variant, w.layout, w.config, model, te, t5_model, vae, clip_tok, t5_tok,
                     t5.T5_MAX_LENGTH[w.variant], path_identity(path), path_identity(os.path.expanduser(ae)))


def _folder(folder, clip_l, t5xxl, ae, dtype, t5_tokenizer) -> FluxModel:
    if not os.path.isfile(os.path.join(folder, "transformer", "config.json")):
        raise ModelError(f"{folder}: not a diffusers FLUX folder (no transformer/config.json)")
    model, w = flux_checkpoint.load_transformer(folder, dtype)

    def sub(cls, name, **kw):
        try:
            return cls.from_pretrained(folder, subfolder=name, local_files_only=True, **kw)
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelError(f"{folder}: cannot load the diffusers FLUX folder ({name}): {first_line(e)}") from None

    if clip_l:
        te, clip_tok = clip_l_file.load_clip_l(os.path.expanduser(clip_l), dtype)
    else:
        te, clip_tok = sub(CLIPTextModel, "text_encoder", dtype=dtype).eval(), sub(CLIPTokenizer, "tokenizer")
    if t5xxl:
        t5_model, t5_tok = t5.load_t5(os.path.expanduser(t5xxl), dtype)
    else:
        t5_model, t5_tok = sub(T5EncoderModel, "text_encoder_2", dtype=dtype).eval(), None
    if t5_tokenizer:
        t5_tok = t5.load_t5_tokenizer(t5_tokenizer)
    elif os.path.isdir(os.path.join(folder, "tokenizer_2")):
        t5_tok = sub(T5Tokenizer, "tokenizer_2")
    elif t5_tok is None:
        t5_tok = t5.load_t5_tokenizer(None)
    ae_src = os.path.expanduser(ae) if ae else folder
    vae = flux_ae.load_ae(ae_src, dtype)
    ae_ident = path_identity(ae_src if ae else os.path.join(folder, "vae"))
    return FluxModel(w.variant, w.layout, w.config, model, te, t5_model, vae, clip_tok, t5_tok,
                     t5.T5_MAX_LENGTH[w.variant], path_identity(folder), ae_ident)
