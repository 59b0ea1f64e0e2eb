"""The built-in SD3 models, selectable by name.

Tiny (tests, CI, the quick start): `tiny-sd3` (SD3: no qk norm), `tiny-sd3.5-medium` (qk norm and
the extra self-attention in block 0), `tiny-sd3.5-large` (qk norm): a two-block MMDiT, the tiny
CLIP-L and CLIP-G of tiny-sdxl, a tiny 16-channel VAE and the tiny locally generated CLIP vocabulary.

Full size (memory and speed measurements): `sd3-arch`, `sd3.5-medium-arch`, `sd3.5-large-arch`: the
released architectures (library/models/families/sd3/sd3.py), SD3's CLIP-L, CLIP-G and VAE, CLIP's shipped
tokenizer.

All random weights from fixed seeds (two builds are bit-identical), CLIP as
CLIPTextModelWithProjection with CLIP-L's projection the identity (SAI's CLIP-L has none). The tiny
models have a tiny T5 (t5.build_tiny_t5) as wide as their MMDiT's context (as T5-XXL's 4096 is
SD3's) with its offline tokenizer; the full-size ones leave the T5 slot empty (T5-XXL alone is
4.7 billion parameters; the conditioning then has 77 zero tokens, sd-scripts without t5xxl).
"""
from __future__ import annotations

import tempfile

import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

from library.models import t5
from library.models.families.sd_common import tiny_models
from library.models.families.sd3 import sd3, sd3_text, sd3_vae

NAMES = {"tiny-sd3": "sd3", "tiny-sd3.5-medium": "sd3.5-medium", "tiny-sd3.5-large": "sd3.5-large"}
ARCH_NAMES = {"sd3-arch": sd3.SD3_MEDIUM, "sd3.5-medium-arch": sd3.SD35_MEDIUM, "sd3.5-large-arch": sd3.SD35_LARGE}
SEED = tiny_models.SEED + 300


def vae_config() -> dict:
    """The tiny VAE: four levels (8x downscale) at small widths, 16 latent channels."""
    return sd3_vae.vae_config(block_out_channels=(32, 32, 64, 64), layers_per_block=1)


def clip_configs() -> list[dict]:
    """The tiny CLIP-L and CLIP-G: tiny-sdxl's two text encoders."""
    return tiny_models.text_encoder_configs("sdxl")


def variant_of(name: str) -> str | None:
    if name in NAMES:
        return NAMES[name]
    return ARCH_NAMES[name].variant if name in ARCH_NAMES else None


def build_builtin(name: str, device: str | torch.device | None = None) -> dict:
    """Components of a built-in model: mmdit, clip_l, clip_g, vae, tokenizer_l, tokenizer_g (and
    for the tiny ones t5xxl, tokenizer_t5); ``device`` "meta" builds the shapes only (for counting
    parameters)."""
    if name in NAMES:
        mmdit_cfg, vae_cfg, clip_cfgs = sd3.tiny_config(NAMES[name]), vae_config(), clip_configs()
    elif name in ARCH_NAMES:
        mmdit_cfg, vae_cfg = ARCH_NAMES[name], sd3_vae.vae_config()
        clip_cfgs = [sd3_text.CLIP_L_CONFIG, sd3_text.CLIP_G_CONFIG]
    else:
        raise ValueError(f"unknown built-in SD3 model {name!r}; expected one of {', '.join([*NAMES, *ARCH_NAMES])}")
    out: dict = {}
    with torch.random.fork_rng(devices=[]), torch.device(device or "cpu"):
        torch.manual_seed(SEED)
        out["mmdit"] = sd3.build_mmdit(mmdit_cfg).eval()
        torch.manual_seed(SEED + 1)
        out["vae"] = AutoencoderKL.from_config(vae_cfg).eval()
        for i, (key, cfg) in enumerate(zip(("clip_l", "clip_g"), clip_cfgs)):
            torch.manual_seed(SEED + 2 + i)
            out[key] = CLIPTextModelWithProjection(CLIPTextConfig(**cfg)).eval()
        with torch.no_grad():
            out["clip_l"].text_projection.weight.copy_(torch.eye(out["clip_l"].config.hidden_size))
    if name in ARCH_NAMES:
        out["tokenizer_l"], out["tokenizer_g"] = sd3_text.shipped_tokenizers()
        return out
    with torch.device(device or "cpu"):
        out["t5xxl"], out["tokenizer_t5"] = t5.build_tiny_t5(mmdit_cfg.context_dim)
    with tempfile.TemporaryDirectory() as tmp:
        tiny_models.write_tokenizer(tmp)
        out["tokenizer_l"] = CLIPTokenizer.from_pretrained(tmp)
        out["tokenizer_g"] = CLIPTokenizer.from_pretrained(tmp, pad_token="!")  # CLIP-G pads with id 0
    return out
