"""SD3 / SD3.5's hooks (docs/FAMILIES.md "The hooks a home provides"): detection before loading,
the model bundle, the family model, the full save in the source's layout and components, and the
memory estimate's fake model.

SD3's bundle: ``text_encoders`` [CLIP-L, CLIP-G] and T5 when the model has one, ``tokenizers``
likewise, ``flow`` the SD3 model record (library/models/families/sd3/sd3_checkpoint.py).
"""
from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import replace

import torch
from transformers import CLIPTextConfig, CLIPTextModelWithProjection

from library.errors import UserError
from library.models import embedded_config, fake_parts, flow_family, loading, t5
from library.models.families.sd3 import sd3, sd3_builtins, sd3_checkpoint, sd3_text, sd3_vae
from library.models.fake_parts import Counted, Unavailable
from library.models.family import FamilyModel, TextConditioning
from library.models.modelspec import IMPL_DIFFUSERS, IMPL_STABILITY_AI, with_adapter

# sd-scripts' SD3 model_type (sd3_utils.analyze_state_dict_state) per MMDiTConfig.variant: its
# ss_base_model_version and the suffix of modelspec.architecture "stable-diffusion-3-<type>"
MODEL_TYPE = {"sd3": "medium", "sd3.5-medium": "5-medium", "sd3.5-large": "5-large"}
SD3_T5_MAX_LENGTH = 256  # sd-scripts' t5xxl_max_token_length default for SD3
CLIP_TOKENS = sd3_text.CLIP_LENGTH  # 77
TOKENS_WITHOUT_T5 = 2 * CLIP_TOKENS  # without T5: 77 zero tokens in its place (sd3_text.condition)
# the built-in models this home builds (the family's tiny_models and arch_models)
BUILTIN_NAMES = (*sd3_builtins.NAMES, *sd3_builtins.ARCH_NAMES)


def claims(path: str) -> bool:
    """Whether ``path`` is an SD3 / SD3.5 source (built-in, SAI file, diffusers folder), from its
    name, keys or config (no weights read); an unreadable file is not claimed (the SD loader
    names the problem)."""
    try:
        return sd3_checkpoint.detect_source(str(path)) is not None
    except UserError:
        return False


def sd3_ae_file(opts) -> str | None:
    """SD3's separate autoencoder file: sd-scripts' SD3 scripts take it as ``vae``; ``ae``
    (FLUX.1's name) is accepted too (flow_loss.check_options refuses two different files)."""
    return opts.ae or opts.vae


def load(opts) -> loading.ModelBundle:

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
            raise flow_family.FlowFamilyError(f"t5xxl: the T5 encoder is {width} wide; the SD3 model {src} reads "
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


class SD3FamilyModel(FamilyModel):
    """tokenize -> [CLIP-L ids, CLIP-G ids, their masks] (77 each), then with T5 [T5 ids, T5 mask]
    (t5_max_length each); encode -> the MMDiT's context (CLIP-L | CLIP-G penultimate states
    zero-padded to the context width, then T5's states, or 77 zero tokens without T5) and pooled
    CLIP-L | CLIP-G (library/models/families/sd3/sd3_text.py); unet_forward calls the MMDiT with the timestep
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
        (library/models/families/sd3/sd3_positions.py); without them the table's centre (samples, validation)."""
        dtype, dev = noisy_latents.dtype, noisy_latents.device
        rate = self.pos_emb_random_crop_rate if sample_seeds is not None else 0.0
        # computed here, eagerly: the draws and the scaled tables stay out of a compiled forward
        pos = self.unet.cropped_pos_embed(*self.unet.patches(noisy_latents), rate,
                                          list(sample_seeds) if rate > 0 else None, device=dev, dtype=dtype)
        return self.unet(noisy_latents, timesteps.to(dev, dtype), cond.pooled.to(dev, dtype),
                         cond.hidden_states.to(dev, dtype), pos_embed=pos)


def family_model(bundle, opts, rewrite=None) -> SD3FamilyModel:
    return SD3FamilyModel(bundle.unet, bundle.text_encoders, bundle.tokenizers,
                          apply_lg_attn_mask=opts.apply_lg_attn_mask,
                          apply_t5_attn_mask=opts.apply_t5_attn_mask,
                          t5_max_length=opts.t5xxl_max_token_length or SD3_T5_MAX_LENGTH,
                          dropout_rates=(opts.clip_l_dropout_rate, opts.clip_g_dropout_rate,
                                         opts.t5_dropout_rate),
                          pos_emb_random_crop_rate=opts.pos_emb_random_crop_rate, rewrite=rewrite)


def save_full(bundle, path: str, dtype, metadata: dict, trained_encoders: tuple[str, ...] = ()) -> None:
    """The source's layout and components, plus the ``trained_encoders`` ("clip_l", "clip_g",
    "t5xxl") even when they came from separate files (sd-scripts' save_sd3_model with the trained
    ones); the trained MMDiT is ``bundle.unet`` (under fsdp the gathered copy
    library/distributed/fsdp.py puts there)."""
    m = bundle.flow
    comps = (m.in_source | set(trained_encoders)) if trained_encoders else None
    sd3_checkpoint.save_sd3(dataclasses.replace(m, mmdit=bundle.unet), path, dtype=dtype,
                            metadata=metadata, components=comps)


def metadata_fields(variant: str, adapter: str | None) -> dict[str, str]:
    """ss_base_model_version and modelspec architecture / implementation / prediction_type of an
    SD3 file (MMDiTConfig.variant), as sd-scripts writes them (library/sai_model_spec.py): a LoRA
    says "diffusers" and "epsilon" (its SD1 defaults), a checkpoint Stability AI's implementation."""
    if variant not in MODEL_TYPE:
        raise ValueError(f"sd3 variant {variant!r}; expected {', '.join(MODEL_TYPE)}")
    t = MODEL_TYPE[variant]
    return {"ss_base_model_version": t, "modelspec.prediction_type": "epsilon",
            "modelspec.implementation": IMPL_DIFFUSERS if adapter else IMPL_STABILITY_AI,
            "modelspec.architecture": with_adapter(f"stable-diffusion-3-{t}", adapter)}


# --- the memory estimate's fakes (library/training/flow_memory.py) ----------------------------

def memory_parts(opts, header) -> dict:
    """{unet, vae, text_encoder, text_encoder_2[, text_encoder_3]} on fake tensors: the built-ins
    (also the full-size ``*-arch``) built whole; an SAI single file from its header's shapes; a
    diffusers folder from its transformer's headers converted on meta tensors, the CLIP configs
    and T5's shapes; the clip_l / clip_g / t5xxl / ae files given replace those parts."""
    src = opts.pretrained_model_name_or_path
    path = os.path.expanduser(str(src))
    if src in {**sd3_builtins.NAMES, **sd3_builtins.ARCH_NAMES} and not os.path.exists(path):
        p = sd3_builtins.build_builtin(src)
        comps = {"unet": p["mmdit"], "vae": p["vae"], "text_encoder": p["clip_l"], "text_encoder_2": p["clip_g"]}
        if "t5xxl" in p:
            comps["text_encoder_3"] = p["t5xxl"]
        return comps
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return _sd3_file(opts, path, header)
    if os.path.isdir(path):
        return _sd3_folder(opts, path, header)
    raise Unavailable(f"{src}: only SD3 .safetensors files (SAI layout), diffusers folders and the built-in "
                      "models are estimated")

def _sd3_separate(opts, which: str, header, record: dict | None):
    """The part a ``clip_l`` / ``clip_g`` / ``t5xxl`` file given replaces, as
    sd3_checkpoint._replace_separate builds it (``record``: the model source's config record);
    None when no such file is given."""
    given = getattr(opts, which)
    if not given:
        return None
    path = os.path.expanduser(given)
    shapes, _ = header(path)
    prefix = sd3_checkpoint.TE_PREFIX[which]
    if any(k.startswith(prefix) for k in shapes):
        shapes = {k[len(prefix):]: s for k, s in shapes.items() if k.startswith(prefix)}
    if which == "t5xxl":
        return fake_parts.t5_model(shapes, path)  # the run's t5_loader: the config from the shapes
    part = {k: fake_parts.Shape(s) for k, s in shapes.items()}
    return CLIPTextModelWithProjection(CLIPTextConfig(**sd3_checkpoint._clip_config(which, part, record, path)))


def _sd3_folder(opts, folder: str, header) -> dict:
    """A diffusers SD3 folder, as sd3_checkpoint._load_folder loads it: the transformer's weights
    (here meta tensors of the header's shapes) converted to SAI's layout and the MMDiT built from
    their shapes; the clip_l / clip_g / t5xxl / ae files replace its parts."""
    tdir = os.path.join(folder, "transformer")
    cfg_path = os.path.join(tdir, "config.json")
    if not os.path.isfile(cfg_path):
        raise Unavailable(f"{folder}: not a diffusers SD3 folder (no transformer/config.json)")
    meta = {k: torch.empty(s, device="meta") for k, s in fake_parts.folder_shapes(tdir, header).items()}
    cfg = sd3.config_from_state_dict(sd3_checkpoint.mmdit_from_diffusers(meta, tdir), folder)
    cfg = replace(cfg, sample_size=int(loading.read_json(cfg_path).get("sample_size", sd3.MMDiTConfig.sample_size)))
    comps: dict = {"unet": sd3.build_mmdit(cfg)}
    clip_configs = {which: loading.read_json(os.path.join(folder, sub, "config.json"))
                    for which, sub in (("clip_l", "text_encoder"), ("clip_g", "text_encoder_2"))}
    for name, which in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
        comps[name] = _sd3_separate(opts, which, header, clip_configs)
        if comps[name] is None:
            comps[name] = CLIPTextModelWithProjection(CLIPTextConfig(**clip_configs[which]))
    ae = sd3_ae_file(opts)
    ae_n = (fake_parts.header_numel(ae, "ae", header, "an SD3 folder") if ae
            else fake_parts.folder_numel(os.path.join(folder, "vae"), header))
    comps["vae"] = Counted(ae_n, "ae")
    t5_dir = os.path.join(folder, "text_encoder_3")
    t5_model = _sd3_separate(opts, "t5xxl", header, None)
    if t5_model is None and os.path.isdir(t5_dir):
        t5_model = fake_parts.t5_model(fake_parts.folder_shapes(t5_dir, header), t5_dir)
    if t5_model is not None:  # without T5: zero tokens in its place (the run has no third encoder)
        comps["text_encoder_3"] = t5_model
    return comps


def _sd3_file(opts, path: str, header) -> dict:
    """An SD3 single file in SAI's layout, as sd3_checkpoint._load_file loads it: what the file
    lacks from the clip_l / clip_g / t5xxl / ae files (which replace the file's own parts)."""
    shapes, meta = header(path)
    keys = {k: fake_parts.Shape(s) for k, s in shapes.items()}
    record = embedded_config.read_record(meta, sd3_checkpoint.META_KEY, path)
    cfg = sd3.config_from_state_dict(keys, path)
    comps: dict = {"unet": sd3.build_mmdit(cfg)}
    for name, which in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
        comps[name] = _sd3_separate(opts, which, header, record)
        if comps[name] is None:
            part = {k[len(sd3_checkpoint.TE_PREFIX[which]):]: v for k, v in keys.items()
                    if k.startswith(sd3_checkpoint.TE_PREFIX[which])}
            if not part:
                raise Unavailable(f"{path}: holds no {which} weights; give the {which} file (--{which})")
            config = sd3_checkpoint._clip_config(which, part, record, path)
            comps[name] = CLIPTextModelWithProjection(CLIPTextConfig(**config))
    ae_file = sd3_ae_file(opts)
    if ae_file:
        ae_n = fake_parts.header_numel(ae_file, "ae", header, "an SD3 file")
    else:
        ae_n = sum(int(torch.Size(v.shape).numel()) for k, v in keys.items() if k.startswith(sd3_vae.PREFIX))
        if not ae_n:
            raise Unavailable(f"{path}: holds no vae weights; give the ae file (--ae)")
    comps["vae"] = Counted(ae_n, "ae")
    t5_prefix = sd3_checkpoint.TE_PREFIX["t5xxl"]
    t5_part = {k[len(t5_prefix):]: v.shape for k, v in keys.items() if k.startswith(t5_prefix)}
    t5_model = _sd3_separate(opts, "t5xxl", header, record)
    if t5_model is None and t5_part:
        t5_model = fake_parts.t5_model(t5_part, path)
    if t5_model is not None:  # without T5: zero tokens in its place (the run has no third encoder)
        comps["text_encoder_3"] = t5_model
    return comps


def memory_text_tokens(opts, comps: dict) -> tuple[int, int, int]:
    """(tokens, token width, pooled width) of the MMDiT's text input: CLIP's 77 and, with T5,
    T5's t5xxl_max_token_length (default 256), else 77 zero tokens (sd3_text.condition)."""
    unet = comps["unet"]
    tokens = (CLIP_TOKENS + (opts.t5xxl_max_token_length or SD3_T5_MAX_LENGTH) if "text_encoder_3" in comps
              else TOKENS_WITHOUT_T5)
    return tokens, unet.config.context_dim, unet.config.adm_in_channels


def memory_family_model(opts, comps: dict, text_encoders: list) -> SD3FamilyModel:
    """The run's family model over the fake MMDiT (no tokenizers: the estimate encodes no text)."""
    return SD3FamilyModel(comps["unet"], text_encoders, [])


def memory_conditioning(opts, comps: dict, batch: int, dtype) -> TextConditioning:
    """One micro-step's text input: zeros of the context's and the pooled vector's shapes."""
    tokens, width, pooled = memory_text_tokens(opts, comps)
    return TextConditioning(torch.zeros(batch, tokens, width, dtype=dtype), torch.zeros(batch, pooled, dtype=dtype))


def memory_text_entry_bytes(opts, comps: dict, text_dtype_bytes: int, partial: bool) -> int:
    """A full cache entry holds the context (CLIP's 77 tokens, then T5's, in the CLIP encoders'
    dtype) and the pooled CLIP-L|G; a partial one only the tokens after CLIP's 77: T5's states,
    or without T5 77 float32 zero tokens (sd3_text.t5_tokens_part)."""
    tokens, width, pooled = memory_text_tokens(opts, comps)
    if not partial:
        return (tokens * width + pooled) * text_dtype_bytes
    if "text_encoder_3" not in comps:
        return CLIP_TOKENS * width * 4
    return (tokens - CLIP_TOKENS) * width * fake_parts.t5_output_bytes(comps["text_encoder_3"])
