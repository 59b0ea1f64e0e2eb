"""sd-scripts' networks.lora_fa (LoRA-FA, arXiv 2308.03303) as a kohya network module.

A LoRA (networks/lora.py: the same network_args, module selection, names and file layout) whose
down projection is drawn once, ``normal(0, sqrt(2 / (in + rank)))`` as in sd-scripts, and frozen:
only ``lora_up`` trains. The frozen down is a buffer of the module, so it is saved
(``lora_down.weight``) and loaded like LoRA's but is never a parameter of the optimizer.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from networks import lora


class LoRAFAModule(lora.LoRAModule):
    def __init__(self, lora_name, org_module, multiplier=1.0, lora_dim=4, alpha=1.0, dropout=None,
                 rank_dropout=None, module_dropout=None):
        super().__init__(lora_name, org_module, multiplier, lora_dim, alpha, dropout, rank_dropout, module_dropout)
        in_dim = org_module.in_channels if isinstance(org_module, torch.nn.Conv2d) else org_module.in_features
        down = self.lora_down.weight.detach()
        torch.nn.init.normal_(down, std=math.sqrt(2.0 / (in_dim + self.lora_dim)))
        del self.lora_down.weight
        self.lora_down.register_buffer("weight", down)  # frozen: not a parameter


def check_network_args(kwargs: dict[str, Any]) -> None:
    lora.parse_network_args(dict(kwargs), "networks.lora_fa")


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae,
                   text_encoder, unet, neuron_dropout: Optional[float] = None, **kwargs):
    return lora.build_network(multiplier, network_dim, network_alpha, text_encoder, unet, neuron_dropout,
                              lora.parse_network_args(kwargs, "networks.lora_fa"), module_factory=LoRAFAModule)


def create_network_from_weights(multiplier: float, file: Optional[str], vae, text_encoder, unet, weights_sd=None,
                                for_inference: bool = False, **kwargs):
    if weights_sd is None:
        weights_sd = lora.load_state_dict_file(file)
    return lora.build_network_from_weights(multiplier, file, text_encoder, unet, weights_sd,
                                           lora.parse_network_args(kwargs, "networks.lora_fa"),
                                           module_factory=LoRAFAModule)
