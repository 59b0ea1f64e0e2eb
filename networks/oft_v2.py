"""sd-scripts' networks.oft_v2 (PR #2357 / #2428): OFT in the PEFT form (OFTv2) for SD1, SD2, SDXL.

Each adapted layer's inputs split into blocks of ``block_size``; each block rotates by PEFT's
Neumann-series Cayley transform of a skew matrix (networks/orthogonal.py), zero at the start.
U-Net (Transformer2DModel Linear / 1x1 convs; with ``enable_conv`` the ResNet blocks and
resamplers too, 3x3 convs included) and text encoders (CLIP attention / MLP).

network_args (sd-scripts' names; the second name of a pair is its alias): ``oft_block_size`` /
``block_size`` (default ``network_dim``, else 32; a block size that does not divide a layer's
inputs moves to the nearest divisor unless ``auto_adjust=false``), ``oft_coft`` / ``coft`` with
``coft_eps`` (default 6e-5), ``oft_block_share`` / ``block_share``, ``dropout_probability`` /
``dropout`` (``network_dropout`` wins, as sd-scripts), ``enable_conv``, ``auto_adjust``,
``include_patterns`` / ``exclude_patterns`` (regular expressions on the layer's dotted path,
networks/orthogonal_modules.py). ``network_alpha`` has no meaning here (sd-scripts drops it).

File: ``<kohya name>.oft_R.weight`` (blocks or 1, b(b-1)/2) per layer, no alpha; metadata as any
network (``ss_network_module`` "networks.oft_v2", ``ss_network_args``).
"""
from __future__ import annotations

from typing import Any

from networks import lora, orthogonal
from networks.orthogonal_modules import OFTv2Module, entry_points, in_features, parse_patterns, pattern_filter

MODULE = "networks.oft_v2"
PART = "oft_R.weight"
ALIASES = {"oft_block_size": "block_size", "oft_coft": "coft", "oft_block_share": "block_share",
           "dropout_probability": "dropout"}
PATTERNS = ("include_patterns", "exclude_patterns")
KNOWN = (*ALIASES, *ALIASES.values(), "coft_eps", "enable_conv", "auto_adjust", *PATTERNS)


def parse_args(kwargs: dict[str, Any], module: str, known: tuple[str, ...], aliases: dict[str, str]) -> dict:
    """network_args by canonical name (the alias sd-scripts reads first wins; the patterns
    compiled, as ``module_filter``); an unknown key is a one-line error."""
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        raise lora.LoRAError(f"network_args: unknown key {unknown[0]!r} for {module}; known keys: {', '.join(known)}")
    out = {}
    for key, value in kwargs.items():
        name = aliases.get(key, key)
        if key in aliases or name not in out:
            out[name] = value
    out["module_filter"] = pattern_filter(*(parse_patterns(module, k, kwargs.get(k)) for k in PATTERNS))
    return out


def common_settings(module: str, a: dict, neuron_dropout) -> dict:
    """The settings both kinds read alike: dropout (``network_dropout`` wins), enable_conv,
    auto_adjust and the pattern filter."""
    dropout = neuron_dropout if neuron_dropout is not None else a.get("dropout")
    return dict(
        dropout=0.0 if dropout is None else lora.parse_number("network_args: dropout", dropout, float, 0.0, 1.0),
        enable_conv=lora.parse_bool(module, "enable_conv", a.get("enable_conv", False)),
        auto_adjust=lora.parse_bool(module, "auto_adjust", a.get("auto_adjust", True)),
        module_filter=a["module_filter"])


def _settings(network_dim, neuron_dropout, kwargs) -> dict:
    a = parse_args(kwargs, MODULE, KNOWN, ALIASES)
    size = a.get("block_size", network_dim)
    return dict(
        block_size=32 if size is None else lora.parse_number("network_args: oft_block_size", size, int, 1),
        coft=lora.parse_bool(MODULE, "coft", a.get("coft", False)),
        coft_eps=lora.parse_number("network_args: coft_eps", a.get("coft_eps", 6e-5), float, 0, low_inclusive=False),
        block_share=lora.parse_bool(MODULE, "block_share", a.get("block_share", False)),
        **common_settings(MODULE, a, neuron_dropout))


def _module(s: dict, multiplier: float):
    def make(lora_name, org_module, file_tensor):
        size, share = s["block_size"], s["block_share"]
        n = in_features(org_module)
        if file_tensor is not None:  # the file's block size and sharing
            size = orthogonal.block_size_of_triu(file_tensor.shape[1])
            if size is None or n % size or file_tensor.shape[0] not in (1, n // size):
                raise lora.LoRAError(f"{lora_name}.{PART}: shape {tuple(file_tensor.shape)} fits no block size of "
                                     f"its {n} inputs (wrong base model?)")
            share = file_tensor.shape[0] == 1 and n // size > 1
        elif s["auto_adjust"]:
            size = orthogonal.nearest_divisor(n, size)
        return OFTv2Module(lora_name, org_module, multiplier, size, s["coft"], s["coft_eps"], share, s["dropout"])
    return make


# the kohya network interface (train_lora.py, merge_lora.py, base_weights)
create_network, create_network_from_weights, check_network_args = entry_points(
    MODULE, PART, _settings, _module, ("block_size", "coft", "block_share", "dropout", "enable_conv"))
