"""Adapter modules of sd-scripts' own network kinds (LoHa, LoKr, DyLoRA, OFT), beside LoRA's
``LoRAModule`` (networks/lora.py), which shares their hooking base.

Each module hooks the forward of one Linear / Conv2d of the model (its weights stay where they
are), has the tensor names, shapes, initialisation and dropout of sd-scripts'
``networks/{loha,lokr,dylora,oft}.py`` so that the files are the ones sd-scripts writes, and
computes its weight from networks/adapter_weights.py.
"""
from __future__ import annotations

import math
import random
from typing import Optional

import torch
import torch.nn.functional as F

from networks import adapter_weights


class HookedModule(torch.nn.Module):
    """Replaces the forward of ``org_module`` (kept out of the module tree, so neither trained nor
    saved) until ``restore``. ``PLUS_PARAMS``: parameter names LoRA+ puts in the "plus" group."""

    PLUS_PARAMS: tuple[str, ...] = ()

    def __init__(self, lora_name: str, org_module: torch.nn.Module, multiplier: float):
        super().__init__()
        self.lora_name = lora_name
        self.multiplier = multiplier
        self.org_module_ref = [org_module]
        self.org_forward = None

    @property
    def org_module(self) -> torch.nn.Module:
        return self.org_module_ref[0]

    def apply_to(self) -> None:
        if self.org_forward is not None:
            return
        self.org_forward = self.org_module.forward
        self.org_module.forward = self.forward

    def restore(self) -> None:
        if self.org_forward is not None:
            del self.org_module.forward  # drops the instance attribute set by apply_to
            self.org_forward = None


def merge_delta(org_module: torch.nn.Module, parts: dict, multiplier: float, dtype=None, device=None) -> None:
    """Add ``multiplier`` times the delta of a module's tensors (by part name, alpha included) to
    the layer's weight, in float32, stored in ``dtype`` (default: the weight's)."""
    weight = org_module.weight
    device = device or weight.device
    delta = adapter_weights.module_delta({k: v.to(device) for k, v in parts.items()}, weight)
    with torch.no_grad():
        merged = weight.detach().to(device, torch.float32) + delta * multiplier
        weight.data = merged.to(dtype or weight.dtype)


def _alpha(alpha, rank: int) -> float:
    if isinstance(alpha, torch.Tensor):
        alpha = float(alpha.detach().float())
    return float(rank if alpha is None or alpha == 0 else alpha)  # 0/None: no scaling


class DeltaModule(HookedModule):
    """A module whose output adds ``x`` through a weight delta built from its parameters (LoHa,
    LoKr): ``org(x) + conv/linear(x, delta) * multiplier``. Rank dropout drops output rows of the
    delta and rescales by 1 / (1 - p); module dropout skips the module (sd-scripts)."""

    def __init__(self, lora_name, org_module, multiplier=1.0, lora_dim=4, alpha=1.0, dropout=None,
                 rank_dropout=None, module_dropout=None):
        super().__init__(lora_name, org_module, multiplier)
        self.lora_dim = int(lora_dim)
        self.is_conv = isinstance(org_module, torch.nn.Conv2d)
        w = org_module.weight
        self.weight_shape = tuple(w.shape)
        self.out_dim, self.in_dim = w.shape[0], w.shape[1]
        self.kernel = tuple(w.shape[2:]) if self.is_conv else ()
        self.conv3x3 = self.is_conv and self.kernel != (1, 1)
        self.rank_dropout, self.module_dropout = rank_dropout, module_dropout
        self.dropout = dropout  # accepted as sd-scripts does, not used by these kinds

    def set_alpha(self, alpha: float) -> None:
        self.scale = alpha / self.lora_dim
        self.register_buffer("alpha", torch.tensor(alpha, dtype=torch.float32))  # saved as 0-dim .alpha

    def parts(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters())

    def delta(self) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        org = self.org_forward(x)
        if self.module_dropout is not None and self.training and torch.rand(1) < self.module_dropout:
            return org
        d = self.delta()
        scale = self.multiplier
        if self.rank_dropout is not None and self.training:
            keep = (torch.rand(d.shape[0], device=d.device) > self.rank_dropout).to(d.dtype)
            d = d * keep.view(-1, *([1] * (d.dim() - 1)))
            scale = scale / (1.0 - self.rank_dropout)
        x = x.to(d.dtype)
        if self.is_conv:
            m = self.org_module
            y = F.conv2d(x, d, stride=m.stride, padding=m.padding, dilation=m.dilation, groups=m.groups)
        else:
            y = F.linear(x, d)
        return org + (y * scale).to(org.dtype)

    def merge_to(self, sd: dict, dtype=None, device=None) -> None:
        parts = dict(sd) or {k: v.detach() for k, v in self.parts().items()}
        parts.setdefault("alpha", self.alpha)
        merge_delta(self.org_module, parts, self.multiplier, dtype, device)


class LoHaModule(DeltaModule):
    """sd-scripts' networks.loha module: ``(w1a @ w1b) * (w2a @ w2b) * alpha / rank``; 3x3 convs
    flattened to (out, in*k*k), or Tucker cores with ``use_tucker``."""

    PLUS_PARAMS = ("hada_w2_a",)

    def __init__(self, lora_name, org_module, multiplier=1.0, lora_dim=4, alpha=1.0, dropout=None,
                 rank_dropout=None, module_dropout=None, use_tucker: bool = False):
        super().__init__(lora_name, org_module, multiplier, lora_dim, alpha, dropout, rank_dropout, module_dropout)
        r, out_dim, in_dim = self.lora_dim, self.out_dim, self.in_dim
        P = torch.nn.Parameter
        self.tucker = bool(use_tucker) and self.conv3x3
        if self.tucker:
            self.hada_t1 = P(torch.empty(r, r, *self.kernel))
            self.hada_w1_a = P(torch.empty(r, out_dim))
            self.hada_w1_b = P(torch.empty(r, in_dim))
            self.hada_t2 = P(torch.empty(r, r, *self.kernel))
            self.hada_w2_a = P(torch.empty(r, out_dim))
            self.hada_w2_b = P(torch.empty(r, in_dim))
            # sd-scripts / LyCORIS: w1_a = 0 makes the delta exactly zero at the start
            torch.nn.init.normal_(self.hada_t1, std=0.1)
            torch.nn.init.normal_(self.hada_t2, std=0.1)
            torch.nn.init.normal_(self.hada_w1_b, std=1.0)
            torch.nn.init.zeros_(self.hada_w1_a)
            torch.nn.init.normal_(self.hada_w2_b, std=1.0)
            torch.nn.init.normal_(self.hada_w2_a, std=0.1)
        else:
            flat_in = in_dim * math.prod(self.kernel) if self.conv3x3 else in_dim
            self.hada_w1_a = P(torch.empty(out_dim, r))
            self.hada_w1_b = P(torch.empty(r, flat_in))
            self.hada_w2_a = P(torch.empty(out_dim, r))
            self.hada_w2_b = P(torch.empty(r, flat_in))
            torch.nn.init.normal_(self.hada_w1_a, std=0.1)
            torch.nn.init.normal_(self.hada_w1_b, std=1.0)
            torch.nn.init.zeros_(self.hada_w2_a)
            torch.nn.init.normal_(self.hada_w2_b, std=1.0)
        self.set_alpha(_alpha(alpha, r))

    def delta(self) -> torch.Tensor:
        return adapter_weights.loha_delta(self.parts(), self.scale, self.weight_shape)


class LoKrModule(DeltaModule):
    """sd-scripts' networks.lokr module: ``kron(w1, w2) * alpha / rank``, w1 (out_l, in_m) a full
    matrix, w2 low rank (``w2_a @ w2_b``, Tucker with ``use_tucker`` on 3x3 convs) or, when the
    rank is at least half its larger side, a full matrix with scale 1 (alpha saved as the rank)."""

    PLUS_PARAMS = ("lokr_w1",)

    def __init__(self, lora_name, org_module, multiplier=1.0, lora_dim=4, alpha=1.0, dropout=None,
                 rank_dropout=None, module_dropout=None, factor: int = -1, use_tucker: bool = False,
                 w1_shape: Optional[tuple[int, int]] = None, full_w2: Optional[bool] = None):
        super().__init__(lora_name, org_module, multiplier, lora_dim, alpha, dropout, rank_dropout, module_dropout)
        r = self.lora_dim
        P = torch.nn.Parameter
        if w1_shape is None:
            in_m, in_n = adapter_weights.factorization(self.in_dim, int(factor))
            out_l, out_k = adapter_weights.factorization(self.out_dim, int(factor))
        else:  # read back from a file: its factors, whatever factor it was trained with
            (out_l, in_m) = w1_shape
            out_k, in_n = self.out_dim // out_l, self.in_dim // in_m
        self.lokr_w1 = P(torch.empty(out_l, in_m))
        # full_w2: as a file has it; else sd-scripts' rule (a rank of at least half the larger side)
        self.use_w2 = r >= max(out_k, in_n) / 2 if full_w2 is None else bool(full_w2)
        self.tucker = bool(use_tucker) and self.conv3x3 and not self.use_w2
        if self.use_w2:
            self.lokr_w2 = P(torch.empty(out_k, in_n, *self.kernel) if self.conv3x3 else torch.empty(out_k, in_n))
        elif self.tucker:
            self.lokr_t2 = P(torch.empty(r, r, *self.kernel))
            self.lokr_w2_a = P(torch.empty(r, out_k))
            self.lokr_w2_b = P(torch.empty(r, in_n))
        else:
            self.lokr_w2_a = P(torch.empty(out_k, r))
            self.lokr_w2_b = P(torch.empty(r, in_n * (math.prod(self.kernel) if self.conv3x3 else 1)))
        a = _alpha(alpha, r)
        self.set_alpha(float(r) if self.use_w2 else a)  # both full: scale 1
        torch.nn.init.kaiming_uniform_(self.lokr_w1, a=math.sqrt(5))
        if self.use_w2:
            torch.nn.init.zeros_(self.lokr_w2)
        else:
            if self.tucker:
                torch.nn.init.kaiming_uniform_(self.lokr_t2, a=math.sqrt(5))
            torch.nn.init.kaiming_uniform_(self.lokr_w2_a, a=math.sqrt(5))
            torch.nn.init.zeros_(self.lokr_w2_b)  # kron(w1, 0) = 0 at the start

    def delta(self) -> torch.Tensor:
        return adapter_weights.lokr_delta(self.parts(), self.scale, self.weight_shape)


class DyLoRAModule(HookedModule):
    """sd-scripts' networks.dylora module. Each forward draws b in [0, rank) rounded down to a
    multiple of ``unit`` (Python's random, as sd-scripts; the training state keeps it); ranks
    [b, b + unit) are the only ones with a gradient this step (each rank is its own parameter,
    the others get requires_grad False, as sd-scripts), the output is
    ``up @ down * alpha / rank * sqrt(rank / (b + unit))`` over all ranks. Saved as a LoRA
    (``lora_down.weight``, ``lora_up.weight``, ``alpha``)."""

    PLUS_PARAMS = ("lora_B",)

    def __init__(self, lora_name, org_module, multiplier=1.0, lora_dim=4, alpha=1.0, unit: int = 1):
        super().__init__(lora_name, org_module, multiplier)
        self.lora_dim, self.unit = int(lora_dim), int(unit)
        self.is_conv = isinstance(org_module, torch.nn.Conv2d)
        w = org_module.weight
        out_dim, in_dim = w.shape[0], w.shape[1]
        k = tuple(w.shape[2:])
        self.lora_A = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(1, in_dim, *k)) for _ in range(self.lora_dim)])
        up_shape = (out_dim, 1, 1, 1) if self.is_conv else (out_dim, 1)
        self.lora_B = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(up_shape)) for _ in range(self.lora_dim)])
        for p in self.lora_A:
            torch.nn.init.kaiming_uniform_(p, a=math.sqrt(5))
        a = _alpha(alpha, self.lora_dim)
        self.scale = a / self.lora_dim
        self.register_buffer("alpha", torch.tensor(a, dtype=torch.float32))
        self.last_rank: Optional[int] = None  # b of the last training forward

    def down_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(tuple(self.lora_A), 0), torch.cat(tuple(self.lora_B), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        org = self.org_forward(x)
        factor = 1.0
        if self.training:
            b = random.randint(0, self.lora_dim - 1)  # sd-scripts' draw (Python's generator, in the state)
            b -= b % self.unit
            for i, (a_i, b_i) in enumerate(zip(self.lora_A, self.lora_B)):
                trains = b <= i < b + self.unit
                a_i.requires_grad_(trains)
                b_i.requires_grad_(trains)
            self.last_rank = b
            factor = math.sqrt(self.lora_dim / (b + self.unit))
        down, up = self.down_up()
        x = x.to(down.dtype)
        if self.is_conv:
            m = self.org_module
            y = F.conv2d(F.conv2d(x, down, stride=m.stride, padding=m.padding), up)
        else:
            y = F.linear(F.linear(x, down), up)
        return org + (y * (self.scale * factor * self.multiplier)).to(org.dtype)

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """LoRA's keys (the per-rank parameters joined), as sd-scripts' DyLoRA saves."""
        sd = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        for key in [k for k in sd if k.startswith((prefix + "lora_A.", prefix + "lora_B."))]:
            del sd[key]
        down, up = self.down_up()
        sd[prefix + "lora_down.weight"] = down if keep_vars else down.detach()
        sd[prefix + "lora_up.weight"] = up if keep_vars else up.detach()
        return sd

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        down = state_dict.pop(prefix + "lora_down.weight", None)
        up = state_dict.pop(prefix + "lora_up.weight", None)
        if down is not None and up is not None:
            for i in range(down.shape[0]):
                state_dict[f"{prefix}lora_A.{i}"] = down[i:i + 1]
                state_dict[f"{prefix}lora_B.{i}"] = up[:, i:i + 1]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def merge_to(self, sd: dict, dtype=None, device=None) -> None:
        down, up = self.down_up()
        parts = {"lora_down.weight": sd.get("lora_down.weight", down.detach()),
                 "lora_up.weight": sd.get("lora_up.weight", up.detach()), "alpha": sd.get("alpha", self.alpha)}
        merge_delta(self.org_module, parts, self.multiplier, dtype, device)


class _RotationModule(HookedModule):
    """OFT's forward and merge: the layer computes with its weight rotated (``rotated_weight``)
    and its own bias."""

    def rotated_weight(self, blocks=None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.multiplier == 0.0:
            return self.org_forward(x)
        m = self.org_module
        w = self.rotated_weight().to(x.dtype)
        if isinstance(m, torch.nn.Conv2d):
            return F.conv2d(x, w, m.bias, m.stride, m.padding, m.dilation, m.groups)
        return F.linear(x, w, m.bias)

    def merge_to(self, sd: dict, dtype=None, device=None) -> None:
        """Replace the layer's weight by its rotation with the blocks of ``sd`` (by part name;
        missing: the module's own)."""
        weight = self.org_module.weight
        device = device or weight.device
        with torch.no_grad():
            rotated = self.rotated_weight(self._blocks_of(sd), weight.detach().to(device, torch.float32))
            weight.data = rotated.to(dtype or weight.dtype)


def _alpha_value(alpha) -> float:
    return float(alpha.detach().float()) if isinstance(alpha, torch.Tensor) else float(alpha)


class OFTModule(_RotationModule):
    """sd-scripts' networks.oft module: ``oft_blocks`` (num_blocks = dim, block, block), zero at
    the start (R = I); the module's output uses the rotated weight ``R^T W`` per block of output
    rows and the original bias. alpha is the constraint per output row (clamp at alpha * out)."""

    def __init__(self, lora_name, org_module, multiplier=1.0, lora_dim=4, alpha=1e-3):
        super().__init__(lora_name, org_module, multiplier)
        out_dim = org_module.weight.shape[0]
        self.num_blocks = int(lora_dim)
        self.block_size = out_dim // self.num_blocks
        alpha = _alpha_value(alpha)
        self.constraint = alpha * out_dim
        self.register_buffer("alpha", torch.tensor(alpha, dtype=torch.float32))
        self.oft_blocks = torch.nn.Parameter(torch.zeros(self.num_blocks, self.block_size, self.block_size))

    def _blocks_of(self, sd: dict):
        return sd.get("oft_blocks", self.oft_blocks.detach())

    def rotated_weight(self, blocks=None, weight=None) -> torch.Tensor:
        blocks = self.oft_blocks if blocks is None else blocks
        weight = self.org_module.weight if weight is None else weight
        r = adapter_weights.oft_rotation(blocks.to(weight.device).float(), self.constraint, self.multiplier)
        return adapter_weights.oft_apply(weight.float(), r)


class SplitOFTModule(_RotationModule):
    """sd-scripts' networks.oft_flux module: OFTModule's rotation on each part of the layer's
    output rows (``split_dims``: FLUX.1's fused q, k, v [, MLP input] rotate apart; None: one
    part), ``oft_blocks`` a list of (num_blocks, part / num_blocks, part / num_blocks), saved as
    ``oft_blocks.0``, ``oft_blocks.1``, ...; the constraint of a part is alpha * its width."""

    def __init__(self, lora_name, org_module, multiplier=1.0, lora_dim=4, alpha=1e-3, split_dims=None):
        super().__init__(lora_name, org_module, multiplier)
        out_dim = org_module.weight.shape[0]
        self.split_dims = tuple(int(d) for d in (split_dims or (out_dim,)))
        if sum(self.split_dims) != out_dim:
            raise ValueError(f"{lora_name}: parts {list(self.split_dims)} do not add up to {out_dim} outputs")
        self.num_blocks = int(lora_dim)
        alpha = _alpha_value(alpha)
        self.constraints = [alpha * d for d in self.split_dims]
        self.register_buffer("alpha", torch.tensor(alpha, dtype=torch.float32))
        self.oft_blocks = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(self.num_blocks, d // self.num_blocks, d // self.num_blocks))
             for d in self.split_dims])

    def _blocks_of(self, sd: dict):
        return [sd.get(f"oft_blocks.{i}", b.detach()) for i, b in enumerate(self.oft_blocks)]

    def rotated_weight(self, blocks=None, weight=None) -> torch.Tensor:
        blocks = list(self.oft_blocks) if blocks is None else blocks
        weight = self.org_module.weight if weight is None else weight
        parts = []
        for b, c, rows in zip(blocks, self.constraints, weight.float().split(self.split_dims)):
            r = adapter_weights.oft_rotation(b.to(weight.device).float(), c, self.multiplier)
            parts.append(adapter_weights.oft_apply(rows, r))
        return torch.cat(parts)
