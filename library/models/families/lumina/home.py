"""Lumina 2's hooks (docs/FAMILIES.md "The hooks a home provides"): detection before loading, the
checks of its parts (the optional ``check_sources``), the model bundle over a LuminaModel, the
family model (tokenize with the system prompt, encode with Gemma-2, the transformer's forward in the
shared flow convention), the full save, metadata; the memory estimate has no Lumina fakes yet (its
hooks say "not available" in one line, library/models/fake_parts.py's Unavailable).

The shared losses and sampler (library/training/flow_matching.py) speak FLUX.1's convention: the
timestep input is sigma (FlowSpec.timestep_scale 1) and the model predicts d x / d sigma =
noise - x0. Lumina's transformer takes t = 1 - sigma and predicts d x / d t = x0 - noise, so
``unet_forward`` hands it 1 - sigma and negates its output. Consequences, by model_prediction_type:
raw compares output with x0 - noise, exactly sd-scripts' Lumina loss; sigma_scaled compares the
clean latent the velocity implies (x_t + sigma output) with x0 (sd-scripts' Lumina formula reuses
FLUX.1's x_t - sigma output against x0 - noise, which has no consistent minimiser);
additive is FLUX.1's formula on the negated output.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from library.models.loading import ModelBundle
from library.models.fake_parts import Unavailable
from library.models.families.lumina import attention, loading, text, tiny
from library.models.family import FamilyModel, TextConditioning

BUILTIN_NAMES = tiny.TINY_NAMES
IMPLEMENTATION = "https://github.com/Alpha-VLLM/Lumina-Image-2.0"  # sd-scripts' IMPL_LUMINA


@dataclass
class LuminaTextConditioning(TextConditioning):
    """Gemma-2's penultimate states (hidden_states) and the token mask (1 = token)."""

    mask: Any = None

    def to(self, *args, **kwargs) -> "LuminaTextConditioning":
        return LuminaTextConditioning(self.hidden_states.to(*args, **kwargs), None, self.mask)


class LuminaFamilyModel(FamilyModel):
    """tokenize -> [ids (B, L), mask (B, L)] of the caption behind the system prompt; encode ->
    Gemma-2's penultimate states and the mask; unet_forward -> - NextDiT(x, 1 - sigma, states, mask)."""

    family = "lumina"
    conditioning_type = LuminaTextConditioning

    def __init__(self, transformer, text_encoders, tokenizers, *, max_length: int = text.MAX_LENGTH,
                 system_prompt: str = "", rewrite=None):
        super().__init__(transformer, text_encoders, tokenizers, None, False, rewrite)
        self.gemma2_max_length = max_length
        self.system_prompt = system_prompt or ""

    def tokenize(self, captions: list[str], pad: bool = True) -> list:
        if self.rewrite is not None:
            captions = [self.rewrite(c) for c in captions]
        texts = [text.with_system_prompt(c, self.system_prompt) for c in captions]
        ids, mask = text.tokenize(self.tokenizers[0], texts, self.gemma2_max_length)
        return [ids, mask]

    negative_system_prompt = False  # lumina_minimal_inference's --add_system_prompt_to_negative_prompt

    def for_negative_prompts(self) -> "LuminaFamilyModel":
        """sd-scripts tokenizes a sample's negative prompt without the system prompt (is_negative),
        unless ``negative_system_prompt`` is set."""
        if self.negative_system_prompt:
            return self
        plain = copy.copy(self)
        plain.system_prompt = ""
        return plain

    def cache_identity(self, partial: bool = False) -> dict:
        return {"gemma2_max_length": text.padded_length(self.gemma2_max_length), "system_prompt": self.system_prompt}

    def encode(self, token_ids: list, clip_skip: int | None) -> LuminaTextConditioning:
        ids, mask = token_ids
        states = text.encode(self.text_encoders[0], ids, mask)
        return LuminaTextConditioning(states, None, mask.to(states.device))

    def unet_forward(self, noisy_latents, timesteps, cond, size_cond=None, sample_seeds=None):
        dev, dtype = noisy_latents.device, noisy_latents.dtype
        t = 1 - timesteps.to(dev, torch.float32)
        out = self.unet(noisy_latents, t.to(dtype), cond.hidden_states.to(dev, dtype), cond.mask.to(dev))
        return -out


def family_model(bundle, opts, rewrite=None) -> LuminaFamilyModel:
    return LuminaFamilyModel(bundle.unet, bundle.text_encoders, bundle.tokenizers,
                             max_length=opts.gemma2_max_token_length or text.MAX_LENGTH,
                             system_prompt=opts.system_prompt or "", rewrite=rewrite)


def claims(path: str) -> bool:
    """Whether an existing file or folder holds a Lumina 2 transformer (keys or config; no weights read)."""
    return loading.is_lumina_source(path)


def check_sources(opts) -> None:
    """Before any weight loads: the transformer, gemma2 and ae headers, the attention kernel."""
    loading.check_sources(opts.pretrained_model_name_or_path, opts.gemma2, opts.ae)
    attention.check(opts.use_flash_attn, opts.use_sage_attn)


def load(opts) -> ModelBundle:
    """The run's ModelBundle over a LuminaModel, the attention kernel of use_flash_attn /
    use_sage_attn set."""
    m = loading.load_lumina(opts.pretrained_model_name_or_path, gemma2=opts.gemma2, ae=opts.ae)
    attention.set_kernel(m.transformer, attention.check(opts.use_flash_attn, opts.use_sage_attn))
    return ModelBundle(family="lumina", unet=m.transformer, vae=m.ae, text_encoders=[m.gemma2],
                       tokenizers=[m.tokenizer], noise_scheduler=None, v_parameterization=False,
                       source=str(opts.pretrained_model_name_or_path), identity=m.identity,
                       vae_identity=m.ae_identity, flow=m)


def save_full(bundle, path: str, dtype, metadata: dict, trained_encoders: tuple[str, ...] = ()) -> None:
    """The trained transformer alone, in its source's layout (sd-scripts' lumina_train.py trains
    and saves the transformer alone: no ``trained_encoders``)."""
    loading.save_transformer(path, bundle.flow, bundle.unet.state_dict(), metadata, dtype)


def metadata_fields(variant: str | None, adapter: str | None) -> dict[str, str]:
    """sd-scripts' Lumina 2 values (one variant, MODEL_VERSION_LUMINA_V2; no prediction_type)."""
    return {"ss_base_model_version": "lumina2", "modelspec.implementation": IMPLEMENTATION,
            "modelspec.architecture": f"lumina-2/{adapter}" if adapter else "lumina-2"}


# --- the memory estimate's fakes: none yet -------------------------------------------------------

_NO_ESTIMATE = "Lumina 2: the memory estimate does not cover this family yet"


def memory_parts(opts, header) -> dict:
    raise Unavailable(_NO_ESTIMATE)


def memory_text_tokens(opts, comps: dict):
    raise Unavailable(_NO_ESTIMATE)


def memory_family_model(opts, comps: dict, text_encoders: list):
    raise Unavailable(_NO_ESTIMATE)


def memory_conditioning(opts, comps: dict, batch: int, dtype):
    raise Unavailable(_NO_ESTIMATE)


def memory_text_entry_bytes(opts, comps: dict, text_dtype_bytes: int, partial: bool) -> int:
    raise Unavailable(_NO_ESTIMATE)
