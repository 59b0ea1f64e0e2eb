"""The built-in tiny FLUX.1 models: ``tiny-flux`` (dev: guidance input) and ``tiny-flux-schnell``.

The real topology at small widths: the transformer of flux.TINY_FLUX_DEV / TINY_FLUX_SCHNELL
(2 double and 2 single blocks, hidden 64, 2 heads, RoPE axes 8/12/12), the tiny SD1.5 CLIP text
encoder as CLIP-L (tiny_models, pooled width 32), a tiny T5 (t5.build_tiny_t5, width 32) with its
offline tokenizer, and a tiny 16-channel autoencoder. Every part comes from a fixed seed, so two
builds are bit-identical.
"""
from __future__ import annotations

import tempfile

import torch
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from library.models import t5
from library.models.families.sd_common import tiny_models
from library.models.families.flux import flux, flux_ae

TINY_FLUX_NAMES = {"tiny-flux": "dev", "tiny-flux-schnell": "schnell"}
SEED = 20240604
CONFIG_OF_VARIANT = {"dev": flux.TINY_FLUX_DEV, "schnell": flux.TINY_FLUX_SCHNELL}


def build_tiny_flux(variant: str) -> dict:
    """The parts of a tiny FLUX.1 model: transformer, clip_l, t5, ae, clip_tokenizer, t5_tokenizer."""
    if variant not in CONFIG_OF_VARIANT:
        raise ValueError(f"unknown FLUX variant {variant!r}; expected dev or schnell")
    out = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        out["transformer"] = flux.Flux(CONFIG_OF_VARIANT[variant]).eval()
        torch.manual_seed(SEED + 1)
        out["clip_l"] = CLIPTextModel(CLIPTextConfig(**tiny_models.text_encoder_configs("sd15")[0])).eval()
    out["ae"] = flux_ae.build_ae(flux_ae.TINY_AE_CONFIG, seed=SEED + 2)
    out["t5"], out["t5_tokenizer"] = t5.build_tiny_t5()
    with tempfile.TemporaryDirectory() as tmp:
        tiny_models.write_tokenizer(tmp)
        out["clip_tokenizer"] = CLIPTokenizer.from_pretrained(tmp)
    return out
