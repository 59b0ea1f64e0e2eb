"""sd-scripts' networks.oft (Orthogonal Finetuning, constrained: COFT) as a kohya network module.

U-Net only, as sd-scripts. ``network_dim`` is the number of diagonal blocks per layer (the
layer's output width must be a multiple of it), ``network_alpha`` the constraint (sd-scripts:
default 1e-3, the rotation's skew part is clamped to alpha * out_dim in norm). network_args:
``enable_all_linear`` (every Linear / 1x1 conv of the transformer blocks, not only attention's
to_q/to_k/to_v/to_out) and ``enable_conv`` (also the ResNet blocks' and resamplers' convs); sd-scripts
reads them with Python's bool(), so "False" there means true: here true/false are read as written.

File: ``oft_unet_<name>.oft_blocks`` (num_blocks, block, block) and ``.alpha`` per layer, names in
sd-scripts' layout (SD1/SD2 diffusers paths, SDXL SAI paths). A1111 reads ``oft_unet_`` keys by
replacing the prefix with ``diffusion_model`` (SAI names: SDXL files load, SD1/SD2 files do not);
ComfyUI and diffusers have no ``oft_unet_`` mapping.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from networks import lora, lora_names
from networks.adapter_modules import OFTModule
from networks.adapter_weights import file_kinds

logger = logging.getLogger("sdtk")

# the trainer reads it (library/training/methods.py): the network puts no module on a text encoder
# (sd-scripts' OFT ignores apply_text_encoder), so they stay frozen and their outputs may be cached
TRAINS_TEXT_ENCODERS = False

PREFIX = "oft_unet"
ATTENTION = ("Attention",)  # diffusers' class for sd-scripts' CrossAttention
ALL_LINEAR = ("Transformer2DModel",)
KNOWN = ("enable_all_linear", "enable_conv")


def _parse(kwargs: dict[str, Any]) -> tuple[bool, bool]:
    unknown = sorted(k for k in kwargs if k not in KNOWN)
    if unknown:
        raise lora.LoRAError(f"network_args: unknown key {unknown[0]!r} for networks.oft; known keys: "
                             f"{', '.join(KNOWN)}")
    return (lora.parse_bool("networks.oft", "enable_all_linear", kwargs.get("enable_all_linear", False)),
            lora.parse_bool("networks.oft", "enable_conv", kwargs.get("enable_conv", False)))


def check_network_args(kwargs: dict[str, Any]) -> None:
    _parse(kwargs)


def dim_and_alpha(module: str, network_dim, network_alpha, neuron_dropout) -> tuple[int, float]:
    """(blocks per layer, constraint) of sd-scripts' OFT: network_dim (default 4) and network_alpha
    (default 1e-3, sd-scripts warns from 1 on); network_dropout does nothing (sd-scripts' neither)."""
    dim = 4 if network_dim is None else lora.parse_number("network_dim", network_dim, int, 1)
    if network_alpha is None:
        logger.info(f"{module}: network_alpha is not set, using 1e-3 (sd-scripts' default)")
        alpha = 1e-3
    else:
        alpha = lora.parse_number("network_alpha", network_alpha, float, 0, low_inclusive=False)
        if alpha >= 1:
            logger.warning(f"{module}: network_alpha >= 1 is a loose constraint; sd-scripts suggests ~1e-3")
    if neuron_dropout:
        logger.warning(f"network_dropout has no effect on {module} (sd-scripts' OFT does not use it)")
    return dim, alpha


def _factory(lora_name, org_module, multiplier, dim, alpha, dropout, rank_dropout, module_dropout):
    out_dim = org_module.weight.shape[0]
    if out_dim % int(dim):
        raise lora.LoRAError(f"networks.oft: network_dim {dim} (blocks) does not divide the {out_dim} outputs of "
                             f"{lora_name}; choose a divisor")
    return OFTModule(lora_name, org_module, multiplier, dim, alpha)


def _is_sdxl(text_encoder, unet) -> bool:
    tes = [te for te in (text_encoder if isinstance(text_encoder, (list, tuple)) else [text_encoder]) if te is not None]
    return len(tes) == 2 or (unet is not None and lora_names.is_sdxl_unet(unet))


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae,
                   text_encoder, unet, neuron_dropout: Optional[float] = None, **kwargs):
    all_linear, conv = _parse(kwargs)
    dim, alpha = dim_and_alpha("networks.oft", network_dim, network_alpha, neuron_dropout)
    return lora.AdapterNetwork(None, unet, multiplier=multiplier, lora_dim=dim, alpha=alpha,
                               conv_lora_dim=dim if conv else None, conv_alpha=alpha,
                               is_sdxl=_is_sdxl(text_encoder, unet), module_factory=_factory,
                               unet_targets=ALL_LINEAR if all_linear else ATTENTION, text_encoder_targets=(),
                               unet_prefix=PREFIX)


def dims_from_weights(weights_sd):
    dims, alphas = {}, {}
    for key, value in weights_sd.items():
        name, _, part = key.partition(".")
        if part == "oft_blocks":
            dims[name] = value.shape[0]
    for name in dims:
        alphas[name] = weights_sd.get(name + ".alpha", 1e-3)
    return dims, alphas


def create_network_from_weights(multiplier: float, file: Optional[str], vae, text_encoder, unet, weights_sd=None,
                                for_inference: bool = False, **kwargs):
    if weights_sd is None:
        weights_sd = lora.load_state_dict_file(file)
    _parse(kwargs)
    dims, alphas = dims_from_weights(weights_sd)
    if not dims:
        found = file_kinds(weights_sd)
        what = f"a {'/'.join(found)} file" if found else "no adapter keys"
        raise lora.LoRAError(f"weights {file or '(state dict)'}: {what}, not an OFT file of networks.oft")
    network = lora.AdapterNetwork(None, unet, multiplier=multiplier, modules_dim=dims, modules_alpha=alphas,
                                  is_sdxl=_is_sdxl(text_encoder, unet), module_factory=_factory,
                                  unet_targets=ALL_LINEAR, text_encoder_targets=(), unet_prefix=PREFIX)
    return network, weights_sd
