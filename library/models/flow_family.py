"""FLUX.1 as a family the trainer runs (full fine-tuning of the transformer): which sources are
FLUX, the checks before any weight loads, the model bundle, the family model (tokenize / encode /
forward) and the full-model save in the layout the transformer was loaded from.

    family_before_loading(name_or_path)      "flux" (built-in name, BFL file or diffusers FLUX
                                             folder, from its keys / config), else None
    check_options(opts, method_name)         one line per option this family cannot honour
    load_from_options(opts)                  ModelBundle (FLUX: flow = the FluxModel), else the
                                             SD loader's bundle
    family_model_for(bundle, opts, ...)      FluxFamilyModel, else family.family_model_for
    save_full(bundle, path, dtype, metadata) the trained transformer (save_flux_transformer)

The bundle's slots: ``unet`` the FLUX transformer (the denoiser), ``vae`` the 16-channel
autoencoder (latents (mean - shift) x scale, as latent_cache.encode_pixels computes them),
``text_encoders`` [CLIP-L, T5], ``tokenizers`` [CLIP, T5]; no DDPM scheduler
(library/training/flow_loss.py draws the noise levels). SD3's bundle: ``text_encoders`` [CLIP-L,
CLIP-G] and T5 when the model has one, ``tokenizers`` likewise.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
from dataclasses import dataclass
from typing import Any

import torch

from library.config.options import OPTIONS_BY_NAME
from library.errors import UserError
from library.models.family import FamilyModel, TextConditioning
from library.models.family import family_model_for as sd_family_model_for
from library.models import (flux, flux_checkpoint, flux_loading, flux_text, loading, sd3_checkpoint, sd3_text, t5,
                            tiny_flux)
from library.models.families.lumina import run_model

logger = logging.getLogger("sdtk")

# the options only a FLUX.1 (or SD3) run reads: refused with an SD model
FLOW_OPTIONS = ("timestep_sampling", "sigmoid_scale", "discrete_flow_shift", "model_prediction_type",
                "weighting_scheme", "logit_mean", "logit_std", "mode_scale", "guidance_scale",
                "t5xxl_max_token_length", "apply_t5_attn_mask", "clip_l", "clip_g", "t5xxl", "ae",
                "training_shift", "apply_lg_attn_mask", "clip_l_dropout_rate", "clip_g_dropout_rate",
                "t5_dropout_rate", "train_t5xxl", "learning_rate_te3", "pos_emb_random_crop_rate",
                "enable_scaled_pos_embed", "split_mode", "double_blocks_to_swap", "single_blocks_to_swap",
                "use_t5xxl_cache_only", "num_last_block_to_freeze", "gemma2", "gemma2_max_token_length",
                "system_prompt", "use_flash_attn", "use_sage_attn")
# options of the SD trainer this family does not honour (yet): name -> why
UNSUPPORTED = {
    "v2": "the model is not SD2",
    "v_parameterization": "FLUX.1 predicts the flow velocity (see model_prediction_type)",
    "zero_terminal_snr": "a change of the DDPM schedule",
    "weighted_captions": "sd-scripts' FLUX.1 / SD3 text encodings have no prompt weighting "
                         "(its strategy_flux / strategy_sd3 tokenize without weights)",
    "no_token_padding": "an SD1/SD2 DreamBooth option",
    "tokenizer_path": "the tokenizers come with the model",
    "train_inpainting": "an SD option",
    "block_lr": "SDXL's U-Net blocks",
}
SD3_T5_MAX_LENGTH = 256  # sd-scripts' t5xxl_max_token_length default for SD3
# huber / smooth_l1 with huber_schedule constant or exponential (at t = 1000 sigma, as sd-scripts);
# its snr schedule needs the DDPM schedule's SNR (flow_loss.check_options)
HUBER_SCHEDULES = ("constant", "exponential")


class FlowFamilyError(UserError, ValueError):
    """An option a FLUX.1 run cannot honour; one line naming it."""


def family_before_loading(name_or_path: str | None) -> str | None:
    """"flux" for a FLUX.1 source (a built-in name, a BFL / diffusers-layout transformer file or a
    diffusers FLUX folder), "sd3" for an SD3 / SD3.5 one (built-in, SAI file, diffusers folder),
    told from names, keys or configs (no weights read); else None."""

    if not name_or_path:
        return None
    path = os.path.expanduser(str(name_or_path))
    if not os.path.exists(path) and name_or_path in tiny_flux.TINY_FLUX_NAMES:
        return "flux"
    if os.path.exists(path) and flux_loading.is_flux_source(path):
        return "flux"
    if run_model.is_source(str(name_or_path)):
        return "lumina"
    try:
        return "sd3" if sd3_checkpoint.detect_source(str(name_or_path)) is not None else None
    except UserError:  # an unreadable file: the SD loader names the problem
        return None


def check_sources(opts, family: str) -> None:
    """The family's checks of its parts before any weight loads (Lumina 2: the transformer, gemma2
    and ae headers, the attention kernel)."""
    if family == "lumina":
        run_model.check_sources(opts)


def _is_set(opts, name: str) -> bool:
    value = getattr(opts, name)
    return value not in (None, False, 0, 0.0, "", (), []) and value != OPTIONS_BY_NAME[name].default


def load_from_options(opts) -> loading.ModelBundle:
    """The run's model: a FLUX.1 source as a bundle over its FluxModel, any other through the SD
    loader (library/models/loading.py)."""

    src = opts.pretrained_model_name_or_path
    fam = family_before_loading(src)
    if fam == "sd3":
        return _load_sd3(opts)
    if fam == "lumina":
        return run_model.load_bundle(opts, loading.ModelBundle)
    if fam != "flux":
        return loading.load_from_options(opts)
    m = flux_loading.load_flux(src, clip_l=opts.clip_l, t5xxl=opts.t5xxl, ae=opts.ae)
    for part in (m.transformer, m.clip_l, m.t5, m.ae):
        part.eval()
    return loading.ModelBundle(family="flux", unet=m.transformer, vae=m.ae,
                               text_encoders=[m.clip_l, m.t5],
                               tokenizers=[m.clip_tokenizer, m.t5_tokenizer], noise_scheduler=None,
                               v_parameterization=False, source=str(src), identity=m.identity,
                               vae_identity=m.ae_identity, flow=m)


def sd3_ae_file(opts) -> str | None:
    """SD3's separate autoencoder file: sd-scripts' SD3 scripts take it as ``vae``; ``ae``
    (FLUX.1's name) is accepted too (flow_loss.check_options refuses two different files)."""
    return opts.ae or opts.vae


def _load_sd3(opts) -> loading.ModelBundle:

    src = opts.pretrained_model_name_or_path
    ae = sd3_ae_file(opts)
    with loading.quiet_progress():
        m = sd3_checkpoint.load_sd3(src, clip_l=opts.clip_l, clip_g=opts.clip_g, t5xxl=opts.t5xxl, ae=ae,
                                    t5_loader=t5.model_from_state_dict, allow_pickle=opts.allow_pickle)
    for part in (m.mmdit, m.clip_l, m.clip_g, m.vae):
        part.eval()
    encoders, tokenizers = [m.clip_l, m.clip_g], [m.tokenizer_l, m.tokenizer_g]
    if m.t5xxl is not None:  # without T5: 77 zero tokens in its place (sd-scripts without t5xxl)
        width, ctx = m.t5xxl.config.d_model, m.mmdit.config.context_dim
        if width != ctx:
            raise FlowFamilyError(f"t5xxl: the T5 encoder is {width} wide; the SD3 model {src} reads "
                                  f"{ctx}-wide text tokens")
        if m.tokenizer_t5 is None:
            m.tokenizer_t5 = t5.load_t5_tokenizer(None)
        encoders.append(m.t5xxl.eval())
        tokenizers.append(m.tokenizer_t5)
    path = os.path.expanduser(str(src))
    ident = loading.path_identity(path) if os.path.exists(path) else f"builtin:{src}"
    ae_ident = loading.path_identity(os.path.expanduser(ae)) if ae else ident + ":vae"
    return loading.ModelBundle(family="sd3", unet=m.mmdit, vae=m.vae, text_encoders=encoders,
                               tokenizers=tokenizers, noise_scheduler=None,
                               v_parameterization=False, source=str(src), identity=ident,
                               vae_identity=ae_ident, flow=m)


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
    pooled, mask (library/models/flux_text.py); unet_forward packs the (B, 16, H, W) latents into
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


class SD3FamilyModel(FamilyModel):
    """tokenize -> [CLIP-L ids, CLIP-G ids, their masks] (77 each), then with T5 [T5 ids, T5 mask]
    (t5_max_length each); encode -> the MMDiT's context (CLIP-L | CLIP-G penultimate states
    zero-padded to the context width, then T5's states, or 77 zero tokens without T5) and pooled
    CLIP-L | CLIP-G (library/models/sd3_text.py); unet_forward calls the MMDiT with the timestep
    1000 sigma (flow_matching.model_timesteps). The masks only reach the encoders (with
    apply_lg_attn_mask / apply_t5_attn_mask): sd-scripts' MMDiT attends to every token. A partial
    text-encoder cache holds the context's tokens after CLIP's 77 (T5's states, or the zeros
    without T5); CLIP-L and CLIP-G run at each step (``encode_with_frozen_part``)."""

    family = "sd3"
    partial_cache_encoders = (2,)  # T5 (when the model has one): what a partial cache holds

    def __init__(self, mmdit, text_encoders, tokenizers, *, apply_lg_attn_mask: bool = False,
                 apply_t5_attn_mask: bool = False, t5_max_length: int = SD3_T5_MAX_LENGTH,
                 dropout_rates: tuple[float, float, float] = (0.0, 0.0, 0.0),
                 pos_emb_random_crop_rate: float = 0.0, rewrite=None):
        super().__init__(mmdit, text_encoders, tokenizers, None, False, rewrite)
        self.dropout_rates = tuple(dropout_rates)  # CLIP-L, CLIP-G, T5
        self.pos_emb_random_crop_rate = pos_emb_random_crop_rate
        self.apply_lg_attn_mask = apply_lg_attn_mask
        self.apply_t5_attn_mask = apply_t5_attn_mask
        self.t5_max_length = t5_max_length

    def tokenize(self, captions: list[str], pad: bool = True) -> list:

        if self.rewrite is not None:
            captions = [self.rewrite(c) for c in captions]
        t5_tok = self.tokenizers[2] if len(self.tokenizers) > 2 else None
        t = sd3_text.tokenize(list(captions), self.tokenizers[0], self.tokenizers[1], t5_tok, self.t5_max_length)
        return [t.l_ids, t.g_ids, t.l_mask, t.g_mask] + ([t.t5_ids, t.t5_mask] if t5_tok is not None else [])

    def cache_identity(self, partial: bool = False) -> dict:
        """``partial``: the parts of the T5 tokens alone (the CLIP masks do not change them)."""
        with_t5 = len(self.tokenizers) > 2
        parts = {"t5_max_length": self.t5_max_length if with_t5 else None, "with_t5": with_t5,
                 "apply_t5_attn_mask": self.apply_t5_attn_mask and with_t5}
        return parts if partial else {**parts, "apply_lg_attn_mask": self.apply_lg_attn_mask}

    def encode_frozen_part(self, token_ids: list) -> TextConditioning:
        """What a partial cache holds: the context's tokens after CLIP's 77 (pooled None)."""
        tokens = sd3_text.SD3Tokens(*token_ids)
        t5_model = self.text_encoders[2] if len(self.text_encoders) > 2 else None
        out = sd3_text.encode_t5(tokens, t5_model, apply_t5_attn_mask=self.apply_t5_attn_mask)
        device = self._device(self.text_encoders[0])
        return TextConditioning(sd3_text.t5_tokens_part(out, tokens.l_ids.shape[0], self.unet.config.context_dim,
                                                         device, torch.float32), None)

    def encode_with_frozen_part(self, token_ids: list, part: TextConditioning) -> TextConditioning:
        """``encode``'s conditioning from a partial cache's ``part``: CLIP-L and CLIP-G run now."""
        enc = sd3_text.encode(sd3_text.SD3Tokens(*token_ids[:4]), *self.text_encoders[:2],
                              apply_lg_attn_mask=self.apply_lg_attn_mask)
        context, pooled = sd3_text.condition(dataclasses.replace(enc, t5_out=part.hidden_states),
                                             self.unet.config.context_dim)
        return TextConditioning(context, pooled)

    def encode(self, token_ids: list, clip_skip: int | None) -> TextConditioning:

        enc = sd3_text.encode(sd3_text.SD3Tokens(*token_ids), *self.text_encoders,
                              apply_lg_attn_mask=self.apply_lg_attn_mask,
                              apply_t5_attn_mask=self.apply_t5_attn_mask)
        context, pooled = sd3_text.condition(enc, self.unet.config.context_dim)
        return TextConditioning(context, pooled)

    def drop_encoders(self, cond: TextConditioning, seeds: list[int]) -> TextConditioning:
        """sd-scripts' SD3 text-encoder dropout: per sample, CLIP-L, then CLIP-G, then T5 is
        dropped with its rate (a draw only for a rate above 0, as sd-scripts' ``rate > 0 and
        random() < rate``, here from random.Random(seed) of the sample): its states and its part
        of the pooled vector become zeros (its mask too in sd-scripts, which the MMDiT does not
        read). On the joined context: CLIP-L's states are features [0, width_l) of the first 77
        tokens, CLIP-G's the next width_g, T5's every token after them."""
        if not any(self.dropout_rates):
            return cond
        drops = []
        for seed in seeds:
            rng = random.Random(seed)
            drops.append([rate > 0 and rng.random() < rate for rate in self.dropout_rates])
        if not any(any(d) for d in drops):
            return cond
        ctx, pooled = cond.hidden_states, cond.pooled
        wl, wg = (enc.config.hidden_size for enc in self.text_encoders[:2])
        pl = self.text_encoders[0].config.projection_dim
        n = sd3_text.CLIP_LENGTH
        zero_ctx = torch.zeros(ctx.shape, dtype=torch.bool, device=ctx.device)
        zero_pooled = torch.zeros(pooled.shape, dtype=torch.bool, device=pooled.device)
        for k, (l, g, t) in enumerate(drops):
            if l:
                zero_ctx[k, :n, :wl] = True
                zero_pooled[k, :pl] = True
            if g:
                zero_ctx[k, :n, wl:wl + wg] = True
                zero_pooled[k, pl:] = True
            if t:
                zero_ctx[k, n:] = True
        return TextConditioning(torch.where(zero_ctx, 0.0, ctx), torch.where(zero_pooled, 0.0, pooled))

    def unet_forward(self, noisy_latents, timesteps, cond, size_cond=None, sample_seeds=None):
        """``sample_seeds`` (training): each sample's pos_emb_random_crop_rate draw
        (library/models/sd3_positions.py); without them the table's centre (samples, validation)."""
        dtype, dev = noisy_latents.dtype, noisy_latents.device
        rate = self.pos_emb_random_crop_rate if sample_seeds is not None else 0.0
        # computed here, eagerly: the draws and the scaled tables stay out of a compiled forward
        pos = self.unet.cropped_pos_embed(*self.unet.patches(noisy_latents), rate,
                                          list(sample_seeds) if rate > 0 else None, device=dev, dtype=dtype)
        return self.unet(noisy_latents, timesteps.to(dev, dtype), cond.pooled.to(dev, dtype),
                         cond.hidden_states.to(dev, dtype), pos_embed=pos)


def family_model_for(bundle, opts, *, rewrite=None) -> FamilyModel:
    """The run's family model: FLUX.1's, SD3's, or the SD family's (library/models/family.py)."""
    if bundle.family == "sd3":
        return SD3FamilyModel(bundle.unet, bundle.text_encoders, bundle.tokenizers,
                              apply_lg_attn_mask=opts.apply_lg_attn_mask,
                              apply_t5_attn_mask=opts.apply_t5_attn_mask,
                              t5_max_length=opts.t5xxl_max_token_length or SD3_T5_MAX_LENGTH,
                              dropout_rates=(opts.clip_l_dropout_rate, opts.clip_g_dropout_rate,
                                             opts.t5_dropout_rate),
                              pos_emb_random_crop_rate=opts.pos_emb_random_crop_rate, rewrite=rewrite)
    if bundle.family == "lumina":
        return run_model.family_model_for(bundle, opts, rewrite=rewrite)
    if bundle.family != "flux":
        return sd_family_model_for(bundle, max_token_length=opts.max_token_length,
                                          weighted=opts.weighted_captions, rewrite=rewrite)
    t5_len = opts.t5xxl_max_token_length or bundle.flow.t5_max_length
    return FluxFamilyModel(bundle.unet, bundle.text_encoders, bundle.tokenizers, t5_max_length=t5_len,
                           guidance_scale=opts.guidance_scale,
                           apply_t5_attn_mask=opts.apply_t5_attn_mask, rewrite=rewrite)


def enable_scaled_pos_embed(mmdit, resolutions, log) -> None:
    """enable_scaled_pos_embed (SD3): the MMDiT's scaled tables for the datasets' resolutions
    (W, H), each latent size round(sqrt(W x H)) // 8, as sd-scripts' sd3_train.py."""
    sizes = sorted({round((w * h) ** 0.5) // 8 for w, h in resolutions})
    log.info(f"enable_scaled_pos_embed: scaled position embeddings for resolutions {list(resolutions)} "
             f"(latent sizes {sizes})")
    mmdit.enable_scaled_pos_embed(sizes)


def save_full(bundle, path: str, dtype, metadata: dict, trained_encoders: tuple[str, ...] = ()) -> None:
    """The trained FLUX.1 transformer in the layout it was loaded from (BFL: one .safetensors
    file; diffusers: a transformer folder), atomically; the text encoders and autoencoder did not
    train and are not rewritten (sd-scripts' flux_train.py saves the transformer alone). SD3: the
    source's layout and components, plus the ``trained_encoders`` ("clip_l", "clip_g", "t5xxl")
    even when they came from separate files (sd-scripts' save_sd3_model with the trained ones)."""

    m = bundle.flow
    if bundle.family == "lumina":  # the transformer alone, in its source's layout (sd-scripts' lumina_train.py)
        run_model.save_full(bundle, path, dtype, metadata)
        return
    if bundle.family == "sd3":  # the source's layout and components (and the trained encoders),
        # the trained MMDiT in them (bundle.unet: under fsdp the gathered copy
        # library/distributed/fsdp.py puts there)
        comps = (m.in_source | set(trained_encoders)) if trained_encoders else None
        sd3_checkpoint.save_sd3(dataclasses.replace(m, mmdit=bundle.unet), path, dtype=dtype,
                                metadata=metadata, components=comps)
        return
    flux_checkpoint.save_flux_transformer(path, bundle.unet.state_dict(), m.layout, m.config,
                                          metadata=metadata, dtype=dtype)
