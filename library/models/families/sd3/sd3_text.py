"""SD3's text conditioning, with sd-scripts' semantics (`strategy_sd3`, `sd3_utils`).

Three encoders: CLIP-L and CLIP-G (transformers CLIPTextModelWithProjection) and T5-XXL.
- token states: CLIP-L's and CLIP-G's penultimate hidden states (77 tokens each) side by side on
  the feature axis (768 + 1280 = 2048), zero-padded to T5's width (4096), then the T5 states after
  them on the token axis: (B, 77 + n_t5, 4096). Without T5, 77 zero tokens stand in for it.
- pooled: CLIP-L's pooled output and CLIP-G's projected pooled output side by side (2048). SAI's
  CLIP-L has no projection: its loader gives it an identity one (library/models/families/sd3/sd3_checkpoint).
- `apply_lg_attn_mask` / `apply_t5_attn_mask`: the tokenizer's attention mask (1 real token, 0
  padding) is passed to the CLIP / T5 encoders, so no token attends to padding (sd-scripts' current
  `encode_tokens`; its first SD3 version multiplied the states by the mask instead).
- dropout of one encoder (`clip_l_dropout_rate` etc., a training option): its states, pooled part
  and mask become zeros for the dropped samples (sd-scripts), or, here optionally, the encoding of
  the empty caption.

The T5 encoder is a parameter: any callable ``t5(input_ids, attention_mask_or_None)`` returning
(B, n, width) states (a tensor, a tuple whose first item is that tensor, or an object with
``last_hidden_state``), with a tokenizer called like a transformers one.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from transformers import CLIPTokenizer

from library.models.loading import SHIPPED_TOKENIZER

# SD3's CLIP encoders (sd-scripts' sd3_utils configs); SAI's CLIP-L has no projection (identity).
CLIP_L_CONFIG = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                     num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                     layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2, projection_dim=768)
CLIP_G_CONFIG = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                     num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu",
                     layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2, projection_dim=1280)

CLIP_LENGTH = 77  # both CLIP tokenizers pad / truncate to 77
ENCODERS = ("clip_l", "clip_g", "t5")


@dataclass(frozen=True)
class SD3Tokens:
    l_ids: torch.Tensor  # (B, 77)
    g_ids: torch.Tensor  # (B, 77)
    l_mask: torch.Tensor  # (B, 77), 1 = real token
    g_mask: torch.Tensor
    t5_ids: torch.Tensor | None = None  # (B, t5_max_length)
    t5_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class SD3TextEncoding:
    """What the text encoders give for a batch of captions, before the two are joined (what a
    text-encoder cache stores)."""
    lg_out: torch.Tensor  # (B, 77, width_l + width_g)
    lg_pooled: torch.Tensor  # (B, width_l + width_g)
    width_l: int  # CLIP-L's share of the feature axis
    t5_out: torch.Tensor | None = None  # (B, n, t5 width)
    l_mask: torch.Tensor | None = None
    g_mask: torch.Tensor | None = None
    t5_mask: torch.Tensor | None = None


def shipped_tokenizers():
    """CLIP-L and CLIP-G tokenizers from CLIP's shipped vocabulary (configs/tokenizers/clip); CLIP-G pads
    with "!" (id 0)."""
    return (CLIPTokenizer.from_pretrained(SHIPPED_TOKENIZER),
            CLIPTokenizer.from_pretrained(SHIPPED_TOKENIZER, pad_token="!"))


def tokenize(captions: str | Sequence[str], clip_l_tokenizer, clip_g_tokenizer, t5_tokenizer=None,
             t5_max_length: int = 256) -> SD3Tokens:
    """sd-scripts' Sd3TokenizeStrategy: each tokenizer pads and truncates to its length (77 for
    CLIP; t5xxl_max_token_length for T5). CLIP-G's padding id is 0 ("!"), set on its tokenizer."""
    texts = [captions] if isinstance(captions, str) else list(captions)

    def run(tok, length):
        out = tok(texts, max_length=length, padding="max_length", truncation=True, return_tensors="pt")
        return out["input_ids"], out["attention_mask"]

    l_ids, l_mask = run(clip_l_tokenizer, CLIP_LENGTH)
    g_ids, g_mask = run(clip_g_tokenizer, CLIP_LENGTH)
    t5_ids = t5_mask = None
    if t5_tokenizer is not None:
        t5_ids, t5_mask = run(t5_tokenizer, t5_max_length)
    return SD3Tokens(l_ids, g_ids, l_mask, g_mask, t5_ids, t5_mask)


def _states(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return out[0]


def _device_of(encoder, default: torch.device) -> torch.device:
    if isinstance(encoder, torch.nn.Module):
        return next(iter(encoder.parameters()), torch.empty(0, device=default)).device
    return getattr(encoder, "device", default)


def _clip(model, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    device = model.device
    out = model(ids.to(device), mask.to(device) if mask is not None else None, output_hidden_states=True)
    return out.hidden_states[-2], out[0]  # penultimate states, (projected) pooled


def encode(tokens: SD3Tokens, clip_l, clip_g, t5: Callable | None = None, *, apply_lg_attn_mask: bool = False,
           apply_t5_attn_mask: bool = False) -> SD3TextEncoding:
    """Run the encoders on ``tokens``; T5 only when both ``t5`` and T5 tokens are given."""
    l_out, l_pooled = _clip(clip_l, tokens.l_ids, tokens.l_mask if apply_lg_attn_mask else None)
    g_out, g_pooled = _clip(clip_g, tokens.g_ids, tokens.g_mask if apply_lg_attn_mask else None)
    t5_out = encode_t5(tokens, t5, apply_t5_attn_mask=apply_t5_attn_mask)
    g_out, g_pooled = g_out.to(l_out.device), g_pooled.to(l_out.device)
    return SD3TextEncoding(lg_out=torch.cat([l_out, g_out], dim=-1), lg_pooled=torch.cat([l_pooled, g_pooled], dim=-1),
                           width_l=l_out.shape[-1], t5_out=t5_out, l_mask=tokens.l_mask, g_mask=tokens.g_mask,
                           t5_mask=tokens.t5_mask if t5_out is not None else None)


def encode_t5(tokens: SD3Tokens, t5: Callable | None, *, apply_t5_attn_mask: bool = False) -> torch.Tensor | None:
    """T5's states (B, n, width) of ``tokens``; None without a T5 encoder or T5 tokens."""
    if t5 is None or tokens.t5_ids is None:
        return None
    device = _device_of(t5, tokens.t5_ids.device)
    mask = tokens.t5_mask.to(device) if apply_t5_attn_mask and tokens.t5_mask is not None else None
    return _states(t5(tokens.t5_ids.to(device), mask))


def t5_tokens_part(t5_out: torch.Tensor | None, batch: int, context_dim: int, device, dtype) -> torch.Tensor:
    """The context's tokens after CLIP's 77: T5's states, or 77 zero tokens without T5."""
    if t5_out is None:
        return torch.zeros(batch, CLIP_LENGTH, context_dim, device=device, dtype=dtype)
    if t5_out.shape[-1] != context_dim:
        raise ValueError(f"T5 states are {t5_out.shape[-1]} wide; the model's context width is {context_dim}")
    return t5_out


def condition(enc: SD3TextEncoding, context_dim: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(context, pooled) for the MMDiT: CLIP states padded to ``context_dim`` (the model's
    context_embedder input, T5's width), then the T5 states, or 77 zero tokens without T5."""
    lg = enc.lg_out
    if lg.shape[-1] > context_dim:
        raise ValueError(f"CLIP states are {lg.shape[-1]} wide, more than the context width {context_dim}")
    lg = torch.nn.functional.pad(lg, (0, context_dim - lg.shape[-1]))
    t5 = t5_tokens_part(enc.t5_out, lg.shape[0], context_dim, lg.device, lg.dtype)
    return torch.cat([lg, t5.to(lg.dtype)], dim=-2), enc.lg_pooled


def drop_encoder(enc: SD3TextEncoding, which: str, rows: Sequence[int] | torch.Tensor,
                 empty: SD3TextEncoding | None = None) -> SD3TextEncoding:
    """``enc`` with encoder ``which`` (clip_l, clip_g or t5) dropped for the samples ``rows``
    (indices or a boolean mask over the batch): its states, its part of the pooled vector and its
    mask zero (sd-scripts' `drop_cached_text_encoder_outputs`), or with ``empty`` (the encoding of
    the empty caption, batch 1) that encoder's part of the empty caption's encoding instead."""
    if which not in ENCODERS:
        raise ValueError(f"which: {which!r}; expected one of {', '.join(ENCODERS)}")
    device = enc.lg_out.device
    rows = torch.as_tensor(rows)
    if rows.dtype == torch.bool:
        sel = rows.to(device)
    else:
        sel = torch.zeros(enc.lg_out.shape[0], dtype=torch.bool, device=device)
        sel[rows.long().to(device)] = True

    def put(x: torch.Tensor | None, src: torch.Tensor | None, feat: slice | None = None):
        if x is None:
            return None
        x = x.clone()
        index = (sel,) if feat is None else (sel, Ellipsis, feat)
        # src is a batch of one: it broadcasts over the selected rows
        x[index] = 0 if src is None else (src if feat is None else src[..., feat]).to(x)
        return x

    if which == "t5":
        if enc.t5_out is None:
            return enc
        return replace(enc, t5_out=put(enc.t5_out, empty.t5_out if empty else None),
                       t5_mask=put(enc.t5_mask, empty.t5_mask if empty else None))
    feat = slice(0, enc.width_l) if which == "clip_l" else slice(enc.width_l, None)
    mask_name = "l_mask" if which == "clip_l" else "g_mask"
    return replace(enc, lg_out=put(enc.lg_out, empty.lg_out if empty else None, feat),
                   lg_pooled=put(enc.lg_pooled, empty.lg_pooled if empty else None, feat),
                   **{mask_name: put(getattr(enc, mask_name), getattr(empty, mask_name) if empty else None)})
