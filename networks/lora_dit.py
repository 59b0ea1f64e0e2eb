"""LoRA over the rectified-flow transformers (FLUX.1, SD3): what networks/lora_flux.py and
networks/lora_sd3.py share.

The modules are networks/lora.py's ``LoRAModule`` in ``LoRANetwork`` (optimizer groups, LoRA+,
max-norm, merge, the one writer ``write_weights``); only the choice of modules differs from SD:
sd-scripts' ``lora_flux.py`` / ``lora_sd3.py`` pick Linear layers by their place in the
transformer (block kind, block index, layer kind), so the families list their candidates as
``Target`` records and this module builds the network from the ones that get a rank.

``split_qkv`` (sd-scripts' ``split_dims``): a fused projection (q, k, v [, MLP in]) gets one
down-projection per part and one up-projection per part. ``SplitLoRAModule`` holds the downs as
one (parts x rank) x in matrix and the ups as blocks of a block-diagonal matrix, so the module is
a LoRA of rank parts x rank whose up weight is block-diagonal: the file holds exactly what
sd-scripts writes (``lora_down.weight`` the downs stacked, ``lora_up.weight`` block-diagonal),
except ``alpha``: sd-scripts keeps the per-part alpha while the file's rank is parts x rank, so
every client (which scales by alpha / rank of the file) applies 1/3 or 1/4 of the trained delta
(kohya-ss/sd-scripts issue #2204). Here alpha is written as parts x alpha: alpha / rank in the
file is the trained scale, and the clients' W + up @ down * alpha / rank is the trained weight.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from networks import lora_names
from networks.adapter_weights import file_kinds
from networks.lora import (TEXT_ENCODER_TARGET_MODULES, LoRAError, LoRAModule, LoRANetwork, dims_from_weights,
                           parse_bool, parse_number)

logger = logging.getLogger("sdtk")

T5_TARGET_MODULES = ("T5Attention", "T5DenseGatedActDense")  # sd-scripts' T5 targets (train_t5xxl)


@dataclass(frozen=True)
class Target:
    """One Linear (or Conv2d) a LoRA may go on: its kohya name and the rank/alpha it gets (0 = none);
    split: the output widths of split_qkv's parts, or None."""
    name: str
    module: torch.nn.Module
    dim: int
    alpha: float
    split: Optional[tuple[int, ...]] = None


# --- network_args values ---------------------------------------------------------------------

def parse_dim(module: str, key: str, value: Any) -> int:
    """A rank of network_args: an integer >= 0 (0: no module)."""
    return parse_number(f"network_args: {key} for {module}", value, int, 0)


def parse_dims(module: str, key: str, value: Any, names_of: tuple[str, ...]) -> list[int]:
    """sd-scripts' list of ranks, "[a, b, ...]" or "a,b,...", one per entry of names_of."""
    text = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value).strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    items = [s.strip() for s in text.split(",")]
    if len(items) != len(names_of):
        raise LoRAError(f"network_args: {key}={value!r} for {module} needs {len(names_of)} ranks "
                        f"({', '.join(names_of)}), got {len(items)}")
    return [parse_dim(module, key, s) for s in items]


def parse_block_selection(module: str, key: str, value: Any) -> list[tuple[int, int]] | str:
    """sd-scripts' block selection: "all", "none" (or empty), or comma-separated indices and
    inclusive ranges "0-3,7". Returns "all", "none" or the (start, end) ranges; the bound (the
    model's block count) is checked by ``selected_blocks``."""
    text = str(value).strip()
    if text in ("all", "none", ""):
        return text or "none"
    ranges = []
    for part in text.split(","):
        start, dash, end = (s.strip() for s in part.partition("-"))
        try:
            lo, hi = int(start), int(end) if dash else int(start)
        except ValueError:
            raise LoRAError(f"network_args: {key}={value!r} for {module}: {part.strip()!r} is not an index "
                            "or a range like 0-3") from None
        if lo < 0 or hi < lo:
            raise LoRAError(f"network_args: {key}={value!r} for {module}: invalid range {part.strip()!r}")
        ranges.append((lo, hi))
    return ranges


def selected_blocks(module: str, key: str, selection, count: int) -> list[bool]:
    """One flag per block of the model for a parsed selection; an index >= count is an error."""
    if selection == "all":
        return [True] * count
    if selection == "none":
        return [False] * count
    flags = [False] * count
    for lo, hi in selection:
        if hi >= count:
            raise LoRAError(f"network_args: {key} for {module}: block {hi} does not exist (the model has "
                            f"{count}: 0-{count - 1})")
        for i in range(lo, hi + 1):
            flags[i] = True
    return flags


def parse_switch(module: str, key: str, value: Any) -> bool:
    return parse_bool(module, key, value)


def common_args(module: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """rank_dropout, module_dropout and LoRA+ ratios, as networks/lora.py parses them."""
    out: dict[str, Any] = {}
    for key in ("rank_dropout", "module_dropout"):
        if kwargs.get(key) is not None:
            out[key] = parse_number(f"network_args: {key} for {module}", kwargs[key], float, 0.0, 1.0)
    for key in ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio"):
        if kwargs.get(key) is not None:
            out[key] = parse_number(f"network_args: {key} for {module}", kwargs[key], float, 0.0,
                                    low_inclusive=False)
    return out


def check_known(module: str, kwargs: dict[str, Any], known: tuple[str, ...], unsupported: dict[str, str],
                no_effect: tuple[str, ...]) -> None:
    """Unknown keys and sd-scripts features not built here are one error line; keys sd-scripts
    reads but that do nothing for this family are one warning line."""
    for key in sorted(kwargs):
        if key in unsupported:
            raise LoRAError(f"network_args: {key} ({unsupported[key]}) is not supported by {module}; remove it")
        if key in no_effect:
            logger.warning(f"network_args: {key} has no effect with {module} (the transformer has no 3x3 "
                           "convolutions; sd-scripts ignores it too)")
        elif key not in known:
            raise LoRAError(f"network_args: unknown key {key!r} for {module}; known keys: {', '.join(known)}")


# --- modules and network -------------------------------------------------------------------

class BlockDiagonalUp(torch.nn.Module):
    """split_qkv's up-projections: part i maps rank columns [i r, (i+1) r) to its output rows.
    ``weight`` and the saved ``weight`` are the block-diagonal (sum of widths) x (parts x r)
    matrix; loading one needs zeros off the blocks."""

    def __init__(self, rank: int, widths: tuple[int, ...], lora_name: str):
        super().__init__()
        self.rank, self.widths, self.lora_name = rank, tuple(widths), lora_name
        self.parts = torch.nn.ModuleList([torch.nn.Linear(rank, w, bias=False) for w in widths])
        for p in self.parts:
            torch.nn.init.zeros_(p.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(c) for p, c in zip(self.parts, x.split(self.rank, dim=-1))], dim=-1)

    @property
    def weight(self) -> torch.Tensor:
        return torch.block_diag(*[p.weight for p in self.parts])

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        if destination is None:
            destination = {}
        w = self.weight
        destination[prefix + "weight"] = w if keep_vars else w.detach()
        return destination

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        w = state_dict.pop(prefix + "weight", None)
        if w is not None:
            shape = (sum(self.widths), self.rank * len(self.widths))
            if tuple(w.shape) != shape:
                raise LoRAError(f"{self.lora_name}: lora_up.weight has shape {tuple(w.shape)}, this split_qkv "
                                f"module needs {shape}")
            row = 0
            for i, width in enumerate(self.widths):
                block = w[row:row + width, i * self.rank:(i + 1) * self.rank]
                state_dict[f"{prefix}parts.{i}.weight"] = block
                row += width
            if not torch.equal(torch.block_diag(*[state_dict[f"{prefix}parts.{i}.weight"]
                                                  for i in range(len(self.widths))]), w):
                raise LoRAError(f"{self.lora_name}: lora_up.weight is not block-diagonal, so it cannot be loaded "
                                "into a split_qkv network (build the network without split_qkv)")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class SplitLoRAModule(LoRAModule):
    """sd-scripts' LoRA with split_dims (see the module docstring): rank r per part, alpha a per
    part, held as a LoRA of rank parts x r and alpha parts x a with a block-diagonal up."""

    def __init__(self, lora_name, org_module, multiplier=1.0, lora_dim=4, alpha=1.0, dropout=None,
                 rank_dropout=None, module_dropout=None, widths: tuple[int, ...] = ()):
        if not isinstance(org_module, torch.nn.Linear) or sum(widths) != org_module.out_features:
            raise LoRAError(f"{lora_name}: split_qkv parts {list(widths)} do not add up to the layer's outputs")
        n = len(widths)
        if isinstance(alpha, torch.Tensor):
            alpha = float(alpha.detach().float())
        alpha = float(lora_dim if alpha is None or alpha == 0 else alpha)
        super().__init__(lora_name, org_module, multiplier, int(lora_dim) * n, alpha * n, dropout, rank_dropout,
                         module_dropout)
        self.lora_up = BlockDiagonalUp(int(lora_dim), widths, lora_name)


class DiTLoRANetwork(LoRANetwork):
    """LoRANetwork over chosen targets (text encoders' and the transformer's), instead of the SD
    search by block class."""

    def __init__(self, te_targets: list[Target], transformer_targets: list[Target], multiplier: float,
                 lora_dim: int, alpha: float, dropout=None, rank_dropout=None, module_dropout=None):
        super().__init__([], None, multiplier=multiplier, lora_dim=lora_dim, alpha=alpha, dropout=dropout,
                         rank_dropout=rank_dropout, module_dropout=module_dropout, is_sdxl=False)

        def make(t: Target) -> LoRAModule:
            if t.split is not None:
                return SplitLoRAModule(t.name, t.module, multiplier, t.dim, t.alpha, dropout, rank_dropout,
                                       module_dropout, widths=t.split)
            return LoRAModule(t.name, t.module, multiplier, t.dim, t.alpha, dropout, rank_dropout, module_dropout)

        self.text_encoder_loras = [make(t) for t in te_targets if t.dim]
        self.unet_loras = [make(t) for t in transformer_targets if t.dim]
        seen: set[str] = set()
        for lora in self.text_encoder_loras + self.unet_loras:
            if lora.lora_name in seen:
                raise LoRAError(f"duplicated LoRA name {lora.lora_name}")
            seen.add(lora.lora_name)
            self.add_module(lora.lora_name, lora)


def text_encoder_targets(text_encoder, prefix: str, classes: tuple[str, ...], dim: int, alpha: float) -> list[Target]:
    """Every Linear inside the text encoder's modules of the given classes (sd-scripts' search);
    CLIP names under ``text_model.`` (networks/lora_names.py), T5 names as T5EncoderModel's paths."""
    out = []
    is_clip = any(c in TEXT_ENCODER_TARGET_MODULES for c in classes)
    for name, module in text_encoder.named_modules():
        if module.__class__.__name__ not in classes:
            continue
        for child_name, child in module.named_modules():
            if child.__class__.__name__ != "Linear":
                continue
            path = name + "." + child_name
            out.append(Target(lora_names.kohya_name(prefix, lora_names.text_encoder_path(path) if is_clip else path),
                              child, dim, alpha))
    return out


def from_weights(targets: list[Target], weights_sd: dict[str, torch.Tensor], file) -> list[Target]:
    """The targets named in a LoRA file, with the file's rank and alpha (no split: a split_qkv file
    is a plain LoRA of parts x rank, as sd-scripts reads it); a name of the file that is no target
    of this model is an error."""
    dims, alphas = dims_from_weights(weights_sd)
    if not dims:
        found = file_kinds(weights_sd)
        what = f"a {'/'.join(found)} file" if found else "no LoRA module keys"
        raise LoRAError(f"LoRA weights {file or '(state dict)'}: {what}, not a LoRA file of this network_module")
    by_name = {t.name: t for t in targets}
    missing = sorted(set(dims) - set(by_name))
    if missing:
        raise LoRAError(f"LoRA weights {file or '(state dict)'}: {len(missing)} module(s) do not exist in this "
                        f"model (wrong base model?), e.g. {missing[0]}")
    return [Target(t.name, t.module, dims[t.name], float(alphas[t.name])) for t in targets if t.name in dims]


def network_from_weights(all_targets, text_encoders, model, args: dict[str, Any], weights_sd, file,
                         multiplier: float, network_class: type | None = None) -> "DiTLoRANetwork":
    """A network of the modules a LoRA file names, with its ranks and alphas: ``all_targets`` as in
    build_network, over ``args`` that give every candidate a rank; weights are not loaded here."""
    te_targets, tr_targets = all_targets(text_encoders, model, args, 1, 1.0)
    chosen = from_weights(te_targets + tr_targets, weights_sd, file)
    te_names = {t.name for t in te_targets}
    network = (network_class or DiTLoRANetwork)([t for t in chosen if t.name in te_names],
                                                [t for t in chosen if t.name not in te_names], multiplier=multiplier,
                                                lora_dim=4, alpha=1.0)
    set_loraplus(network, args)
    return network


def log_modules(network: LoRANetwork, module: str, args: dict[str, Any]) -> None:
    """The module count, and with network_args verbose=True every module's rank and alpha (sd-scripts' listing)."""
    logger.info(f"{module}: {len(network.text_encoder_loras)} text encoder and {len(network.unet_loras)} "
                "transformer LoRA modules")
    if args.get("verbose"):
        for lora in network.text_encoder_loras + network.unet_loras:
            logger.info(f"\t{lora.lora_name:60} rank {lora.lora_dim}, alpha {float(lora.alpha):g}")


def set_loraplus(network: LoRANetwork, args: dict[str, Any]) -> None:
    if any(k.startswith("loraplus") for k in args):
        network.set_loraplus_lr_ratio(args.get("loraplus_lr_ratio"), args.get("loraplus_unet_lr_ratio"),
                                      args.get("loraplus_text_encoder_lr_ratio"))


def base_dims(network_dim, network_alpha, neuron_dropout) -> tuple[int, float, float | None]:
    dim = 4 if network_dim is None else parse_number("network_dim", network_dim, int, 1)
    alpha = 1.0 if network_alpha is None else parse_number("network_alpha", network_alpha, float, 0)
    if neuron_dropout is not None:
        neuron_dropout = parse_number("network_dropout", neuron_dropout, float, 0.0, 1.0)
    return dim, alpha, neuron_dropout


def build_network(all_targets, network_module: str, multiplier, network_dim, network_alpha,
                  text_encoders, model, neuron_dropout, args: dict,
                  network_class: type = DiTLoRANetwork) -> "DiTLoRANetwork":
    """The network of one DiT family: ``all_targets(text_encoders, model, args, dim, alpha)``
    -> (text-encoder targets, transformer targets), with LoRA+ and the module log."""
    dim, alpha, dropout = base_dims(network_dim, network_alpha, neuron_dropout)
    te_targets, tr_targets = all_targets(text_encoders, model, args, dim, alpha)
    network = network_class(te_targets, tr_targets, multiplier, dim, alpha, dropout,
                             args.get("rank_dropout"), args.get("module_dropout"))
    set_loraplus(network, args)
    log_modules(network, network_module, args)
    return network
