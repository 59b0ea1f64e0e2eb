"""FLUX.1's prompt conditioning, as sd-scripts' FluxTokenizeStrategy / FluxTextEncodingStrategy
compute it: CLIP-L's pooled output (the transformer's vector input) from prompts padded to 77
tokens, and T5's hidden states (its text tokens) from prompts padded to ``t5xxl_max_token_length``,
with all-zero text position ids and the T5 attention mask. ``apply_t5_attn_mask`` passes that mask
to T5 here and (by the caller) to the transformer's attention; without it T5 sees the padding, as
diffusers' FluxPipeline.encode_prompt does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from library.models import t5
from library.models.families.flux.flux import text_ids

CLIP_MAX_LENGTH = 77


@dataclass
class FluxTokens:
    clip_ids: torch.Tensor  # (B, 77)
    t5_ids: torch.Tensor  # (B, t5 max length)
    t5_attn_mask: torch.Tensor  # (B, t5 max length), 1 = a real token or </s>


@dataclass
class FluxConditioning:
    l_pooled: torch.Tensor  # (B, CLIP-L width): the transformer's y
    t5_out: torch.Tensor  # (B, L, T5 width): the transformer's txt
    txt_ids: torch.Tensor  # (B, L, 3), zeros
    t5_attn_mask: torch.Tensor  # (B, L): the transformer's txt_attention_mask when apply_t5_attn_mask


def tokenize(clip_tokenizer, t5_tokenizer, prompts: list[str], t5_max_length: int) -> FluxTokens:
    clip = clip_tokenizer(list(prompts), max_length=CLIP_MAX_LENGTH, padding="max_length", truncation=True,
                          return_tensors="pt")
    t5_ids, t5_mask = t5.tokenize(t5_tokenizer, prompts, t5_max_length)
    return FluxTokens(clip["input_ids"], t5_ids, t5_mask)


def clip_pooled(clip_l, clip_ids: torch.Tensor) -> torch.Tensor:
    """CLIP-L's pooled output (B, width): the transformer's y."""
    return clip_l(clip_ids.to(clip_l.device)).pooler_output


def encode(clip_l, t5_model, tokens: FluxTokens, apply_t5_attn_mask: bool) -> FluxConditioning:
    l_pooled = clip_pooled(clip_l, tokens.clip_ids)
    t5_out = t5.encode(t5_model, tokens.t5_ids, tokens.t5_attn_mask, apply_t5_attn_mask)
    return FluxConditioning(l_pooled, t5_out, text_ids(t5_out.shape[1], t5_out.shape[0], t5_out.device),
                            tokens.t5_attn_mask.to(t5_out.device))
