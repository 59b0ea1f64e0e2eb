"""The memory estimate's flow-family parts (library/training/memory_estimate.py calls them): the
model on fake tensors, one micro-step's transformer inputs, the cached data's size, and what
``blocks_to_swap`` keeps off the device.

Each family's home builds its own fakes from safetensors headers and config files (no tensor
data): its ``memory_parts``, ``memory_family_model``, ``memory_conditioning``,
``memory_text_tokens`` and ``memory_text_entry_bytes`` hooks (docs/FAMILIES.md; the helpers they
share are library/models/fake_parts.py). The T5 encoder is built as the run builds it, so a LoRA's
T5 modules (``train_t5xxl``) are counted. Parts known only by their size (``Counted``: the
autoencoders) are frozen, so only their bytes matter. The text encoders' forward is not counted:
the transformer's inputs are the text encoders' outputs (cached or, for frozen encoders, computed
without gradient), so only the transformer's forward saves tensors for backward (a LoRA on the
text encoders adds their saved activations, not counted).
"""
from __future__ import annotations

import torch

from library.models.families import registry
from library.training import block_swap

LATENT_CHANNELS = 16  # the flow families' autoencoders


def fake_components(opts, family: str, header) -> dict:
    """{unet, vae, text_encoder, text_encoder_2[, text_encoder_3]} on fake tensors (the family's
    ``memory_parts``); ``header(path) -> ({name: shape}, metadata)`` reads a safetensors header.
    Raises library/models/fake_parts.py's Unavailable for a source the estimate does not cover."""
    return registry.home(family).memory_parts(opts, header)


def latent_shape(bucket) -> tuple:
    w, h = bucket
    return (LATENT_CHANNELS, h // 8, w // 8)


def text_tokens(opts, family: str, comps: dict) -> tuple[int, int, int]:
    """(tokens, token width, pooled width) of the transformer's text input (the family's
    ``memory_text_tokens``)."""
    return registry.home(family).memory_text_tokens(opts, comps)


def forward(opts, family: str, comps: dict, noisy, dtype):
    """The transformer's forward of one micro-step, as the family model calls it: the text
    input of the family's shapes, the noise level 0.5 in the model's timestep units."""
    b = noisy.shape[0]
    home = registry.home(family)
    cond = home.memory_conditioning(opts, comps, b, dtype)
    spec = registry.get(family).flow
    if spec is None:
        raise ValueError(f"{family}: not a flow family")
    t = torch.full((b,), 0.5) * spec.timestep_scale
    return home.memory_family_model(opts, comps, []).unet_forward(noisy, t, cond)


def family_model(opts, family: str, comps: dict, text_encoders: list):
    """The run's family model over the fake transformer (no tokenizers: the estimate encodes no text)."""
    return registry.home(family).memory_family_model(opts, comps, text_encoders)


def checkpoint_with(unet, checkpointed) -> None:
    """Gradient checkpointing through the estimate's counter: each block's forward runs inside
    ``checkpointed(fn, *args)`` (the model's own checkpoint call replaced)."""
    unet.enable_gradient_checkpointing()
    unet._call = lambda block, *args: checkpointed(block, *args)


def text_entry_bytes(opts, family: str, comps: dict, text_dtype_bytes: int, partial: bool) -> int:
    """One caption's entry in the text-encoder cache (library/data/text_cache.py), as the family
    model's ``encode`` (full) or ``encode_frozen_part`` (``partial``) makes it (the family's
    ``memory_text_entry_bytes``); ``text_dtype_bytes``: the frozen encoders' compute dtype."""
    return registry.home(family).memory_text_entry_bytes(opts, comps, text_dtype_bytes, partial)


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
