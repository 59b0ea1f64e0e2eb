"""One transformer block's call under gradient checkpointing (FLUX.1's and SD3's blocks alike).

With checkpointing (in training mode, with grad) the block's activations are recomputed in the
backward; with ``cpu_offload_checkpointing`` (sd-scripts' option) the inputs the checkpoint saves
wait in host memory until the backward (pinned when the block runs on CUDA); with
``unsloth_offload_checkpointing`` (sd-scripts' Anima option) only the block's first input, the
hidden state, does, copied there and back without blocking (pinned on CUDA; the copies are ordered
on the compute stream): the inputs shared by every block (time embedding, text context, RoPE)
stay where they are.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (pinned, written without blocking, when ``t`` is on CUDA)."""
    host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=t.is_cuda)
    host.copy_(t, non_blocking=t.is_cuda)
    return host


def _first_on_host(first: torch.Tensor):
    """Saved-tensor hooks that keep ``first`` (the block's hidden state) on the host until the
    backward needs it; every other saved tensor is kept as it is."""
    def is_first(t: torch.Tensor) -> bool:
        return t is first or (t.data_ptr() == first.data_ptr() and t.shape == first.shape
                              and t.dtype == first.dtype and t.device == first.device)

    def pack(t):
        return (t.device, _to_host(t)) if is_first(t) else (None, t)

    def unpack(packed):
        device, t = packed
        return t if device is None else t.to(device, non_blocking=device.type == "cuda")

    return pack, unpack


def call(block: nn.Module, args: tuple, *, checkpointing: bool, offload: bool, offload_first: bool = False):
    if checkpointing and block.training and torch.is_grad_enabled():
        if offload:  # the block's saved inputs wait on the host
            on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
            with torch.autograd.graph.save_on_cpu(pin_memory=on_cuda):
                return checkpoint(block, *args, use_reentrant=False)
        if offload_first:  # only its hidden state waits on the host
            with torch.autograd.graph.saved_tensors_hooks(*_first_on_host(args[0])):
                return checkpoint(block, *args, use_reentrant=False)
        return checkpoint(block, *args, use_reentrant=False)
    return block(*args)


class CheckpointedBlocks:
    """The switches of a transformer whose blocks run through ``_run`` (mixed into the nn.Module,
    which sets gradient_checkpointing, cpu_offload_checkpointing and block_swap: library/training/
    block_swap.py's streamer or None). ``_call`` is one block's call under checkpointing; the
    memory estimate replaces it on the instance (library/training/flow_memory.py)."""

    training: bool  # nn.Module's
    gradient_checkpointing: bool
    cpu_offload_checkpointing: bool
    unsloth_offload_checkpointing: bool = False  # Anima's (sd-scripts' anima scripts)
    block_swap: Any

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each block's activations in the backward (in training mode with grad)."""
        self.gradient_checkpointing = True

    def disable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = False

    def _call(self, block: nn.Module, *args):
        return call(block, args, checkpointing=self.gradient_checkpointing and self.training,
                    offload=self.cpu_offload_checkpointing, offload_first=self.unsloth_offload_checkpointing)

    def _run(self, block: nn.Module, *args):
        if self.block_swap is not None:
            return self.block_swap.run(block, functools.partial(self._call, block), *args)
        return self._call(block, *args)
