"""A whole Chroma model (transformer, T5-XXL, FLUX.1's autoencoder, T5 tokenizer) from the sources
users have, and the built-in ``tiny-chroma``:

- a single transformer file in the original layout (``Chroma1-HD.safetensors``, fp8-stored too,
  also with ComfyUI's ``model.diffusion_model.`` prefix) with separate ``t5xxl`` and ``ae`` files
  (sd-scripts' flux_train_network.py --model_type chroma; Chroma has no CLIP-L);
- a diffusers ``ChromaPipeline`` folder (``transformer/``, ``text_encoder/``, ``tokenizer/``,
  ``vae/``), whose parts the ``t5xxl`` / ``ae`` files replace when given;
- ``tiny-chroma``: model.TINY_CHROMA, the tiny T5 (t5.build_tiny_t5, width 32) with its offline
  tokenizer and the tiny 16-channel autoencoder, every part from a fixed seed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import T5EncoderModel, T5TokenizerFast

from library.errors import ModelError, first_line
from library.models import t5
from library.models.families.flux import flux_ae
from library.models.families.chroma import checkpoint
from library.models.families.chroma.model import TINY_CHROMA, Chroma, ChromaConfig
from library.models.loading import path_identity, quiet_progress

TINY_NAMES = ("tiny-chroma",)
SEED = 20251207
T5_MAX_LENGTH = 512  # sd-scripts' t5xxl_max_token_length default for Chroma (not schnell); diffusers' too
VARIANT = "chroma"   # sd-scripts' model_version / modelspec name (Chroma1-Base and -HD alike)


@dataclass
class ChromaModel:
    layout: str       # the transformer's source layout, "original" or "diffusers": saved back in it
    config: ChromaConfig
    transformer: Chroma
    t5: Any           # transformers T5EncoderModel
    ae: Any           # diffusers AutoencoderKL, 16 latent channels (FLUX.1's)
    t5_tokenizer: Any
    identity: str     # cache key of the transformer source
    ae_identity: str
    variant: str = VARIANT
    t5_max_length: int = T5_MAX_LENGTH


def build_tiny() -> dict:
    """The parts of tiny-chroma: transformer, t5, t5_tokenizer, ae."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = Chroma(TINY_CHROMA).eval()
    model, tok = t5.build_tiny_t5()
    return {"transformer": transformer, "t5": model, "t5_tokenizer": tok,
            "ae": flux_ae.build_ae(flux_ae.TINY_AE_CONFIG, seed=SEED + 2)}


def load_chroma(name_or_path: str, *, t5xxl: str | None = None, ae: str | None = None,
                dtype: torch.dtype = torch.float32) -> ChromaModel:
    with quiet_progress():
        path = os.path.expanduser(name_or_path)
        if name_or_path in TINY_NAMES and not os.path.exists(path):
            return _builtin(name_or_path, t5xxl, ae, dtype)
        if not os.path.exists(path):
            raise ModelError(f"pretrained_model_name_or_path: no such file or directory: {name_or_path}")
        if os.path.isdir(path):
            return _folder(path, t5xxl, ae, dtype)
        return _single_file(path, t5xxl, ae, dtype)


def _t5_file(t5xxl: str, dtype):
    model, tok = t5.load_t5(os.path.expanduser(t5xxl), dtype)
    return model, tok or t5.load_t5_tokenizer(None)


def _builtin(name: str, t5xxl, ae, dtype) -> ChromaModel:
    c = build_tiny()
    for k in ("transformer", "t5", "ae"):
        c[k] = torch.nn.Module.to(c[k], dtype)
    ident = f"builtin:{name}:{SEED}"
    ae_ident = ident + ":ae"
    if t5xxl:
        c["t5"], c["t5_tokenizer"] = _t5_file(t5xxl, dtype)
    if ae:
        c["ae"], ae_ident = flux_ae.load_ae(os.path.expanduser(ae), dtype), path_identity(os.path.expanduser(ae))
    return ChromaModel("original", TINY_CHROMA, c["transformer"], c["t5"], c["ae"], c["t5_tokenizer"], ident, ae_ident)


def _single_file(path, t5xxl, ae, dtype) -> ChromaModel:
    for opt, value in (("t5xxl", t5xxl), ("ae", ae)):
        if not value:
            raise ModelError(f"{opt}: required with a single-file Chroma transformer ({path}); give the {opt} file")
        if not os.path.exists(os.path.expanduser(value)):
            raise ModelError(f"{opt}: no such file or directory: {value}")
    w = checkpoint.read_transformer(path, dtype)
    model = checkpoint.build(w)
    t5_model, tok = _t5_file(t5xxl, dtype)
    vae = flux_ae.load_ae(os.path.expanduser(ae), dtype)
    return ChromaModel(w.layout, w.config, model, t5_model, vae, tok, path_identity(path),
                       path_identity(os.path.expanduser(ae)))


def _folder(folder, t5xxl, ae, dtype) -> ChromaModel:
    w = checkpoint.read_transformer(folder, dtype)
    model = checkpoint.build(w)

    def sub(cls, name, **kw):
        try:
            return cls.from_pretrained(folder, subfolder=name, local_files_only=True, **kw)
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelError(f"{folder}: cannot load the diffusers Chroma folder ({name}): {first_line(e)}") from None

    if t5xxl:
        t5_model, tok = _t5_file(t5xxl, dtype)
    else:
        t5_model = sub(T5EncoderModel, "text_encoder", torch_dtype=dtype).eval()
        has_tok = os.path.isdir(os.path.join(folder, "tokenizer"))  # ChromaPipeline's T5TokenizerFast
        tok = sub(T5TokenizerFast, "tokenizer") if has_tok else t5.load_t5_tokenizer(None)
    ae_src = os.path.expanduser(ae) if ae else folder
    vae = flux_ae.load_ae(ae_src, dtype)
    return ChromaModel("diffusers", w.config, model, t5_model, vae, tok, path_identity(folder),
                       path_identity(ae_src if ae else os.path.join(folder, "vae")))
