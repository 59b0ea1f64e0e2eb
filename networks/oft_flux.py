"""sd-scripts' networks.oft_flux (Orthogonal Finetuning, constrained, on the FLUX.1 transformer) as
a kohya network module; the kohya_ss GUI's LoRA type "Flux1 OFT".

Transformer only, as sd-scripts (no text-encoder module; ``network_train_text_encoder_only``
leaves nothing to train and is refused). ``network_dim`` is the number of diagonal blocks per
layer, ``network_alpha`` the constraint (default 1e-3), as networks/oft.py. Targets: the Linear
layers of the double blocks' attention (``SelfAttention``: ``{img,txt}_attn_qkv``,
``{img,txt}_attn_proj``); with network_args ``enable_all_linear`` every Linear of the double and
single blocks (``DoubleStreamBlock``, ``SingleStreamBlock``: also the MLPs, the modulations,
``linear1`` / ``linear2``). sd-scripts reads ``enable_all_linear`` with Python's bool(), so
"False" there means true: here true/false are read as written.

The fused projections rotate per part (sd-scripts' ``split_dims``): a double block's ``qkv`` as
q, k, v and a single block's ``linear1`` as q, k, v and the MLP input, each part with its own
blocks and the constraint alpha * the part's width. sd-scripts writes the part widths of the full
model (3072, 12288) as numbers; here they come from the model's config (the same numbers for
FLUX.1, the tiny widths for tiny-flux). Every width must be a multiple of ``network_dim``.

File: ``oft_unet_<BFL path>.oft_blocks.<part>`` (num_blocks, b, b) and ``.alpha`` per layer
(sd-scripts' ParameterList: ``.oft_blocks.0`` also for a layer of one part). No client loads
these files: ComfyUI's key map has no ``oft_unet_`` names (and its OFT adapter reads
``.oft_blocks``, not ``.oft_blocks.0``), A1111 does not run FLUX.1, diffusers has no kohya OFT
converter; sd-scripts' own network module reads them (create_network_from_weights), and so does
``network_weights`` here. sd-scripts' merge of a multi-part layer concatenates the rotated parts
along the input dimension and cannot load the result; here a merge rotates each part's rows.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from networks import lora, oft
from networks.adapter_modules import SplitOFTModule
from networks.adapter_weights import file_kinds

logger = logging.getLogger("sdtk")

# the trainer reads it (library/training/methods.py): the network puts no module on a text encoder
# (sd-scripts' OFT ignores apply_text_encoder), so they stay frozen and their outputs may be cached
TRAINS_TEXT_ENCODERS = False

NETWORK_MODULE = "networks.oft_flux"
KIND = "OFT"  # what library/training/network_options.py calls it in messages
PREFIX = "oft_unet"
ATTN_ONLY = ("SelfAttention",)
ALL_LINEAR = ("DoubleStreamBlock", "SingleStreamBlock")
KNOWN = ("enable_all_linear",)
# the kohya_ss GUI appends LoRA+ ratios to every type's network_args; sd-scripts' OFT ignores them
NO_EFFECT = ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio")


def parse_network_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """network_args of networks.oft_flux -> {"enable_all_linear": bool}; one LoRAError line for
    an unknown key or a bad value."""
    for key in sorted(kwargs):
        if key in NO_EFFECT:
            logger.warning(f"network_args: {key} has no effect with {NETWORK_MODULE} (an OFT has no up "
                           "weights; sd-scripts' oft_flux ignores it too)")
        elif key not in KNOWN:
            raise lora.LoRAError(f"network_args: unknown key {key!r} for {NETWORK_MODULE}; known keys: "
                                 f"{', '.join(KNOWN)}")
    return {"enable_all_linear": lora.parse_bool(NETWORK_MODULE, "enable_all_linear",
                                                 kwargs.get("enable_all_linear", False))}


def check_network_args(kwargs: dict[str, Any]) -> None:
    """Before any weight loads (the trainer calls it)."""
    parse_network_args(dict(kwargs))


def split_dims(name: str, flux) -> Optional[tuple[int, ...]]:
    """The output parts of a layer (sd-scripts' test of the name), None for one part."""
    h = flux.config.hidden_size
    if "double" in name and "qkv" in name:
        return (h, h, h)
    if "single" in name and "linear1" in name:
        return (h, h, h, flux.config.mlp_hidden_dim)
    return None


def targets(flux, all_linear: bool) -> dict[str, Any]:
    """{oft name: Linear} of sd-scripts' search: every Linear inside the modules of the target
    classes, in the model's order."""
    classes = ALL_LINEAR if all_linear else ATTN_ONLY
    out = {}
    for name, module in flux.named_modules():
        if module.__class__.__name__ not in classes:
            continue
        for child_name, child in module.named_modules():
            if "Linear" in child.__class__.__name__:
                out[(PREFIX + "." + name + "." + child_name).replace(".", "_")] = child
    return out


def _module(name: str, layer, flux, multiplier: float, dim: int, alpha) -> SplitOFTModule:
    split = split_dims(name, flux)
    parts = split or (layer.weight.shape[0],)
    bad = [p for p in parts if p % dim]
    if bad:
        raise lora.LoRAError(f"{NETWORK_MODULE}: network_dim {dim} (blocks) does not divide the {bad[0]} outputs "
                             f"of {name}{' (a part of it)' if len(parts) > 1 else ''}; choose a divisor")
    return SplitOFTModule(name, layer, multiplier, dim, alpha, split)


class FluxOFTNetwork(lora.AdapterNetwork):
    """The OFT modules of the transformer (``unet_loras``; no text-encoder module) in
    AdapterNetwork (apply, merge, save, the optimizer's "unet" group)."""

    train_t5xxl = False  # sd-scripts' FLUX trainer reads it of any network: T5 has no module

    def __init__(self, modules: list[SplitOFTModule], multiplier: float):
        super().__init__([], None, multiplier=multiplier, is_sdxl=False)
        self.unet_loras = list(modules)
        for m in self.unet_loras:
            self.add_module(m.lora_name, m)
        logger.info(f"{NETWORK_MODULE}: {len(self.unet_loras)} transformer OFT modules")

    def apply_to(self, text_encoder=None, unet=None, apply_text_encoder: bool = True, apply_unet: bool = True):
        if not apply_unet:
            raise lora.LoRAError(f"{NETWORK_MODULE} trains the FLUX.1 transformer only; "
                                 "network_train_text_encoder_only leaves it nothing to train")
        super().apply_to(text_encoder, unet, apply_text_encoder, apply_unet)


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], ae,
                   text_encoders, flux, neuron_dropout: Optional[float] = None, **kwargs) -> FluxOFTNetwork:
    """sd-scripts' create_network of networks.oft_flux: flux the BFL-layout transformer."""
    args = parse_network_args(kwargs)
    dim, alpha = oft.dim_and_alpha(NETWORK_MODULE, network_dim, network_alpha, neuron_dropout)
    found = targets(flux, args["enable_all_linear"])
    return FluxOFTNetwork([_module(n, layer, flux, multiplier, dim, alpha) for n, layer in found.items()],
                          multiplier)


def create_network_from_weights(multiplier: float, file: Optional[str], ae, text_encoders, flux, weights_sd=None,
                                for_inference: bool = False, **kwargs):
    """A network shaped like the file (blocks and alpha per layer, the layers it names); weights
    are not loaded here. A layer the file names that this model has not is an error."""
    if weights_sd is None:
        weights_sd = lora.load_state_dict_file(file)
    parse_network_args(kwargs)
    dims = {k.split(".")[0]: v.shape[0] for k, v in weights_sd.items() if k.endswith(".oft_blocks.0")}
    if not dims:
        found = file_kinds(weights_sd)
        what = f"a {'/'.join(found)} file" if found else "no adapter keys"
        raise lora.LoRAError(f"weights {file or '(state dict)'}: {what}, not an OFT file of {NETWORK_MODULE} "
                             "(its keys end in .oft_blocks.0)")
    layers = targets(flux, all_linear=True)
    missing = sorted(set(dims) - set(layers))
    if missing:
        raise lora.LoRAError(f"weights {file or '(state dict)'}: {len(missing)} module(s) do not exist in this "
                             f"model (wrong base model?), e.g. {missing[0]}")
    modules = [_module(n, layer, flux, multiplier, dims[n], weights_sd.get(n + ".alpha", 1e-3))
               for n, layer in layers.items() if n in dims]
    return FluxOFTNetwork(modules, multiplier), weights_sd
