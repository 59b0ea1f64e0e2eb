"""The memory estimate's FLUX.1 / SD3 parts (library/training/memory_estimate.py calls them): the
model on fake tensors, one micro-step's transformer inputs, the cached data's size, and what
``blocks_to_swap`` keeps off the device.

Sources, read from safetensors headers and config files only (no tensor data):

- the built-in models (``tiny-flux``, ``tiny-flux-schnell``, ``tiny-sd3*``, the full-size random
  ``sd3-arch`` / ``sd3.5-*-arch``) are built whole;
- a FLUX.1 transformer file in BFL's layout: built from its header (config_from_bfl on the
  shapes); CLIP-L built from its ``clip_l`` file's config (a LoRA's ``lora_te1_`` modules are on
  it); T5 from the ``t5xxl`` file's record or header shapes (as t5.load_t5 builds it), ``ae``
  counted from its header;
- a FLUX.1 diffusers folder: the transformer from ``transformer/config.json``, CLIP-L from
  ``text_encoder/config.json``, T5 from ``text_encoder_2/config.json``, the autoencoder counted
  from ``vae/``'s headers (or from the ``clip_l`` / ``t5xxl`` / ``ae`` files given);
- an SD3 single file (SAI layout): the MMDiT from the header's shapes (config_from_state_dict),
  CLIP-L / CLIP-G from the file's record or SD3's configs (as the loader picks them), T5 from the
  file's (or the ``t5xxl`` file's) shapes, the autoencoder counted from the file's (or the ``ae``
  file's) header;
- an SD3 diffusers folder: the MMDiT from ``transformer/``'s headers, converted to SAI's layout
  on meta tensors (mmdit_from_diffusers, as the loader converts the weights), CLIP-L / CLIP-G
  from ``text_encoder/`` and ``text_encoder_2/``'s configs, T5 from ``text_encoder_3/``'s shapes,
  the autoencoder counted from ``vae/``'s headers (or the ``clip_l`` / ``clip_g`` / ``t5xxl`` /
  ``ae`` files given, which replace those parts as in the loader).

The T5 encoder is built as the run builds it, so a LoRA's T5 modules (``train_t5xxl``) are
counted. Parts known only by their size (``Counted``: the autoencoders) are frozen, so only their
bytes matter. The text encoders' forward is not counted: the transformer's inputs are the text
encoders' outputs (cached or, for frozen encoders, computed without gradient), so only the
transformer's forward saves tensors for backward (a LoRA on the text encoders adds their saved
activations, not counted).
"""
from __future__ import annotations

import glob
import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from library.config.parse import required
from library.models import (clip_l_file, embedded_config, flow_family, flux, flux_checkpoint, loading, sd3,
                            sd3_builtins, sd3_checkpoint, sd3_vae, t5, tiny_flux)
from library.models.families import registry
from library.models.family import TextConditioning
from library.training import block_swap

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

LATENT_CHANNELS = 16  # both families' autoencoders
SD3_CLIP_TOKENS = 77
SD3_TOKENS = 2 * SD3_CLIP_TOKENS  # without T5: 77 zero tokens in its place (sd3_text.condition)


class Unavailable(Exception):
    """This FLUX / SD3 source is not covered by the estimate (one line)."""


class Counted(nn.Module):
    """A frozen part known only by its size (from a file header): one flat parameter."""

    def __init__(self, numel: int, name: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(numel), requires_grad=False)
        self.source = name


def _numel(shapes: dict) -> int:
    """Parameters of {name: shape} (an autoencoder's: no tied tensors)."""
    return sum(int(torch.Size(s).numel()) for s in shapes.values())


def _header_numel(path: str, option: str, header, source: str = "a single-file FLUX.1 transformer") -> int:
    if not path:
        raise Unavailable(f"{option}: required with {source}")
    shapes, _ = header(os.path.expanduser(path))
    return _numel(shapes)


def _folder_shapes(folder: str, header) -> dict:
    """{name: shape} of a diffusers / transformers component folder (all its .safetensors shards)."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise Unavailable(f"{folder}: no .safetensors weights to count")
    return {k: s for f in files for k, s in header(f)[0].items()}


def _folder_numel(folder: str, header) -> int:
    """The parameters of a diffusers / transformers component folder: its .safetensors headers."""
    return _numel(_folder_shapes(folder, header))


def _t5(shapes: dict, path: str, config: dict | None = None) -> nn.Module:
    """T5 as t5.model_from_state_dict builds it: a T5EncoderModel of ``config``, else of the
    config the weights' shapes give."""
    cfg = config or t5.config_from_state_dict({k: _Shape(s) for k, s in shapes.items()}, path)
    return T5EncoderModel(T5Config(**cfg))


def _t5_file(path: str, header, source: str) -> nn.Module:
    """A FLUX.1 run's ``t5xxl`` file, as t5.load_t5 builds it (its record's config, else its shapes')."""
    if not path:
        raise Unavailable(f"t5xxl: required with {source}")
    path = os.path.expanduser(path)
    shapes, meta = header(path)
    record = embedded_config.read_record(meta, t5.META_CONFIG_KEY, path)
    return _t5(shapes, path, (record or {}).get("config"))


def _clip_l_of_file(path: str, header) -> nn.Module:
    """CLIP-L built from a ``clip_l`` file's config (its metadata's, else CLIP-L's), as load_clip_l builds it."""
    if not path:
        raise Unavailable("clip_l: required with a single-file FLUX.1 transformer")
    path = os.path.expanduser(path)
    _, meta = header(path)
    return CLIPTextModel(clip_l_file.clip_l_config(meta, path))


def _flux_file(opts: Options, src: str, path: str, header) -> dict:
    shapes, meta = header(path)
    keys = {k: _Shape(s) for k, s in shapes.items()}
    if flux_checkpoint.layout_of(keys) != "bfl":
        raise Unavailable(f"{src}: only BFL-layout FLUX.1 files are estimated (and diffusers folders)")
    cfg = flux_checkpoint.config_from_bfl(keys, path, flux_checkpoint._meta_config(meta, path))
    return {"unet": flux.Flux(cfg),
            "vae": Counted(_header_numel(required(opts.ae, "ae"), "ae", header), "ae"),
            "text_encoder": _clip_l_of_file(required(opts.clip_l, "clip_l"), header),
            "text_encoder_2": _t5_file(required(opts.t5xxl, "t5xxl"), header,
                                       "a single-file FLUX.1 transformer")}


def _flux_folder(opts: Options, folder: str, header) -> dict:
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
        t5_model = _t5_file(opts.t5xxl, header, "a FLUX.1 folder")
    else:
        t5_model = T5EncoderModel(T5Config(**loading.read_json(os.path.join(folder, "text_encoder_2", "config.json"))))
    ae_n = _header_numel(opts.ae, "ae", header) if opts.ae else _folder_numel(os.path.join(folder, "vae"), header)
    return {"unet": flux.Flux(cfg), "vae": Counted(ae_n, "ae"), "text_encoder": clip, "text_encoder_2": t5_model}


def _sd3_separate(opts: Options, which: str, header, record: dict | None):
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
        return _t5(shapes, path)  # the run's t5_loader: the config from the shapes
    part = {k: _Shape(s) for k, s in shapes.items()}
    return CLIPTextModelWithProjection(CLIPTextConfig(**sd3_checkpoint._clip_config(which, part, record, path)))


def _sd3_folder(opts: Options, folder: str, header) -> dict:
    """A diffusers SD3 folder, as sd3_checkpoint._load_folder loads it: the transformer's weights
    (here meta tensors of the header's shapes) converted to SAI's layout and the MMDiT built from
    their shapes; the clip_l / clip_g / t5xxl / ae files replace its parts."""
    tdir = os.path.join(folder, "transformer")
    cfg_path = os.path.join(tdir, "config.json")
    if not os.path.isfile(cfg_path):
        raise Unavailable(f"{folder}: not a diffusers SD3 folder (no transformer/config.json)")
    meta = {k: torch.empty(s, device="meta") for k, s in _folder_shapes(tdir, header).items()}
    cfg = sd3.config_from_state_dict(sd3_checkpoint.mmdit_from_diffusers(meta, tdir), folder)
    cfg = replace(cfg, sample_size=int(loading.read_json(cfg_path).get("sample_size", sd3.MMDiTConfig.sample_size)))
    comps: dict = {"unet": sd3.build_mmdit(cfg)}
    clip_configs = {which: loading.read_json(os.path.join(folder, sub, "config.json"))
                    for which, sub in (("clip_l", "text_encoder"), ("clip_g", "text_encoder_2"))}
    for name, which in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
        comps[name] = _sd3_separate(opts, which, header, clip_configs)
        if comps[name] is None:
            comps[name] = CLIPTextModelWithProjection(CLIPTextConfig(**clip_configs[which]))
    ae = flow_family.sd3_ae_file(opts)
    ae_n = (_header_numel(ae, "ae", header, "an SD3 folder") if ae
            else _folder_numel(os.path.join(folder, "vae"), header))
    comps["vae"] = Counted(ae_n, "ae")
    t5_dir = os.path.join(folder, "text_encoder_3")
    t5_model = _sd3_separate(opts, "t5xxl", header, None)
    if t5_model is None and os.path.isdir(t5_dir):
        t5_model = _t5(_folder_shapes(t5_dir, header), t5_dir)
    if t5_model is not None:  # without T5: zero tokens in its place (the run has no third encoder)
        comps["text_encoder_3"] = t5_model
    return comps


def _sd3_file(opts: Options, path: str, header) -> dict:
    """An SD3 single file in SAI's layout, as sd3_checkpoint._load_file loads it: what the file
    lacks from the clip_l / clip_g / t5xxl / ae files (which replace the file's own parts)."""
    shapes, meta = header(path)
    keys = {k: _Shape(s) for k, s in shapes.items()}
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
    ae_file = flow_family.sd3_ae_file(opts)
    if ae_file:
        ae_n = _header_numel(ae_file, "ae", header, "an SD3 file")
    else:
        ae_n = sum(int(torch.Size(v.shape).numel()) for k, v in keys.items() if k.startswith(sd3_vae.PREFIX))
        if not ae_n:
            raise Unavailable(f"{path}: holds no vae weights; give the ae file (--ae)")
    comps["vae"] = Counted(ae_n, "ae")
    t5_prefix = sd3_checkpoint.TE_PREFIX["t5xxl"]
    t5_part = {k[len(t5_prefix):]: v.shape for k, v in keys.items() if k.startswith(t5_prefix)}
    t5_model = _sd3_separate(opts, "t5xxl", header, record)
    if t5_model is None and t5_part:
        t5_model = _t5(t5_part, path)
    if t5_model is not None:  # without T5: zero tokens in its place (the run has no third encoder)
        comps["text_encoder_3"] = t5_model
    return comps


def fake_components(opts: Options, family: str, header) -> dict:
    """{unet, vae, text_encoder, text_encoder_2[, text_encoder_3]} on fake tensors; ``header(path)
    -> ({name: shape}, metadata)`` reads a safetensors header."""
    if family not in _FAKES:
        raise Unavailable(f"{opts.pretrained_model_name_or_path}: no memory estimate for "
                          f"{registry.get(family).title} models yet")
    return _FAKES[family](opts, header)


def _flux_fakes(opts: Options, header) -> dict:
    src = required(opts.pretrained_model_name_or_path, "pretrained_model_name_or_path")
    path = os.path.expanduser(str(src))
    if src in tiny_flux.TINY_FLUX_NAMES and not os.path.exists(path):
        p = tiny_flux.build_tiny_flux(tiny_flux.TINY_FLUX_NAMES[src])
        return {"unet": p["transformer"], "vae": p["ae"], "text_encoder": p["clip_l"],
                "text_encoder_2": p["t5"]}
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return _flux_file(opts, src, path, header)
    if os.path.isdir(path):
        return _flux_folder(opts, path, header)
    raise Unavailable(f"{src}: only FLUX.1 .safetensors files, diffusers folders and the built-in "
                      "models are estimated")


def _sd3_fakes(opts: Options, header) -> dict:
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


# the fake parts of each flow family's models (the memory estimate's; library/models/families/)
_FAKES = {"flux": _flux_fakes, "sd3": _sd3_fakes}


class _Shape:
    def __init__(self, shape):
        self.shape = tuple(shape)


def latent_shape(bucket) -> tuple:
    w, h = bucket
    return (LATENT_CHANNELS, h // 8, w // 8)


def text_tokens(opts: Options, unet, with_t5: bool) -> tuple[int, int, int]:
    """(tokens, token width, pooled width) of the transformer's text input (FLUX.1: T5's
    t5xxl_max_token_length, by default dev's 512 or schnell's 256; SD3: CLIP's 77 and, ``with_t5``,
    T5's t5xxl_max_token_length (default 256), else 77 zero tokens: sd3_text.condition)."""
    if isinstance(unet, flux.Flux):
        length = opts.t5xxl_max_token_length or t5.T5_MAX_LENGTH[
            "dev" if unet.config.guidance_embed else "schnell"]
        return length, unet.config.context_in_dim, unet.config.vec_in_dim
    tokens = SD3_CLIP_TOKENS + (opts.t5xxl_max_token_length or flow_family.SD3_T5_MAX_LENGTH) if with_t5 \
        else SD3_TOKENS
    return tokens, unet.config.context_dim, unet.config.adm_in_channels


def forward(opts: Options, unet, noisy, dtype, with_t5: bool):
    """The transformer's forward of one micro-step, as the family model calls it."""
    b = noisy.shape[0]
    tokens, width, pooled = text_tokens(opts, unet, with_t5)
    hidden = torch.zeros(b, tokens, width, dtype=dtype)
    vec = torch.zeros(b, pooled, dtype=dtype)
    t = torch.full((b,), 0.5)
    fm = family_model(opts, unet, [])
    if isinstance(unet, flux.Flux):
        cond = flow_family.FluxTextConditioning(hidden, vec, torch.ones(b, tokens, dtype=torch.long))
        return fm.unet_forward(noisy, t, cond)
    return fm.unet_forward(noisy, t * 1000, TextConditioning(hidden, vec))


def family_model(opts: Options, unet, text_encoders: list):
    """The run's family model over the fake transformer (no tokenizers: the estimate encodes no text)."""
    if isinstance(unet, flux.Flux):
        return flow_family.FluxFamilyModel(unet, text_encoders, [], t5_max_length=text_tokens(opts, unet, True)[0],
                                           guidance_scale=opts.guidance_scale,
                                           apply_t5_attn_mask=opts.apply_t5_attn_mask)
    return flow_family.SD3FamilyModel(unet, text_encoders, [])


def checkpoint_with(unet, checkpointed) -> None:
    """Gradient checkpointing through the estimate's counter: each block's forward runs inside
    ``checkpointed(fn, *args)`` (the model's own checkpoint call replaced)."""
    unet.enable_gradient_checkpointing()
    unet._call = lambda block, *args: checkpointed(block, *args)


def t5_output_bytes(t5_model) -> int:
    """Bytes per element of T5's output states: transformers' T5LayerNorm returns its weight's
    dtype (a float32 T5 under bf16 autocast gives float32 states, a bf16 or fp8-stored one the
    compute dtype, which its norm weights are kept in)."""
    return t5_model.encoder.final_layer_norm.weight.element_size()


def text_entry_bytes(opts: Options, comps, text_dtype_bytes: int, partial: bool) -> int:
    """One caption's entry in the text-encoder cache (library/data/text_cache.py), as the family
    model's ``encode`` (full) or ``encode_frozen_part`` (``partial``) makes it.
    FLUX.1: T5's states (tokens x width, in T5's output dtype) and its attention mask (int64),
    and in a full cache CLIP-L's pooled output. SD3: a full cache holds the context (CLIP's 77
    tokens, then T5's, in the CLIP encoders' dtype) and the pooled CLIP-L|G; a partial one only
    the tokens after CLIP's 77: T5's states, or without T5 77 float32 zero tokens
    (sd3_text.t5_tokens_part). ``text_dtype_bytes``: the frozen encoders' compute dtype."""
    unet = comps["unet"]
    with_t5 = "text_encoder_3" in comps
    tokens, width, pooled = text_tokens(opts, unet, with_t5)
    if isinstance(unet, flux.Flux):
        states = tokens * width * t5_output_bytes(comps["text_encoder_2"])
        return states + tokens * 8 + (0 if partial else pooled * text_dtype_bytes)
    if not partial:
        return (tokens * width + pooled) * text_dtype_bytes
    if not with_t5:
        return SD3_CLIP_TOKENS * width * 4
    return (tokens - SD3_CLIP_TOKENS) * width * t5_output_bytes(comps["text_encoder_3"])


def swap_line(opts: Options, unet) -> str | None:
    """What blocks_to_swap keeps off the compute device: the swapped blocks' weights, less the
    two-block window (library/training/block_swap.py)."""
    n = opts.blocks_to_swap or 0
    if not n:
        return None
    blocks = block_swap.blocks_for(unet, n)
    sizes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]
    window = max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes))
    gib = 1024 ** 3
    return (f"blocks_to_swap {n}: {len(blocks)} blocks, {sum(sizes) / gib:.3f} GiB of the "
            f"transformer's weights in host memory, at most {window / gib:.3f} GiB of them on the "
            f"device at once (on CUDA the device holds {(sum(sizes) - window) / gib:.3f} GiB less "
            "than the total above; on the CPU host and device are one memory)")
