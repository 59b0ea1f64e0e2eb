"""sd-scripts' networks.boft (PR #2357 / #2428): Butterfly Orthogonal Fine-Tuning in the PEFT form
for SD1, SD2 and SDXL.

Each adapted layer's flattened weight W (out, inputs) becomes ``diag(s) W R^T``: R the product of
``boft_n_butterfly_factor`` butterfly factors, each a block-diagonal of exact Cayley rotations
between butterfly permutations (networks/orthogonal.py), s a learned per-output scale. Layers as
networks.oft_v2 (networks/orthogonal_modules.py).

network_args (sd-scripts' names): ``boft_block_size`` / ``block_size`` (default ``network_dim``,
else 4) or ``boft_block_num`` / ``block_num`` (not both; an explicit block number is taken over
``network_dim``, where sd-scripts stops), ``boft_n_butterfly_factor`` (default 1),
``boft_dropout`` / ``dropout`` (``network_dropout`` wins), ``enable_conv``, ``auto_adjust`` (a
block size that gives no valid shape moves to the nearest one that does), ``include_patterns`` /
``exclude_patterns`` (as networks.oft_v2). ``network_alpha`` has no meaning here.

File: ``<kohya name>.boft_R`` (factors, blocks, b, b) and ``.boft_s`` (out, 1) per layer, no alpha.
"""
from __future__ import annotations

from networks import lora
from networks.oft_v2 import PATTERNS, common_settings, parse_args
from networks.orthogonal_modules import BOFTModule, entry_points, in_features

MODULE = "networks.boft"
PART = "boft_R"
ALIASES = {"boft_block_size": "block_size", "boft_block_num": "block_num", "boft_dropout": "dropout"}
KNOWN = (*ALIASES, *ALIASES.values(), "boft_n_butterfly_factor", "enable_conv", "auto_adjust", *PATTERNS)


def _settings(network_dim, neuron_dropout, kwargs) -> dict:
    a = parse_args(kwargs, MODULE, KNOWN, ALIASES)
    num = a.get("block_num")
    num = 0 if num is None else lora.parse_number("network_args: boft_block_num", num, int, 1)
    size = a.get("block_size")
    if size is not None and num:
        raise lora.LoRAError("network_args: give boft_block_size or boft_block_num, not both")
    if size is None and not num:
        size = network_dim
    return dict(
        block_size=0 if num else (4 if size is None else lora.parse_number("network_args: boft_block_size", size, int,
                                                                           1)),
        block_num=num,
        n_factors=lora.parse_number("network_args: boft_n_butterfly_factor", a.get("boft_n_butterfly_factor", 1),
                                    int, 1),
        **common_settings(MODULE, a, neuron_dropout))


def _module(s: dict, multiplier: float):
    def make(lora_name, org_module, file_tensor):
        if file_tensor is None:
            return BOFTModule(lora_name, org_module, multiplier, s["block_size"], s["block_num"], s["n_factors"],
                              s["dropout"], s["auto_adjust"])
        if file_tensor.dim() != 4 or file_tensor.shape[1] * file_tensor.shape[2] != in_features(org_module):
            raise lora.LoRAError(f"{lora_name}.{PART}: shape {tuple(file_tensor.shape)} does not fit its "
                                 f"{in_features(org_module)} inputs (wrong base model?)")
        m, nb, b = file_tensor.shape[:3]  # the file's shape, exactly
        return BOFTModule(lora_name, org_module, multiplier, b, nb, m, s["dropout"], False)
    return make


# the kohya network interface (train_lora.py, merge_lora.py, base_weights)
create_network, create_network_from_weights, check_network_args = entry_points(
    MODULE, PART, _settings, _module, ("block_size", "block_num", "n_factors", "dropout", "enable_conv"))
