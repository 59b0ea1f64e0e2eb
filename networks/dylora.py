"""sd-scripts' networks.dylora (DyLoRA, arXiv 2210.07558) as a kohya network module.

network_args as sd-scripts reads them: ``unit`` (default 1; the rank must be a multiple of it),
``conv_dim`` (3x3 convs; sd-scripts requires it to equal network_dim), ``conv_alpha``,
``loraplus_*``. Module selection and names are those of networks.lora (SDXL: text encoders
``lora_te1`` / ``lora_te2``, where sd-scripts' DyLoRA names both ``lora_te`` and collides). The file
is a LoRA file (``lora_down``, ``lora_up``, ``alpha``); networks/extract_lora_from_dylora.py cuts
ranks out of it. sd-scripts' DyLoRA reads no dropout and no block-wise keys: the ones the kohya_ss
GUI writes for "Kohya DyLoRA" have no effect there, and are accepted here with a warning.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from networks import lora
from networks.adapter_modules import DyLoRAModule

logger = logging.getLogger("sdtk")

KNOWN = ("unit", "conv_dim", "conv_alpha", "loraplus_lr_ratio", "loraplus_unet_lr_ratio",
         "loraplus_text_encoder_lr_ratio")
IGNORED = ("rank_dropout", "module_dropout", "down_lr_weight", "mid_lr_weight", "up_lr_weight",
           "block_lr_zero_threshold", "block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas")


def _parse(kwargs: dict[str, Any]) -> tuple[dict[str, Any], int]:
    kwargs = dict(kwargs)
    for key in IGNORED:
        if key in kwargs:
            logger.warning(f"network_args: {key} has no effect on networks.dylora (sd-scripts' DyLoRA does not "
                           "read it)")
            kwargs.pop(key)
    if "conv_alpha" in kwargs and kwargs.get("conv_dim") is None:
        # the GUI writes conv_alpha whenever it is not 0; sd-scripts reads it only with conv_dim
        logger.warning("network_args: conv_alpha has no effect on networks.dylora without conv_dim")
        kwargs.pop("conv_alpha")
    unit = lora.parse_number("network_args: unit", kwargs.pop("unit", 1), int, 1)
    return lora.parse_network_args(kwargs, "networks.dylora", KNOWN[1:]), unit


def check_network_args(kwargs: dict[str, Any]) -> None:
    _parse(kwargs)


def _factory(unit: int):
    def make(lora_name, org_module, multiplier, dim, alpha, dropout, rank_dropout, module_dropout):
        if dim % unit:
            raise lora.LoRAError(f"networks.dylora: the rank {dim} of {lora_name} is not a multiple of "
                                 f"network_args unit={unit}")
        return DyLoRAModule(lora_name, org_module, multiplier, dim, alpha, unit)
    return make


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae,
                   text_encoder, unet, neuron_dropout: Optional[float] = None, **kwargs):
    args, unit = _parse(kwargs)
    dim = 4 if network_dim is None else network_dim
    if args.get("conv_dim") is not None and args["conv_dim"] != int(dim):
        raise lora.LoRAError(f"network_args: conv_dim={args['conv_dim']} for networks.dylora must equal "
                             f"network_dim={dim} (sd-scripts' rule)")
    if neuron_dropout:
        logger.warning("network_dropout has no effect on networks.dylora (sd-scripts' DyLoRA does not use it)")
    return lora.build_network(multiplier, network_dim, network_alpha, text_encoder, unet, None, args,
                              module_factory=_factory(unit), network_class=lora.AdapterNetwork)


def create_network_from_weights(multiplier: float, file: Optional[str], vae, text_encoder, unet, weights_sd=None,
                                for_inference: bool = False, **kwargs):
    if weights_sd is None:
        weights_sd = lora.load_state_dict_file(file)
    args, unit = _parse(kwargs)
    return lora.build_network_from_weights(multiplier, file, text_encoder, unet, weights_sd, args,
                                           module_factory=_factory(unit), network_class=lora.AdapterNetwork,
                                           kind="DyLoRA")
