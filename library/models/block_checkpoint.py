"""One transformer block's call under gradient checkpointing (FLUX.1's and SD3's blocks alike).

With checkpointing (in training mode, with grad) the block's activations are recomputed in the
backward; with ``cpu_offload_checkpointing`` (sd-scripts' option) the inputs the checkpoint saves
wait in host memory until the backward (pinned when the block runs on CUDA).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def call(block: nn.Module, args: tuple, *, checkpointing: bool, offload: bool):
    if checkpointing and block.training and torch.is_grad_enabled():
        if offload:  # the block's saved inputs wait on the host
            on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
            with torch.autograd.graph.save_on_cpu(pin_memory=on_cuda):
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
    block_swap: Any

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each block's activations in the backward (in training mode with grad)."""
        self.gradient_checkpointing = True

    def disable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = False

    def _call(self, block: nn.Module, *args):
        return call(block, args, checkpointing=self.gradient_checkpointing and self.training,
                    offload=self.cpu_offload_checkpointing)

    def _run(self, block: nn.Module, *args):
        if self.block_swap is not None:
            return self.block_swap.run(block, functools.partial(self._call, block), *args)
        return self._call(block, *args)
