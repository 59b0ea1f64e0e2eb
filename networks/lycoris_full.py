"""LyCORIS Native Fine-Tuning: ``network_module = "lycoris.kohya"`` with ``network_args algo=full``
(the kohya_ss GUI's "LyCORIS/Native Fine-Tuning" type), for SD1, SD2 and SDXL.

Every layer that LyCORIS' walk picks (its presets, its names: the network is lycoris.kohya's own)
is trained whole, and the file holds each layer's change from the base model: ``<name>.diff`` in the
weight's shape and ``<name>.diff_b`` in the bias' shape, the keys A1111 (network_full.py) and
ComfyUI (comfy/lora.py ``diff`` patches) add to the model's weights: ``W' = W + m * diff``.

The one difference from LyCORIS is the layer's forward: lycoris-lora 3.4's FullModule moves the
layer's weight into itself in ``apply_to`` and then calls the layer's own forward, which reads the
weight it no longer has. Here the forward applies the layer's operation to the trained weight and
bias, at a multiplier m other than 1 (network_multiplier, a dataset's multiplier, module dropout's
m = 0) to ``W0 + m * (W - W0)`` with the base W0 that LyCORIS keeps on the CPU. rank_dropout (which
LyCORIS' FullModule draws over the output rows and applies to the last axis) and neuron dropout
(which it ignores) are refused before any weight loads (library/training/network_options.py); the
run reaches this module through ``network_options.network_module_for``.
"""
from __future__ import annotations

import contextlib

import torch

# lycoris-lora is an optional extra (pyproject's `lycoris`); a run reaches this module only after
# importing lycoris.kohya (library/training/methods.py)
from lycoris import kohya as lycoris_kohya
from lycoris.modules.full import FullModule as LycorisFullModule

ALGO = "full"


class FullModule(LycorisFullModule):
    """LyCORIS' FullModule (its trained ``weight`` / ``bias`` hold the whole layer, its state dict
    the ``diff`` / ``diff_b`` from the base) whose forward is the layer's own operation on them."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        m = self.multiplier
        if self.module_dropout and self.training and torch.rand(1) < self.module_dropout:
            m = 0.0  # LyCORIS' module dropout: the layer as it was
        weight, bias = self.weight, self.bias
        if m != 1:
            w0 = self.org_weight.to(weight.device, weight.dtype)
            weight = w0 + m * (weight - w0)
            if bias is not None and self.org_bias is not None:
                b0 = self.org_bias[0].to(bias.device, bias.dtype)
                bias = b0 + m * (bias - b0)
        return self.op(x, weight, bias, **self.kw_dict)


@contextlib.contextmanager
def _our_full_module():
    """lycoris.kohya builds its modules from its algorithm table; for the time of one
    create_network its ``full`` entry is this module's FullModule."""
    table = lycoris_kohya.network_module_dict
    before = table[ALGO]
    table[ALGO] = FullModule
    try:
        yield
    finally:
        table[ALGO] = before


def create_network(multiplier, network_dim, network_alpha, vae, text_encoder, unet, **kwargs):
    """lycoris.kohya's create_network with algo=full, its layers trained by FullModule above."""
    kwargs = {**kwargs, "algo": ALGO}
    with _our_full_module():
        return lycoris_kohya.create_network(multiplier, network_dim, network_alpha, vae, text_encoder, unet,
                                            **kwargs)
