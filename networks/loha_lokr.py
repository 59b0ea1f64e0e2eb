"""What sd-scripts' networks.loha and networks.lokr share: their network_args, the network (the
module selection and names of networks.lora), and reading ranks back from a file.

sd-scripts' network_args for both: ``conv_dim`` / ``conv_alpha`` (3x3 convs; alpha 1 when only the
dim is given), ``use_tucker`` (Tucker cores for 3x3 convs), ``rank_dropout``, ``module_dropout``,
``loraplus_*``, ``verbose``; LoKr adds ``factor`` (-1: balanced). sd-scripts reads only the keys it
knows; the LyCORIS keys the kohya_ss GUI writes for its LyCORIS types (``use_scalar``,
``rank_dropout_scale``, ``train_norm``, ...) have no effect there and are accepted here with a
warning; any other key is an error. sd-scripts' native modules detect SDXL (and Anima) only and
stop on SD1/SD2 U-Nets; here SD1/SD2 use the names of networks.lora (diffusers layout), which
A1111, ComfyUI and LyCORIS read.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from networks import lora
from networks.adapter_modules import LoHaModule, LoKrModule

logger = logging.getLogger("sdtk")

COMMON_ARGS = ("conv_dim", "conv_alpha", "use_tucker", "rank_dropout", "module_dropout", "loraplus_lr_ratio",
               "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio", "verbose")
KNOWN = {"networks.loha": COMMON_ARGS, "networks.lokr": COMMON_ARGS + ("factor",)}
# LyCORIS' keys that sd-scripts' native modules do not read (no effect there either)
NO_EFFECT = ("use_scalar", "rank_dropout_scale", "train_norm", "bypass_mode", "dora_wd", "use_cp",
             "decompose_both", "preset", "algo", "constraint", "rescaled")
# sd-scripts options of these modules not offered here
NOT_HERE = {"exclude_patterns": "module selection by pattern", "include_patterns": "module selection by pattern",
            "network_reg_lrs": "per-pattern learning rates", "network_reg_dims": "per-pattern ranks",
            "train_llm_adapter": "Anima's LLM adapter"}


def parse_args(module: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(LoRA-style args, module kwargs) from network_args strings, checked."""
    kwargs = dict(kwargs)
    for key in NOT_HERE:
        if key in kwargs:
            raise lora.LoRAError(f"network_args: {key} ({NOT_HERE[key]}) of sd-scripts' {module} is not "
                                 "supported here; remove it")
    for key in NO_EFFECT:
        if key in kwargs:
            logger.warning(f"network_args: {key} has no effect on {module} (sd-scripts' native module does "
                           "not read it; it is a LyCORIS option)")
            kwargs.pop(key)
    module_kwargs = {"use_tucker": lora.parse_bool(module, "use_tucker", kwargs.pop("use_tucker", False))}
    kwargs.pop("verbose", None)
    if module == "networks.lokr":
        factor = kwargs.pop("factor", -1)
        module_kwargs["factor"] = lora.parse_number("network_args: factor", factor, int, -1)
        if module_kwargs["factor"] == 0:
            raise lora.LoRAError("network_args: factor=0 for networks.lokr: use -1 (balanced) or a factor >= 1")
    args = lora.parse_network_args(kwargs, module, KNOWN[module])
    return args, module_kwargs


def check_network_args(module: str, kwargs: dict[str, Any]) -> None:
    parse_args(module, kwargs)


def _factory(module_class, module_kwargs: dict[str, Any], file_parts: dict | None = None):
    def make(lora_name, org_module, multiplier, dim, alpha, dropout, rank_dropout, module_dropout):
        kw = dict(module_kwargs)
        if file_parts is not None:  # shaped like the file: Tucker, factor of each module
            p = file_parts[lora_name]
            kw["use_tucker"] = "hada_t1" in p or "lokr_t2" in p
            if module_class is LoKrModule:
                kw["w1_shape"], kw["full_w2"] = tuple(p["lokr_w1"].shape), "lokr_w2" in p
        return module_class(lora_name, org_module, multiplier, dim, alpha, dropout, rank_dropout, module_dropout, **kw)
    return make


MODULE_CLASS = {"networks.loha": LoHaModule, "networks.lokr": LoKrModule}
KIND = {"networks.loha": "LoHa", "networks.lokr": "LoKr"}


def create_network(module: str, multiplier, network_dim, network_alpha, text_encoder, unet, neuron_dropout,
                   kwargs: dict[str, Any]):
    args, module_kwargs = parse_args(module, kwargs)
    if neuron_dropout:
        logger.warning(f"network_dropout has no effect on {module} (sd-scripts' module does not use it)")
    return lora.build_network(multiplier, network_dim, network_alpha, text_encoder, unet, None, args,
                              module_factory=_factory(MODULE_CLASS[module], module_kwargs),
                              network_class=lora.AdapterNetwork)


def _parts(weights_sd: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in weights_sd.items():
        name, _, part = key.partition(".")
        out.setdefault(name, {})[part] = value
    return out


def dims_from_weights(module: str, weights_sd: dict[str, torch.Tensor]):
    """Per module name: rank and alpha as sd-scripts reads them back (LoKr with a full w2: a rank
    large enough for the full-matrix path)."""
    dims, alphas = {}, {}
    for name, p in _parts(weights_sd).items():
        if module == "networks.loha" and "hada_w1_b" in p:
            dims[name] = p["hada_w1_b"].shape[0]
        elif module == "networks.lokr" and "lokr_w1" in p:
            if "lokr_w2_a" in p:
                dims[name] = p["lokr_w2_a"].shape[0] if "lokr_t2" in p else p["lokr_w2_a"].shape[1]
            else:
                dims[name] = max(p["lokr_w2"].shape[0], p["lokr_w2"].shape[1])
        else:
            continue
        alphas[name] = p.get("alpha", dims[name])
    return dims, alphas


def create_network_from_weights(module: str, multiplier, file, text_encoder, unet, weights_sd, kwargs):
    if weights_sd is None:
        weights_sd = lora.load_state_dict_file(file)
    args, module_kwargs = parse_args(module, kwargs)
    return lora.build_network_from_weights(
        multiplier, file, text_encoder, unet, weights_sd, args,
        module_factory=_factory(MODULE_CLASS[module], module_kwargs, _parts(weights_sd)),
        network_class=lora.AdapterNetwork, kind=KIND[module], dims_reader=lambda sd: dims_from_weights(module, sd))


def entry_points(module: str):
    """``check_network_args``, ``create_network`` and ``create_network_from_weights`` of the
    network module ``module`` (networks/loha.py, networks/lokr.py), with sd-scripts' signatures."""

    def check(kwargs: dict[str, Any]) -> None:
        check_network_args(module, kwargs)

    def create(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae,
               text_encoder, unet, neuron_dropout: Optional[float] = None, **kwargs):
        return create_network(module, multiplier, network_dim, network_alpha, text_encoder, unet,
                              neuron_dropout, kwargs)

    def from_weights(multiplier: float, file: Optional[str], vae, text_encoder, unet, weights_sd=None,
                     for_inference: bool = False, **kwargs):
        return create_network_from_weights(module, multiplier, file, text_encoder, unet, weights_sd,
                                           kwargs)

    return check, create, from_weights
