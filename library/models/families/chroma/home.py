"""Chroma's hooks (docs/FAMILIES.md "The hooks a home provides"): detection before loading, the
model bundle, the family model (T5 with its attention mask, the transformer's packed forward), the
full save in the layout the transformer came from, metadata and the memory estimate's fakes.

The bundle's slots: ``unet`` the Chroma transformer, ``vae`` FLUX.1's 16-channel autoencoder,
``text_encoders`` [T5-XXL], ``tokenizers`` [T5], ``flow`` the ChromaModel.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from transformers import T5Config, T5EncoderModel

from library.models import embedded_config, fake_parts, loading, t5
from library.models.families.flux import flux
from library.models.fake_parts import Counted, Unavailable
from library.models.families.chroma import checkpoint
from library.models.families.chroma import sources
from library.models.families.chroma.model import Chroma
from library.models.family import FamilyModel, TextConditioning

BUILTIN_NAMES = sources.TINY_NAMES
IMPLEMENTATION = "https://huggingface.co/lodestones/Chroma"  # sd-scripts' IMPL_CHROMA


# --- detection and loading ---------------------------------------------------------------------

def _keys(path: str) -> set | None:
    if not path.endswith((".safetensors", ".sft")):
        return None
    try:
        with safe_open(path, framework="pt") as f:
            return set(f.keys())
    except Exception:  # noqa: BLE001 - not a readable safetensors file: not a Chroma one either
        return None


def claims(path: str) -> bool:
    """Whether ``path`` holds a Chroma transformer: an original-layout file (the approximator's
    ``distilled_guidance_layer``, no ``guidance_in`` / ``vector_in``), or a diffusers folder whose
    transformer is a ChromaTransformer2DModel; no weights read."""
    if os.path.isdir(path):
        return checkpoint.transformer_folder(path) is not None
    keys = _keys(path)
    return keys is not None and checkpoint.layout_of(keys) is not None


def load(opts) -> loading.ModelBundle:
    src = opts.pretrained_model_name_or_path
    m = sources.load_chroma(src, t5xxl=opts.t5xxl, ae=opts.ae)
    for part in (m.transformer, m.t5, m.ae):
        part.eval()
    return loading.ModelBundle(family="chroma", unet=m.transformer, vae=m.ae, text_encoders=[m.t5],
                               tokenizers=[m.t5_tokenizer], noise_scheduler=None, v_parameterization=False,
                               source=str(src), identity=m.identity, vae_identity=m.ae_identity, flow=m)


def save_full(bundle, path: str, dtype, metadata: dict, trained_encoders: tuple[str, ...] = ()) -> None:
    """The trained transformer in the layout it was loaded from (original: one .safetensors file;
    diffusers: a transformer folder), atomically; T5 and the autoencoder stay as they were."""
    m = bundle.flow
    checkpoint.save_transformer(path, bundle.unet.state_dict(), m.layout, m.config, metadata=metadata, dtype=dtype)


def metadata_fields(variant: str, adapter: str | None) -> dict[str, str]:
    """sd-scripts' Chroma values (flux_train_network.py --model_type chroma, sai_model_spec.py):
    ss_base_model_version "chroma", architecture "chroma", Chroma's implementation, ss_model_type."""
    return {"ss_base_model_version": variant, "modelspec.architecture": f"{variant}/{adapter}" if adapter else variant,
            "modelspec.implementation": IMPLEMENTATION, "ss_model_type": "chroma"}


# --- the family model ----------------------------------------------------------------------------

@dataclass
class ChromaTextConditioning(TextConditioning):
    """T5's states (hidden_states; no pooled vector) and T5's attention mask."""

    t5_attn_mask: Any = None

    def to(self, *args, **kwargs) -> "ChromaTextConditioning":
        return ChromaTextConditioning(self.hidden_states.to(*args, **kwargs), None, self.t5_attn_mask)


class ChromaFamilyModel(FamilyModel):
    """tokenize -> [T5 ids (B, L), T5 mask (B, L)]; encode -> T5's states with the mask applied in
    T5 (sd-scripts requires apply_t5_attn_mask for Chroma: always on here) and the mask;
    unet_forward packs the (B, 16, H, W) latents into 2x2 patches with their position ids and
    unpacks the velocity; the transformer masks T5's padding but the first pad token."""

    family = "chroma"
    conditioning_type = ChromaTextConditioning

    def __init__(self, transformer, text_encoders, tokenizers, *, t5_max_length: int, rewrite=None):
        super().__init__(transformer, text_encoders, tokenizers, None, False, rewrite)
        self.t5_max_length = t5_max_length

    def tokenize(self, captions: list[str], pad: bool = True) -> list:
        if self.rewrite is not None:
            captions = [self.rewrite(c) for c in captions]
        ids, mask = t5.tokenize(self.tokenizers[0], list(captions), self.t5_max_length)
        return [ids, mask]

    def cache_identity(self, partial: bool = False) -> dict:
        return {"t5_max_length": self.t5_max_length, "apply_t5_attn_mask": True}

    def encode(self, token_ids: list, clip_skip: int | None) -> ChromaTextConditioning:
        ids, mask = token_ids
        out = t5.encode(self.text_encoders[0], ids, mask, True)
        return ChromaTextConditioning(out, None, mask.to(out.device))

    def unet_forward(self, noisy_latents, timesteps, cond, size_cond=None, sample_seeds=None):
        b, _, h, w = noisy_latents.shape
        dtype, dev = noisy_latents.dtype, noisy_latents.device
        txt = cond.hidden_states.to(dev, dtype)
        out = self.unet(flux.pack_latents(noisy_latents), flux.image_ids(h // 2, w // 2, b, dev).to(dtype), txt,
                        flux.text_ids(txt.shape[1], b, dev).to(dtype), timesteps.to(dev, dtype),
                        cond.t5_attn_mask.to(dev))
        return flux.unpack_latents(out, h // 2, w // 2)


def family_model(bundle, opts, rewrite=None) -> ChromaFamilyModel:
    return ChromaFamilyModel(bundle.unet, bundle.text_encoders, bundle.tokenizers,
                             t5_max_length=opts.t5xxl_max_token_length or bundle.flow.t5_max_length, rewrite=rewrite)


# --- the memory estimate's fakes (library/training/flow_memory.py) ----------------------------

_SINGLE = "a single-file Chroma transformer"


def memory_parts(opts, header) -> dict:
    """{unet, vae, text_encoder} on fake tensors: tiny-chroma built whole; an original-layout file
    from its header (T5 from the ``t5xxl`` file, ``ae`` counted); a diffusers folder from its
    configs (the ``t5xxl`` / ``ae`` files replace its parts)."""
    src = opts.pretrained_model_name_or_path
    path = os.path.expanduser(str(src))
    if src in BUILTIN_NAMES and not os.path.exists(path):
        p = sources.build_tiny()
        return {"unet": p["transformer"], "vae": p["ae"], "text_encoder": p["t5"]}
    if os.path.isfile(path) and path.endswith(".safetensors"):
        shapes, meta = header(path)
        keys = {k.removeprefix(checkpoint.PREFIX): fake_parts.Shape(s) for k, s in shapes.items()}
        if checkpoint.ORIGINAL_MARKER not in keys:
            raise Unavailable(f"{src}: only original-layout Chroma files are estimated (and diffusers folders)")
        record = embedded_config.read_record(meta, checkpoint.META_CONFIG_KEY, path)
        cfg = checkpoint.config_from_original(keys, path, record)
        return {"unet": Chroma(cfg), "vae": Counted(fake_parts.header_numel(opts.ae, "ae", header, _SINGLE), "ae"),
                "text_encoder": fake_parts.t5_file(opts.t5xxl, header, _SINGLE)}
    folder = checkpoint.transformer_folder(path) if os.path.isdir(path) else None
    if folder is None:
        raise Unavailable(f"{src}: only Chroma .safetensors files, diffusers folders and the built-in "
                          "models are estimated")
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = checkpoint.config_from_diffusers(json.load(f), folder)
    if opts.t5xxl:
        t5_model = fake_parts.t5_file(opts.t5xxl, header, "a Chroma folder")
    else:
        t5_model = T5EncoderModel(T5Config(**loading.read_json(os.path.join(path, "text_encoder", "config.json"))))
    ae_n = (fake_parts.header_numel(opts.ae, "ae", header, _SINGLE) if opts.ae
            else fake_parts.folder_numel(os.path.join(path, "vae"), header))
    return {"unet": Chroma(cfg), "vae": Counted(ae_n, "ae"), "text_encoder": t5_model}


def memory_text_tokens(opts, comps: dict) -> tuple[int, int, int]:
    """(tokens, token width, pooled width 0) of the transformer's text input."""
    return opts.t5xxl_max_token_length or sources.T5_MAX_LENGTH, comps["unet"].config.context_in_dim, 0


def memory_family_model(opts, comps: dict, text_encoders: list) -> ChromaFamilyModel:
    return ChromaFamilyModel(comps["unet"], text_encoders, [], t5_max_length=memory_text_tokens(opts, comps)[0])


def memory_conditioning(opts, comps: dict, batch: int, dtype) -> ChromaTextConditioning:
    """One micro-step's text input: T5's states of zeros, every token real (the most attention)."""
    tokens, width, _ = memory_text_tokens(opts, comps)
    return ChromaTextConditioning(torch.zeros(batch, tokens, width, dtype=dtype), None,
                                  torch.ones(batch, tokens, dtype=torch.long))


def memory_text_entry_bytes(opts, comps: dict, text_dtype_bytes: int, partial: bool) -> int:
    """One caption's text-cache entry: T5's states (in T5's output dtype) and its mask (int64)."""
    tokens, width, _ = memory_text_tokens(opts, comps)
    return tokens * width * fake_parts.t5_output_bytes(comps["text_encoder"]) + tokens * 8

