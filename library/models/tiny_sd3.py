"""The built-in tiny SD3 models: `tiny-sd3` (SD3: no qk norm), `tiny-sd3.5-medium` (qk norm and the
extra self-attention in block 0), `tiny-sd3.5-large` (qk norm). Random weights from fixed seeds (two
builds are bit-identical): a two-block MMDiT, the tiny CLIP-L and CLIP-G of tiny-sdxl (as
CLIPTextModelWithProjection; CLIP-L's projection the identity, as SAI's CLIP-L has none), a tiny
16-channel VAE, and the tiny locally generated CLIP vocabulary. The T5 slot is empty: its
conditioning is then 77 zero tokens (sd-scripts without t5xxl)."""
from __future__ import annotations

import tempfile

import torch

from library.models import sd3, sd3_vae, tiny_models

NAMES = {"tiny-sd3": "sd3", "tiny-sd3.5-medium": "sd3.5-medium", "tiny-sd3.5-large": "sd3.5-large"}
SEED = tiny_models.SEED + 300


def vae_config() -> dict:
    return sd3_vae.vae_config(block_out_channels=(32, 32, 64, 64), layers_per_block=1)


def clip_configs() -> list[dict]:
    """CLIP-L and CLIP-G configs: tiny-sdxl's two text encoders."""
    return tiny_models.text_encoder_configs("sdxl")


def build_tiny_sd3(name: str = "tiny-sd3") -> dict:
    """Components of a tiny SD3 model: mmdit, clip_l, clip_g, vae, tokenizer_l, tokenizer_g."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    if name not in NAMES:
        raise ValueError(f"unknown tiny SD3 model {name!r}; expected one of {', '.join(NAMES)}")
    out: dict = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        out["mmdit"] = sd3.build_mmdit(sd3.tiny_config(NAMES[name])).eval()
        torch.manual_seed(SEED + 1)
        out["vae"] = AutoencoderKL.from_config(vae_config()).eval()
        for i, (key, cfg) in enumerate(zip(("clip_l", "clip_g"), clip_configs())):
            torch.manual_seed(SEED + 2 + i)
            out[key] = CLIPTextModelWithProjection(CLIPTextConfig(**cfg)).eval()
    with torch.no_grad():
        out["clip_l"].text_projection.weight.copy_(torch.eye(out["clip_l"].config.hidden_size))
    with tempfile.TemporaryDirectory() as tmp:
        tiny_models.write_tokenizer(tmp)
        out["tokenizer_l"] = CLIPTokenizer.from_pretrained(tmp)
        out["tokenizer_g"] = CLIPTokenizer.from_pretrained(tmp, pad_token="!")  # CLIP-G pads with id 0
    return out
