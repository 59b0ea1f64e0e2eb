"""One transformer block's call under gradient checkpointing (FLUX.1's and SD3's blocks alike).

With checkpointing (in training mode, with grad) the block's activations are recomputed in the
backward; with ``cpu_offload_checkpointing`` (sd-scripts' option) the inputs the checkpoint saves
wait in host memory until the backward (pinned when the block runs on CUDA).
"""
from __future__ import annotations

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
