"""The memory estimate's FLUX.1 / SD3 parts (library/training/memory_estimate.py calls them): the
model on fake tensors, one micro-step's transformer inputs, the cached data's size, and what
``blocks_to_swap`` keeps off the device.

Sources: the built-in models (``tiny-flux``, ``tiny-flux-schnell``, ``tiny-sd3*``, the
full-size random ``sd3-arch`` / ``sd3.5-*-arch``) are built whole; a FLUX.1 transformer file in
BFL's layout is built from its safetensors header (config_from_bfl on the shapes), and its
``clip_l`` / ``t5xxl`` / ``ae`` files are counted from their headers (frozen parts: only their
size matters). Other FLUX / SD3 sources (diffusers folders, SD3 single files) are not covered yet.
The text encoders are frozen here: the transformer's inputs are the text encoders' outputs (cached
or computed without gradient), so only the transformer's forward saves tensors for backward.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from library.models import flow_family, flux, flux_checkpoint, sd3_builtins, t5, tiny_flux
from library.models.family import TextConditioning
from library.training import block_swap

LATENT_CHANNELS = 16  # both families' autoencoders
SD3_TOKENS = 154  # 77 CLIP tokens + 77 zero tokens in T5's place (sd3_text.condition)


class Unavailable(Exception):
    """This FLUX / SD3 source is not covered by the estimate (one line)."""


class Counted(nn.Module):
    """A frozen part known only by its size (from a file header): one flat parameter."""

    def __init__(self, numel: int, name: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(numel), requires_grad=False)
        self.source = name


def _header_numel(path: str, option: str, header) -> int:
    if not path:
        raise Unavailable(f"{option}: required with a single-file FLUX.1 transformer")
    shapes, _ = header(os.path.expanduser(path))
    return sum(int(torch.Size(s).numel()) for s in shapes.values())


def fake_components(opts, family: str, header) -> dict:
    """{unet, vae, text_encoder, text_encoder_2} on fake tensors; ``header(path) -> ({name:
    shape}, metadata)`` reads a safetensors header."""
    src = opts.pretrained_model_name_or_path
    path = os.path.expanduser(str(src))
    if family == "flux":
        if src in tiny_flux.TINY_FLUX_NAMES and not os.path.exists(path):
            variant = tiny_flux.TINY_FLUX_NAMES[src]
            p = tiny_flux.build_tiny_flux(variant)
            comps = {"unet": p["transformer"], "vae": p["ae"], "text_encoder": p["clip_l"],
                     "text_encoder_2": p["t5"]}
        elif os.path.isfile(path) and path.endswith(".safetensors"):
            shapes, meta = header(path)
            keys = {k: _Shape(s) for k, s in shapes.items()}
            if flux_checkpoint.layout_of(keys) != "bfl":
                raise Unavailable(f"{src}: only BFL-layout FLUX.1 files are estimated")
            cfg = flux_checkpoint.config_from_bfl(keys, path, flux_checkpoint._meta_config(meta, path))
            variant = flux_checkpoint.variant_of(keys)
            comps = {"unet": flux.Flux(cfg),
                     "vae": Counted(_header_numel(opts.ae, "ae", header), "ae"),
                     "text_encoder": Counted(_header_numel(opts.clip_l, "clip_l", header), "clip_l"),
                     "text_encoder_2": Counted(_header_numel(opts.t5xxl, "t5xxl", header), "t5xxl")}
        else:
            raise Unavailable(f"{src}: FLUX.1 diffusers folders are not estimated yet (BFL files and "
                              "the built-in models are)")
        return comps
    if src in {**sd3_builtins.NAMES, **sd3_builtins.ARCH_NAMES} and not os.path.exists(path):
        p = sd3_builtins.build_builtin(src)
        return {"unet": p["mmdit"], "vae": p["vae"], "text_encoder": p["clip_l"],
                "text_encoder_2": p["clip_g"]}
    raise Unavailable(f"{src}: SD3 files are not estimated yet (the built-in SD3 models are)")


class _Shape:
    def __init__(self, shape):
        self.shape = tuple(shape)


def latent_shape(bucket) -> tuple:
    w, h = bucket
    return (LATENT_CHANNELS, h // 8, w // 8)


def text_tokens(opts, unet) -> tuple[int, int, int]:
    """(tokens, token width, pooled width) of the transformer's text input (FLUX.1: T5's
    t5xxl_max_token_length, by default dev's 512 or schnell's 256)."""
    if isinstance(unet, flux.Flux):
        length = opts.t5xxl_max_token_length or t5.T5_MAX_LENGTH[
            "dev" if unet.config.guidance_embed else "schnell"]
        return length, unet.config.context_in_dim, unet.config.vec_in_dim
    return SD3_TOKENS, unet.config.context_dim, unet.config.adm_in_channels


def forward(opts, unet, noisy, dtype):
    """The transformer's forward of one micro-step, as the family model calls it."""
    b = noisy.shape[0]
    tokens, width, pooled = text_tokens(opts, unet)
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


def cached_bytes(opts, items, tset, unet, text_dtype_bytes: int) -> int:
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
        tokens, width, pooled = text_tokens(opts, unet)
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
