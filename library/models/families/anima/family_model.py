"""Anima's family model and loader: sd-scripts' AnimaTokenizeStrategy / AnimaTextEncodingStrategy
and the DiT call of anima_train_network.py.

    tokenize(captions) -> [Qwen3 ids, Qwen3 mask (qwen3_max_token_length), T5 ids, T5 mask (t5_max_token_length)]
    encode(ids)        -> AnimaTextConditioning: Qwen3's last states zeroed at its padding, the masks, the T5 ids
    unet_forward       -> the DiT on (B, 16, H, W) latents at sigma, the LLM adapter run inside the forward

Qwen3 is always frozen (sd-scripts trains neither it nor T5, which Anima does not run: only T5's
tokenizer feeds the adapter), so a text-encoder cache holds everything ``encode`` returns.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from library.models import loading
from library.models.families.anima import parts, tiny, weights
from library.models.family import FamilyModel, TextConditioning

QWEN3_MAX_LENGTH = 512  # sd-scripts' qwen3_max_token_length default
T5_MAX_LENGTH = 512     # sd-scripts' t5_max_token_length default


@dataclass
class AnimaTextConditioning(TextConditioning):
    """Qwen3's states (hidden_states; pooled None), their mask, the T5 ids and mask of the adapter."""

    qwen3_attn_mask: Any = None
    t5_input_ids: Any = None
    t5_attn_mask: Any = None

    def to(self, *args, **kwargs) -> "AnimaTextConditioning":
        states = self.hidden_states.to(*args, **kwargs)
        dev = states.device
        return AnimaTextConditioning(states, None, self.qwen3_attn_mask.to(dev), self.t5_input_ids.to(dev),
                                     self.t5_attn_mask.to(dev))


class AnimaFamilyModel(FamilyModel):
    family = "anima"
    conditioning_type = AnimaTextConditioning

    def __init__(self, dit, text_encoders, tokenizers, *, qwen3_max_length: int | None = None,
                 t5_max_length: int | None = None, rewrite=None):
        super().__init__(dit, text_encoders, tokenizers, None, False, rewrite)
        self.qwen3_max_length = qwen3_max_length or QWEN3_MAX_LENGTH
        self.t5_max_length = t5_max_length or T5_MAX_LENGTH

    def tokenize(self, captions: list[str], pad: bool = True) -> list:
        if self.rewrite is not None:
            captions = [self.rewrite(c) for c in captions]
        q_tok, t_tok = self.tokenizers
        q = q_tok(list(captions), padding="max_length", max_length=self.qwen3_max_length, truncation=True,
                  return_tensors="pt")
        t = t_tok(list(captions), padding="max_length", max_length=self.t5_max_length, truncation=True,
                  return_tensors="pt")
        return [q["input_ids"], q["attention_mask"], t["input_ids"], t["attention_mask"]]

    def cache_identity(self, partial: bool = False) -> dict:
        return {"qwen3_max_length": self.qwen3_max_length, "t5_max_length": self.t5_max_length,
                "t5_vocab": len(self.tokenizers[1])}

    def encode(self, token_ids: list, clip_skip: int | None) -> AnimaTextConditioning:
        q_ids, q_mask, t_ids, t_mask = token_ids
        states = parts.encode_qwen3(self.text_encoders[0], q_ids, q_mask)
        dev = states.device
        return AnimaTextConditioning(states, None, q_mask.to(dev), t_ids.to(dev), t_mask.to(dev))

    def unet_forward(self, noisy_latents, timesteps, cond, size_cond=None, sample_seeds=None):
        dtype, dev = noisy_latents.dtype, noisy_latents.device
        return self.unet(noisy_latents, timesteps.to(dev, dtype), cond.hidden_states.to(dev, dtype),
                         cond.t5_input_ids.to(dev).long(), cond.t5_attn_mask.to(dev),
                         cond.qwen3_attn_mask.to(dev))


class LatentVAE(torch.nn.Module):
    """The Qwen-Image VAE behind the interface the shared latent code uses (``encode(pixels)
    .latent_dist.mode()``, ``decode(z).sample``, ``config.scaling_factor``): images (B, 3, H, W),
    latents (B, 16, H/8, W/8) already normalised per channel ((z - mean) / std, parts.encode_images),
    so the scale is 1 and there is no shift."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae
        self.config = SimpleNamespace(scaling_factor=1.0, latent_channels=vae.config.z_dim,
                                      block_out_channels=(0, 0, 0, 0))  # 8x down, as a 4-level SD VAE

    @property
    def device(self):
        return next(self.vae.parameters()).device

    @property
    def dtype(self):
        return next(self.vae.parameters()).dtype

    def encode(self, pixels):
        z = parts.encode_images(self.vae, pixels)
        return SimpleNamespace(latent_dist=SimpleNamespace(mode=lambda: z, sample=lambda generator=None: z))

    def decode(self, latents, return_dict: bool = True):
        x = parts.decode_latents(self.vae, latents)
        return SimpleNamespace(sample=x) if return_dict else (x,)


@dataclass
class AnimaModel:
    """The loaded parts (what ModelBundle.flow holds for Anima)."""
    dit: Any
    qwen3: Any
    vae: Any
    qwen3_tokenizer: Any
    t5_tokenizer: Any
    identity: str
    vae_identity: str
    variant: str = "preview"  # sd-scripts' Anima model is "anima-preview"
    layout: str = "single_file"  # a full fine-tune saves the released single file (home.save_full)


def is_source(name_or_path: str | None) -> bool:
    """An Anima DiT: tiny-anima, or a safetensors file whose keys are Anima's (no weight read)."""
    if not name_or_path:
        return False
    path = os.path.expanduser(str(name_or_path))
    if not os.path.exists(path):
        return name_or_path == tiny.NAME
    return os.path.isfile(path) and path.endswith(".safetensors") and weights.is_anima(weights.header_shapes(path))


def load_anima(src: str, *, qwen3: str | None, vae: str | None, llm_adapter_path: str | None = None,
               t5_tokenizer_path: str | None = None) -> AnimaModel:
    """The model of ``pretrained_model_name_or_path`` (an Anima DiT file, or tiny-anima, whose
    parts a given qwen3 / vae / t5_tokenizer_path replace)."""
    path = os.path.expanduser(str(src))
    if not os.path.exists(path) and src == tiny.NAME:
        if llm_adapter_path:
            raise weights.AnimaModelError("llm_adapter_path: tiny-anima has its adapter built in")
        m = tiny.build()
        ident = f"builtin:{src}"
        dit, q_model, q_tok, vae_model = m["dit"], m["qwen3"], m["qwen3_tokenizer"], m["vae"]
        t_tok = parts.load_t5_tokenizer(t5_tokenizer_path) if t5_tokenizer_path else m["t5_tokenizer"]
    else:
        for opt, value in (("qwen3", qwen3), ("vae", vae)):
            if not value:
                raise weights.AnimaModelError(f"{opt}: an Anima DiT file ({src}) needs its {opt} file")
        dit = weights.load_dit(path, llm_adapter_path)
        ident = loading.path_identity(path)
        q_model = q_tok = vae_model = None
        t_tok = parts.load_t5_tokenizer(t5_tokenizer_path)
    if qwen3:
        q_model, q_tok = parts.load_qwen3(qwen3)
    if vae:
        vae_model = parts.load_vae(vae)
    _check_widths(dit, q_model, t_tok, qwen3 or src, t5_tokenizer_path)
    vae_ident = loading.path_identity(os.path.expanduser(vae)) if vae else ident + ":vae"
    return AnimaModel(dit.eval(), q_model.eval(), vae_model.eval(), q_tok, t_tok, ident, vae_ident)


def _check_widths(dit, qwen3, t5_tokenizer, qwen3_source, t5_source) -> None:
    adapter = dit.config.adapter
    if qwen3.config.hidden_size != adapter.source_dim:
        raise weights.AnimaModelError(f"qwen3: {qwen3_source} is {qwen3.config.hidden_size} wide; the DiT's LLM "
                                      f"adapter reads {adapter.source_dim}-wide Qwen3 states")
    if len(t5_tokenizer) > adapter.vocab_size:
        raise weights.AnimaModelError(f"t5_tokenizer_path: {t5_source or 'T5'} has {len(t5_tokenizer)} tokens; the "
                                      f"LLM adapter embeds {adapter.vocab_size}")
