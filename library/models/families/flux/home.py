"""FLUX.1's hooks (docs/FAMILIES.md "The hooks a home provides"): detection before loading, the
model bundle, the family model (tokenize / encode / forward), the full save in the layout the
transformer came from, and the memory estimate's fake model.

The bundle's slots: ``unet`` the FLUX transformer (the denoiser), ``vae`` the 16-channel
autoencoder (latents (mean - shift) x scale, as latent_cache.encode_pixels computes them),
``text_encoders`` [CLIP-L, T5], ``tokenizers`` [CLIP, T5], ``flow`` the FluxModel; no DDPM
scheduler (library/training/flow_loss.py draws the noise levels).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from library.models import clip_l_file, fake_parts, loading, t5
from library.models.families.flux import flux, flux_checkpoint, flux_loading, flux_text, tiny_flux
from library.models.family import FamilyModel, TextConditioning
from library.models.fake_parts import Counted, Unavailable
from library.models.modelspec import with_adapter

# sd-scripts' modelspec strings (library/sai_model_spec.py) per FLUX.1 variant
ARCHITECTURE = {"dev": "flux-1-dev", "schnell": "flux-1-schnell"}
IMPLEMENTATION = "https://github.com/black-forest-labs/flux"

# the built-in models this home builds (the family's tiny_models and arch_models)
BUILTIN_NAMES = tuple(tiny_flux.TINY_FLUX_NAMES)


# --- detection and loading ---------------------------------------------------------------------

def claims(path: str) -> bool:
    """Whether an existing ``path`` holds a FLUX.1 transformer (a BFL / diffusers-layout file or a
    diffusers FLUX folder), from its keys or config; no weights read."""
    return flux_loading.is_flux_source(path)


def load(opts) -> loading.ModelBundle:
    src = opts.pretrained_model_name_or_path
    m = flux_loading.load_flux(src, clip_l=opts.clip_l, t5xxl=opts.t5xxl, ae=opts.ae)
    for part in (m.transformer, m.clip_l, m.t5, m.ae):
        part.eval()
    return loading.ModelBundle(family="flux", unet=m.transformer, vae=m.ae,
                               text_encoders=[m.clip_l, m.t5],
                               tokenizers=[m.clip_tokenizer, m.t5_tokenizer], noise_scheduler=None,
                               v_parameterization=False, source=str(src), identity=m.identity,
                               vae_identity=m.ae_identity, flow=m)


def save_full(bundle, path: str, dtype, metadata: dict, trained_encoders: tuple[str, ...] = ()) -> None:
    """The trained transformer in the layout it was loaded from (BFL: one .safetensors file;
    diffusers: a transformer folder), atomically; the text encoders and autoencoder did not train
    and are not rewritten (sd-scripts' flux_train.py saves the transformer alone)."""
    m = bundle.flow
    flux_checkpoint.save_flux_transformer(path, bundle.unet.state_dict(), m.layout, m.config,
                                          metadata=metadata, dtype=dtype)


def metadata_fields(variant: str, adapter: str | None) -> dict[str, str]:
    """ss_base_model_version and modelspec architecture / implementation of a FLUX.1 file ("dev" /
    "schnell"), as sd-scripts writes them (library/sai_model_spec.py; no prediction_type)."""
    if variant not in ARCHITECTURE:
        raise ValueError(f"flux variant {variant!r}; expected {', '.join(ARCHITECTURE)}")
    return {"ss_base_model_version": "flux1", "modelspec.implementation": IMPLEMENTATION,
            "modelspec.architecture": with_adapter(ARCHITECTURE[variant], adapter)}


# --- the family model ----------------------------------------------------------------------------

@dataclass
class FluxTextConditioning(TextConditioning):
    """T5's states (hidden_states), CLIP-L's pooled output (pooled) and the T5 attention mask."""

    t5_attn_mask: Any = None

    def to(self, *args, **kwargs) -> "FluxTextConditioning":
        return FluxTextConditioning(self.hidden_states.to(*args, **kwargs),
                                    None if self.pooled is None else self.pooled.to(*args, **kwargs),
                                    self.t5_attn_mask)


class FluxFamilyModel(FamilyModel):
    """tokenize -> [CLIP ids (B, 77), T5 ids (B, L), T5 mask (B, L)]; encode -> T5 states, CLIP-L
    pooled, mask (library/models/families/flux/flux_text.py); unet_forward packs the (B, 16, H, W) latents into
    2x2 patches with their position ids, gives dev its guidance input and unpacks the velocity.
    A partial text-encoder cache holds T5's states and mask; CLIP-L's pooled output is computed
    at each step (``encode_frozen_part`` / ``encode_with_frozen_part``)."""

    family = "flux"
    conditioning_type = FluxTextConditioning
    partial_cache_encoders = (1,)  # T5: its outputs are what a partial cache holds

    def __init__(self, transformer, text_encoders, tokenizers, *, t5_max_length: int,
                 guidance_scale: float, apply_t5_attn_mask: bool, rewrite=None):
        super().__init__(transformer, text_encoders, tokenizers, None, False, rewrite)
        self.t5_max_length = t5_max_length
        self.guidance_scale = guidance_scale
        self.apply_t5_attn_mask = apply_t5_attn_mask

    def tokenize(self, captions: list[str], pad: bool = True) -> list:

        if self.rewrite is not None:
            captions = [self.rewrite(c) for c in captions]
        t = flux_text.tokenize(self.tokenizers[0], self.tokenizers[1], list(captions), self.t5_max_length)
        return [t.clip_ids, t.t5_ids, t.t5_attn_mask]

    def cache_identity(self, partial: bool = False) -> dict:
        return {"t5_max_length": self.t5_max_length, "apply_t5_attn_mask": self.apply_t5_attn_mask}

    def encode_frozen_part(self, token_ids: list) -> FluxTextConditioning:
        """What a partial cache holds: T5's states and mask (pooled None)."""
        _, t5_ids, mask = token_ids
        out = t5.encode(self.text_encoders[1], t5_ids, mask, self.apply_t5_attn_mask)
        return FluxTextConditioning(out, None, mask.to(out.device))

    def encode_with_frozen_part(self, token_ids: list, part: FluxTextConditioning) -> FluxTextConditioning:
        """``encode``'s conditioning from a partial cache's ``part``: CLIP-L runs now."""
        pooled = flux_text.clip_pooled(self.text_encoders[0], token_ids[0])
        return FluxTextConditioning(part.hidden_states, pooled, part.t5_attn_mask)

    def encode(self, token_ids: list, clip_skip: int | None) -> FluxTextConditioning:

        clip_l, t5_model = self.text_encoders
        c = flux_text.encode(clip_l, t5_model, flux_text.FluxTokens(*token_ids), self.apply_t5_attn_mask)
        return FluxTextConditioning(c.t5_out, c.l_pooled, c.t5_attn_mask)

    def unet_forward(self, noisy_latents, timesteps, cond, size_cond=None, sample_seeds=None):

        b, _, h, w = noisy_latents.shape
        dtype, dev = noisy_latents.dtype, noisy_latents.device
        img = flux.pack_latents(noisy_latents)
        txt = cond.hidden_states.to(dev, dtype)
        guidance = None
        if self.unet.config.guidance_embed:
            guidance = torch.full((b,), float(self.guidance_scale), device=dev, dtype=dtype)
        out = self.unet(img, flux.image_ids(h // 2, w // 2, b, dev).to(dtype), txt,
                        flux.text_ids(txt.shape[1], b, dev).to(dtype), timesteps.to(dev, dtype),
                        cond.pooled.to(dev, dtype), guidance,
                        cond.t5_attn_mask.to(dev) if self.apply_t5_attn_mask else None)
        return flux.unpack_latents(out, h // 2, w // 2)


def family_model(bundle, opts, rewrite=None) -> FluxFamilyModel:
    t5_len = opts.t5xxl_max_token_length or bundle.flow.t5_max_length
    return FluxFamilyModel(bundle.unet, bundle.text_encoders, bundle.tokenizers, t5_max_length=t5_len,
                           guidance_scale=opts.guidance_scale,
                           apply_t5_attn_mask=opts.apply_t5_attn_mask, rewrite=rewrite)


# --- the memory estimate's fakes (library/training/flow_memory.py) ----------------------------

def memory_parts(opts, header) -> dict:
    """{unet, vae, text_encoder, text_encoder_2} on fake tensors, from headers and configs: the
    built-ins built whole; a BFL file from its header (CLIP-L from the ``clip_l`` file's config,
    T5 from the ``t5xxl`` file, ``ae`` counted); a diffusers folder from its configs."""
    src = opts.pretrained_model_name_or_path
    path = os.path.expanduser(str(src))
    if src in tiny_flux.TINY_FLUX_NAMES and not os.path.exists(path):
        p = tiny_flux.build_tiny_flux(tiny_flux.TINY_FLUX_NAMES[src])
        return {"unet": p["transformer"], "vae": p["ae"], "text_encoder": p["clip_l"],
                "text_encoder_2": p["t5"]}
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return _file(opts, src, path, header)
    if os.path.isdir(path):
        return _folder(opts, path, header)
    raise Unavailable(f"{src}: only FLUX.1 .safetensors files, diffusers folders and the built-in "
                      "models are estimated")


_SINGLE = "a single-file FLUX.1 transformer"


def _clip_l_of_file(path: str, header) -> torch.nn.Module:
    """CLIP-L built from a ``clip_l`` file's config (its metadata's, else CLIP-L's), as load_clip_l builds it."""
    if not path:
        raise Unavailable(f"clip_l: required with {_SINGLE}")
    path = os.path.expanduser(path)
    _, meta = header(path)
    return CLIPTextModel(clip_l_file.clip_l_config(meta, path))


def _file(opts, src: str, path: str, header) -> dict:
    shapes, meta = header(path)
    keys = {k: fake_parts.Shape(s) for k, s in shapes.items()}
    if flux_checkpoint.layout_of(keys) != "bfl":
        raise Unavailable(f"{src}: only BFL-layout FLUX.1 files are estimated (and diffusers folders)")
    cfg = flux_checkpoint.config_from_bfl(keys, path, flux_checkpoint._meta_config(meta, path))
    return {"unet": flux.Flux(cfg), "vae": Counted(fake_parts.header_numel(opts.ae, "ae", header, _SINGLE), "ae"),
            "text_encoder": _clip_l_of_file(opts.clip_l, header),
            "text_encoder_2": fake_parts.t5_file(opts.t5xxl, header, _SINGLE)}


def _folder(opts, folder: str, header) -> dict:
    """A diffusers FLUX.1 folder, as flux_loading._folder loads it (clip_l / t5xxl / ae files replace its parts)."""
    cfg_path = os.path.join(folder, "transformer", "config.json")
    if not os.path.isfile(cfg_path):
        raise Unavailable(f"{folder}: not a diffusers FLUX folder (no transformer/config.json)")
    cfg = flux_checkpoint.config_from_diffusers(loading.read_json(cfg_path), cfg_path)
    if opts.clip_l:
        clip = _clip_l_of_file(opts.clip_l, header)
    else:
        clip = CLIPTextModel(CLIPTextConfig(**loading.read_json(os.path.join(folder, "text_encoder", "config.json"))))
    if opts.t5xxl:
        t5_model = fake_parts.t5_file(opts.t5xxl, header, "a FLUX.1 folder")
    else:
        t5_model = T5EncoderModel(T5Config(**loading.read_json(os.path.join(folder, "text_encoder_2", "config.json"))))
    ae_n = (fake_parts.header_numel(opts.ae, "ae", header, _SINGLE) if opts.ae
            else fake_parts.folder_numel(os.path.join(folder, "vae"), header))
    return {"unet": flux.Flux(cfg), "vae": Counted(ae_n, "ae"), "text_encoder": clip, "text_encoder_2": t5_model}


def memory_text_tokens(opts, comps: dict) -> tuple[int, int, int]:
    """(tokens, token width, pooled width) of the transformer's text input: T5's
    t5xxl_max_token_length, by default dev's 512 or schnell's 256."""
    unet = comps["unet"]
    length = opts.t5xxl_max_token_length or t5.T5_MAX_LENGTH["dev" if unet.config.guidance_embed else "schnell"]
    return length, unet.config.context_in_dim, unet.config.vec_in_dim


def memory_family_model(opts, comps: dict, text_encoders: list) -> FluxFamilyModel:
    """The run's family model over the fake transformer (no tokenizers: the estimate encodes no text)."""
    return FluxFamilyModel(comps["unet"], text_encoders, [], t5_max_length=memory_text_tokens(opts, comps)[0],
                           guidance_scale=opts.guidance_scale, apply_t5_attn_mask=opts.apply_t5_attn_mask)


def memory_conditioning(opts, comps: dict, batch: int, dtype) -> FluxTextConditioning:
    """One micro-step's text input: zeros of the encoders' output shapes, every T5 token real."""
    tokens, width, pooled = memory_text_tokens(opts, comps)
    return FluxTextConditioning(torch.zeros(batch, tokens, width, dtype=dtype), torch.zeros(batch, pooled, dtype=dtype),
                                torch.ones(batch, tokens, dtype=torch.long))


def memory_text_entry_bytes(opts, comps: dict, text_dtype_bytes: int, partial: bool) -> int:
    """One caption's text-cache entry: T5's states (tokens x width, in T5's output dtype) and its
    attention mask (int64), and in a full cache CLIP-L's pooled output."""
    tokens, width, pooled = memory_text_tokens(opts, comps)
    states = tokens * width * fake_parts.t5_output_bytes(comps["text_encoder_2"])
    return states + tokens * 8 + (0 if partial else pooled * text_dtype_bytes)
