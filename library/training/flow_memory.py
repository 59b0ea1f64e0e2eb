"""The memory estimate's FLUX.1 / SD3 parts (library/training/memory_estimate.py calls them): the
model on fake tensors, one micro-step's transformer inputs, the cached data's size, and what
``blocks_to_swap`` keeps off the device.

Sources, read from safetensors headers and config files only (no tensor data):

- the built-in models (``tiny-flux``, ``tiny-flux-schnell``, ``tiny-sd3*``, the full-size random
  ``sd3-arch`` / ``sd3.5-*-arch``) are built whole;
- a FLUX.1 transformer file in BFL's layout: built from its header (config_from_bfl on the
  shapes); CLIP-L built from its ``clip_l`` file's config (a LoRA's ``lora_te1_`` modules are on
  it); ``t5xxl`` / ``ae`` counted from their headers;
- a FLUX.1 diffusers folder: the transformer from ``transformer/config.json``, CLIP-L from
  ``text_encoder/config.json``, T5 and the autoencoder counted from ``text_encoder_2/`` and
  ``vae/``'s headers (or from the ``clip_l`` / ``t5xxl`` / ``ae`` files given);
- an SD3 single file (SAI layout): the MMDiT from the header's shapes (config_from_state_dict),
  CLIP-L / CLIP-G from the file's record or SD3's configs (as the loader picks them), T5 and the
  autoencoder counted from the file's (or the separate files') headers.

Parts known only by their size (``Counted``) are frozen, so only their bytes matter; a LoRA of
them (a FLUX LoRA's ``train_t5xxl``, an SD3 LoRA's T5) is not counted. SD3 diffusers folders are
not covered. The text encoders are frozen here: the transformer's inputs are the text encoders'
outputs (cached or computed without gradient), so only the transformer's forward saves tensors
for backward.
"""
from __future__ import annotations

import glob
import json
import os

import torch
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from library.models import (clip_l_file, flow_family, flux, flux_checkpoint, sd3, sd3_builtins, sd3_checkpoint,
                            sd3_vae, t5, tiny_flux)
from library.models.family import TextConditioning
from library.training import block_swap

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


T5_TIED = ("shared.weight", "encoder.embed_tokens.weight")  # one tensor in the model, two in some files


def _numel(shapes: dict) -> int:
    """Parameters of {name: shape}; T5's tied input embedding once (files may hold both names)."""
    tied = [k for k in shapes if k.endswith(T5_TIED[1]) and k[:-len(T5_TIED[1])] + T5_TIED[0] in shapes]
    return sum(int(torch.Size(s).numel()) for k, s in shapes.items() if k not in tied)


def _header_numel(path: str, option: str, header, source: str = "a single-file FLUX.1 transformer") -> int:
    if not path:
        raise Unavailable(f"{option}: required with {source}")
    shapes, _ = header(os.path.expanduser(path))
    return _numel(shapes)


def _folder_numel(folder: str, header) -> int:
    """The parameters of a diffusers / transformers component folder: its .safetensors headers."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise Unavailable(f"{folder}: no .safetensors weights to count")
    return _numel({f"{f}:{k}": s for f in files for k, s in header(f)[0].items()})


def _clip_l_of_file(path: str, header) -> nn.Module:
    """CLIP-L built from a ``clip_l`` file's config (its metadata's, else CLIP-L's), as load_clip_l builds it."""
    if not path:
        raise Unavailable("clip_l: required with a single-file FLUX.1 transformer")
    path = os.path.expanduser(path)
    _, meta = header(path)
    return CLIPTextModel(clip_l_file.clip_l_config(meta, path))


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise Unavailable(f"{path}: cannot read ({e})") from None


def _flux_file(opts, src: str, path: str, header) -> dict:
    shapes, meta = header(path)
    keys = {k: _Shape(s) for k, s in shapes.items()}
    if flux_checkpoint.layout_of(keys) != "bfl":
        raise Unavailable(f"{src}: only BFL-layout FLUX.1 files are estimated (and diffusers folders)")
    cfg = flux_checkpoint.config_from_bfl(keys, path, flux_checkpoint._meta_config(meta, path))
    return {"unet": flux.Flux(cfg), "vae": Counted(_header_numel(opts.ae, "ae", header), "ae"),
            "text_encoder": _clip_l_of_file(opts.clip_l, header),
            "text_encoder_2": Counted(_header_numel(opts.t5xxl, "t5xxl", header), "t5xxl")}


def _flux_folder(opts, folder: str, header) -> dict:
    """A diffusers FLUX.1 folder, as flux_loading._folder loads it (clip_l / t5xxl / ae files replace its parts)."""
    cfg_path = os.path.join(folder, "transformer", "config.json")
    if not os.path.isfile(cfg_path):
        raise Unavailable(f"{folder}: not a diffusers FLUX folder (no transformer/config.json)")
    cfg = flux_checkpoint.config_from_diffusers(_read_json(cfg_path), cfg_path)
    if opts.clip_l:
        clip = _clip_l_of_file(opts.clip_l, header)
    else:
        clip = CLIPTextModel(CLIPTextConfig(**_read_json(os.path.join(folder, "text_encoder", "config.json"))))
    t5_n = (_header_numel(opts.t5xxl, "t5xxl", header) if opts.t5xxl
            else _folder_numel(os.path.join(folder, "text_encoder_2"), header))
    ae_n = _header_numel(opts.ae, "ae", header) if opts.ae else _folder_numel(os.path.join(folder, "vae"), header)
    return {"unet": flux.Flux(cfg), "vae": Counted(ae_n, "ae"), "text_encoder": clip,
            "text_encoder_2": Counted(t5_n, "t5xxl")}


def _sd3_file(opts, path: str, header) -> dict:
    """An SD3 single file in SAI's layout, as sd3_checkpoint._load_file loads it: what the file
    lacks from the clip_l / clip_g / t5xxl / ae files (which replace the file's own parts)."""
    shapes, meta = header(path)
    keys = {k: _Shape(s) for k, s in shapes.items()}
    record = _read_json_text(meta.get(sd3_checkpoint.META_KEY), path)
    cfg = sd3.config_from_state_dict(keys, path)
    comps: dict = {"unet": sd3.build_mmdit(cfg)}
    for name, which in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
        separate = getattr(opts, which)
        if separate:
            separate = os.path.expanduser(separate)
            s_shapes, s_meta = header(separate)
            part = {k: _Shape(v) for k, v in s_shapes.items()}
            part_record, part_src = _read_json_text(s_meta.get(sd3_checkpoint.META_KEY), separate), separate
        else:
            part = {k[len(sd3_checkpoint.TE_PREFIX[which]):]: v for k, v in keys.items()
                    if k.startswith(sd3_checkpoint.TE_PREFIX[which])}
            part_record, part_src = record, path
            if not part:
                raise Unavailable(f"{path}: holds no {which} weights; give the {which} file (--{which})")
        config = sd3_checkpoint._clip_config(which, part, part_record, part_src)
        comps[name] = CLIPTextModelWithProjection(CLIPTextConfig(**config))
    if opts.ae:
        ae_n = _header_numel(opts.ae, "ae", header, "an SD3 file")
    else:
        ae_n = sum(int(torch.Size(v.shape).numel()) for k, v in keys.items() if k.startswith(sd3_vae.PREFIX))
        if not ae_n:
            raise Unavailable(f"{path}: holds no vae weights; give the ae file (--ae)")
    comps["vae"] = Counted(ae_n, "ae")
    t5_prefix = sd3_checkpoint.TE_PREFIX["t5xxl"]
    t5_n = (_header_numel(opts.t5xxl, "t5xxl", header, "an SD3 file") if opts.t5xxl else
            _numel({k: v.shape for k, v in keys.items() if k.startswith(t5_prefix)}))
    if t5_n:  # without T5: zero tokens in its place (the run has no third encoder)
        comps["text_encoder_3"] = Counted(t5_n, "t5xxl")
    return comps


def _read_json_text(text, path: str):
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise Unavailable(f"{path}: metadata {sd3_checkpoint.META_KEY} is not valid JSON") from None


def fake_components(opts, family: str, header) -> dict:
    """{unet, vae, text_encoder, text_encoder_2[, text_encoder_3]} on fake tensors; ``header(path)
    -> ({name: shape}, metadata)`` reads a safetensors header."""
    src = opts.pretrained_model_name_or_path
    path = os.path.expanduser(str(src))
    if family == "flux":
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
    if src in {**sd3_builtins.NAMES, **sd3_builtins.ARCH_NAMES} and not os.path.exists(path):
        p = sd3_builtins.build_builtin(src)
        comps = {"unet": p["mmdit"], "vae": p["vae"], "text_encoder": p["clip_l"], "text_encoder_2": p["clip_g"]}
        if "t5xxl" in p:
            comps["text_encoder_3"] = p["t5xxl"]
        return comps
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return _sd3_file(opts, path, header)
    raise Unavailable(f"{src}: SD3 diffusers folders are not estimated yet (SAI-layout .safetensors files "
                      "and the built-in SD3 models are)")


class _Shape:
    def __init__(self, shape):
        self.shape = tuple(shape)


def latent_shape(bucket) -> tuple:
    w, h = bucket
    return (LATENT_CHANNELS, h // 8, w // 8)


def text_tokens(opts, unet, with_t5: bool) -> tuple[int, int, int]:
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


def forward(opts, unet, noisy, dtype, with_t5: bool):
    """The transformer's forward of one micro-step, as the family model calls it."""
    b = noisy.shape[0]
    tokens, width, pooled = text_tokens(opts, unet, with_t5)
    hidden = torch.zeros(b, tokens, width, dtype=dtype)
    vec = torch.zeros(b, pooled, dtype=dtype)
    t = torch.full((b,), 0.5)
    if isinstance(unet, flux.Flux):
        fm = flow_family.FluxFamilyModel(unet, [], [], t5_max_length=tokens,
                                         guidance_scale=opts.guidance_scale,
                                         apply_t5_attn_mask=opts.apply_t5_attn_mask)
        cond = flow_family.FluxTextConditioning(hidden, vec, torch.ones(b, tokens, dtype=torch.long))
        return fm.unet_forward(noisy, t, cond)
    fm = flow_family.SD3FamilyModel(unet, [], [])
    return fm.unet_forward(noisy, t * 1000, TextConditioning(hidden, vec))


def checkpoint_with(unet, checkpointed) -> None:
    """Gradient checkpointing through the estimate's counter: each block's forward runs inside
    ``checkpointed(fn, *args)`` (the model's own checkpoint call replaced)."""
    unet.enable_gradient_checkpointing()
    unet._call = lambda block, *args: checkpointed(block, *args)


def cached_bytes(opts, items, tset, unet, text_dtype_bytes: int, with_t5: bool) -> int:
    """Latents (float32) and text-encoder outputs of the cache stage."""
    total = 0
    if opts.cache_latents or opts.cache_latents_to_disk:
        for it in items:
            c, h, w = latent_shape(it.bucket)
            total += (2 if it.flip_aug else 1) * c * h * w * 4
    if opts.cache_text_encoder_outputs or opts.cache_text_encoder_outputs_to_disk:
        captions = set()
        for it in items:
            captions.update(tset.caption_variants(it))
        tokens, width, pooled = text_tokens(opts, unet, with_t5)
        total += len(captions) * (tokens * width + pooled) * text_dtype_bytes
    return total


def swap_line(opts, unet) -> str | None:
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
