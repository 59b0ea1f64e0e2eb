"""Model-family adapters: how each family tokenizes, encodes text and calls its U-Net.

One class per family behind one interface, so the trainer never branches on the family:
    adapter = adapter_for(bundle)
    ids = adapter.tokenize(captions)                 # one (B, 77) LongTensor per tokenizer
    cond = adapter.encode(ids, clip_skip)            # TextConditioning(hidden_states, pooled)
    pred = adapter.unet_forward(noisy, t, cond, size_cond)
Text encoding follows sd-scripts exactly (clip_skip, SDXL's penultimate layers and pooled output).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from library.errors import UserError

MAX_TOKENS = 77


class FamilyError(UserError, ValueError):
    """Wrong input for a model family (e.g. SDXL without size conditioning); one-line message."""


@dataclass
class TextConditioning:
    hidden_states: Any  # (B, 77, D) U-Net cross-attention context
    pooled: Any = None  # (B, P) SDXL pooled text embedding, else None

    def to(self, *args, **kwargs) -> "TextConditioning":
        return TextConditioning(self.hidden_states.to(*args, **kwargs),
                                None if self.pooled is None else self.pooled.to(*args, **kwargs))


def _final_layer_norm(text_encoder):
    # transformers >= 5.6 flattened CLIPTextModel; CLIPTextModelWithProjection keeps `text_model`.
    return getattr(text_encoder, "text_model", text_encoder).final_layer_norm


class FamilyAdapter:
    family = ""

    def __init__(self, unet, text_encoders: list, tokenizers: list):
        self.unet = unet
        self.text_encoders = list(text_encoders)
        self.tokenizers = list(tokenizers)

    def tokenize(self, captions: list[str]) -> list:
        """One (B, 77) LongTensor per tokenizer: BOS, tokens, EOS, padded, truncated to 77."""
        return [tok(list(captions), padding="max_length", max_length=MAX_TOKENS, truncation=True,
                    return_tensors="pt").input_ids for tok in self.tokenizers]

    def encode(self, token_ids: list, clip_skip: int | None) -> TextConditioning:
        raise NotImplementedError

    def unet_forward(self, noisy_latents, timesteps, cond: TextConditioning, size_cond=None):
        return self.unet(noisy_latents, timesteps, cond.hidden_states.to(noisy_latents.dtype)).sample

    def _device(self, te):
        return next(te.parameters()).device


class SD1Adapter(FamilyAdapter):
    """SD1.x / SD2.x: one CLIP text encoder; clip_skip takes hidden_states[-clip_skip] through the
    final layer norm (sd-scripts); None or 1 is the plain last layer."""
    family = "sd1"

    def encode(self, token_ids: list, clip_skip: int | None) -> TextConditioning:
        te = self.text_encoders[0]
        ids = token_ids[0].to(self._device(te))
        if clip_skip is None or clip_skip <= 1:
            return TextConditioning(te(ids).last_hidden_state)
        if clip_skip > te.config.num_hidden_layers:
            raise FamilyError(f"clip_skip: {clip_skip} exceeds the text encoder's "
                              f"{te.config.num_hidden_layers} layers")
        out = te(ids, output_hidden_states=True)
        return TextConditioning(_final_layer_norm(te)(out.hidden_states[-clip_skip]))


class SD2Adapter(SD1Adapter):
    family = "sd2"


class SDXLAdapter(FamilyAdapter):
    """SDXL: both encoders' penultimate hidden states (no final norm) concatenated; pooled output
    from text_encoder_2's projection; the U-Net also takes (B, 6) size conditioning.
    clip_skip does not apply (the penultimate layer is fixed by the architecture), as in sd-scripts."""
    family = "sdxl"

    def encode(self, token_ids: list, clip_skip: int | None) -> TextConditioning:
        import torch

        te1, te2 = self.text_encoders
        out1 = te1(token_ids[0].to(self._device(te1)), output_hidden_states=True)
        out2 = te2(token_ids[1].to(self._device(te2)), output_hidden_states=True)
        hidden = torch.cat([out1.hidden_states[-2], out2.hidden_states[-2].to(out1.hidden_states[-2].dtype)], dim=-1)
        return TextConditioning(hidden, out2.text_embeds)

    def unet_forward(self, noisy_latents, timesteps, cond: TextConditioning, size_cond=None):
        if size_cond is None:
            raise FamilyError("SDXL needs size conditioning (original size, crop top-left, target size)")
        if cond.pooled is None:
            raise FamilyError("SDXL needs the pooled text embedding of text_encoder_2")
        if tuple(size_cond.shape) != (noisy_latents.shape[0], 6):
            raise FamilyError(f"size_cond must have shape ({noisy_latents.shape[0]}, 6), got {tuple(size_cond.shape)}")
        dtype = noisy_latents.dtype
        added = {"text_embeds": cond.pooled.to(dtype), "time_ids": size_cond.to(noisy_latents.device, dtype)}
        return self.unet(noisy_latents, timesteps, cond.hidden_states.to(dtype), added_cond_kwargs=added).sample


_ADAPTERS = {"sd1": SD1Adapter, "sd2": SD2Adapter, "sdxl": SDXLAdapter}


def adapter_for(bundle) -> FamilyAdapter:
    """The adapter for a ModelBundle (anything with family, unet, text_encoders, tokenizers)."""
    try:
        cls = _ADAPTERS[bundle.family]
    except KeyError:
        raise FamilyError(f"unknown model family {bundle.family!r}; expected one of {sorted(_ADAPTERS)}") from None
    return cls(bundle.unet, bundle.text_encoders, bundle.tokenizers)
