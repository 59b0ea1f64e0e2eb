"""What the LoRA tools share: reading kohya LoRA files, deltas, low-rank factorisation (SVD),
rank criteria, the rank metadata and the atomic save with recomputed hashes.

A module of a kohya file is ``<name>.lora_down.weight`` (rank x in, or rank x in x k x k for a
LoCon conv), ``<name>.lora_up.weight`` (out x rank, or out x rank x 1 x 1) and an optional scalar
``<name>.alpha``; its weight delta is ``up @ down * alpha / rank`` (networks.lora.lora_delta).
Used by networks/resize_lora.py, extract_lora_from_models.py, svd_merge_lora.py, merge_lora.py.
"""
from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import dataclass, replace

import numpy as np
import torch
from safetensors import safe_open

from library.errors import tool_main  # noqa: F401  (the LoRA tools' main: lora_svd.tool_main)
from library.models.families import registry
from library.models.placement import parse_device  # noqa: F401  (the LoRA tools' --device, re-exported)
from networks import lora_blocks
from networks.adapter_weights import file_kinds
from networks.lora import LoRAError, dims_from_weights, load_state_dict_file, write_weights

PRECISIONS = {"float": torch.float32, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LORA_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth")
DYNAMIC_METHODS = ("sv_ratio", "sv_fro", "sv_cumulative")
# A module whose largest singular value is below this is a zero matrix (sd-scripts' MIN_SV).
MIN_SV = 1e-6
# torch.quantile refuses inputs above 2**24 elements.
_QUANTILE_LIMIT = 2 ** 24


@dataclass
class Module:
    """One LoRA module of a file (tensors as stored; alpha is the rank when the file has none)."""
    name: str
    down: torch.Tensor
    up: torch.Tensor
    alpha: float

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def is_conv3x3(self) -> bool:
        """A LoCon module: kxk down conv (k > 1); its rank is the conv rank."""
        return self.down.dim() == 4 and tuple(self.down.shape[2:]) != (1, 1)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """Shape of the original weight (and of the delta)."""
        return (int(self.up.shape[0]),) + tuple(int(s) for s in self.down.shape[1:])


# --- files ------------------------------------------------------------------------------------

def read_metadata(path: str) -> dict[str, str]:
    if not path.lower().endswith(".safetensors"):
        return {}
    with safe_open(path, framework="pt") as f:
        return dict(f.metadata() or {})


# why a tool that rewrites lora_down / lora_up does not take a file of these kinds (after "<operation>
# is not done: ")
REWRITE_REFUSALS = {
    "DoRA": "its dora_scale sets the norm of each slice of W + s*B*A (the base weight plus the LoRA part), so a "
            "changed LoRA part would be renormalised along another direction than the trained one; merge it "
            "into a model with merge_lora.py --sd_model",
    "LyCORIS full": "it holds whole weight differences (diff), not lora_down / lora_up factors; merge it into a "
                    "model with merge_lora.py --sd_model (extract_lora_from_models.py then makes a LoRA of it)",
}


def read_lora(path: str, operation: str | None = None) -> tuple[dict[str, Module], dict[str, str]]:
    """The file's modules by kohya name and its metadata; a one-line LoRAError for a missing,
    unreadable or non-LoRA file (``operation``: what the tool does, named in a refusal)."""
    sd = load_state_dict_file(path)
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise LoRAError(f"{path}: not a LoRA file (no flat tensor dictionary)")
    return modules_of(sd, path, operation), read_metadata(path)


def modules_of(sd: dict[str, torch.Tensor], source: str = "state dict",
               operation: str | None = None) -> dict[str, Module]:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        if "." not in key:
            raise LoRAError(f"{source}: key {key!r} is not a LoRA module key (expected <name>.lora_down.weight ...)")
        name, rest = key.split(".", 1)
        parts.setdefault(name, {})[rest] = value
    other = [k for k in file_kinds(sd) if k != "LoRA"]
    refused = next((k for k in other if k in REWRITE_REFUSALS), None)
    if refused:
        raise LoRAError(f"{source}: a {refused} file: {operation or 'rewriting its lora_down / lora_up'} is not "
                        f"done: {REWRITE_REFUSALS[refused]}")
    if other:  # LoHa / LoKr / OFT / LyCORIS: not a product of two matrices
        raise LoRAError(f"{source}: a {'/'.join(other)} file; this tool handles LoRA files only (LoRA, LoCon, "
                        "DyLoRA, LoRA-FA: lora_down/lora_up/alpha)")
    if not any("lora_down.weight" in p for p in parts.values()):
        raise LoRAError(f"{source}: no '*.lora_down.weight' keys, not a kohya LoRA file")
    _, alphas = dims_from_weights(sd)  # the loader's rule: no .alpha means alpha = rank
    out: dict[str, Module] = {}
    for name, p in sorted(parts.items()):
        extra = sorted(set(p) - {"lora_down.weight", "lora_up.weight", "alpha"})
        if extra:
            raise LoRAError(f"{source}: module {name} has {extra[0]!r}: only LoRA/LoCon modules "
                            f"(lora_down, lora_up, alpha) are supported, not LoHa/LoKr/DoRA")
        if "lora_down.weight" not in p or "lora_up.weight" not in p:
            missing = "lora_up.weight" if "lora_down.weight" in p else "lora_down.weight"
            raise LoRAError(f"{source}: module {name} has no {missing}")
        down, up = p["lora_down.weight"], p["lora_up.weight"]
        for part, t in p.items():
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise LoRAError(f"{source}: module {name} has non-finite values in {part}")
        if down.dim() not in (2, 4) or up.dim() != down.dim() or up.shape[1] != down.shape[0] or (
                up.dim() == 4 and tuple(up.shape[2:]) != (1, 1)):
            raise LoRAError(f"{source}: module {name} has inconsistent shapes: lora_down "
                            f"{tuple(down.shape)}, lora_up {tuple(up.shape)}")
        alpha = float(torch.as_tensor(alphas[name]).float())
        if alpha == 0:  # as LoRAModule: alpha 0 means "no scaling"
            alpha = float(down.shape[0])
        out[name] = Module(name, down, up, alpha)
    return out


def check_lora_path(option: str, path: str) -> None:
    if not os.path.isfile(path):
        raise LoRAError(f"{option}: file not found: {path}")


def check_save_to(path: str) -> None:
    if not path.lower().endswith(LORA_FILE_SUFFIXES):
        raise LoRAError(f"--save_to {path}: must end in {', '.join(LORA_FILE_SUFFIXES)}")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise LoRAError(f"--save_to {path}: is a folder")
    existing = folder
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK):
        raise LoRAError(f"--save_to {path}: folder {existing} is not writable")


def state_dict_of(modules: dict[str, Module]) -> dict[str, torch.Tensor]:
    sd = {}
    for name, m in modules.items():
        sd[name + ".lora_down.weight"] = m.down
        sd[name + ".lora_up.weight"] = m.up
        sd[name + ".alpha"] = torch.tensor(float(m.alpha))
    return sd


def save_lora(path: str, modules: dict[str, Module], metadata: dict[str, str], dtype: torch.dtype | None) -> None:
    """The tools' modules written by the one LoRA writer (networks/lora.py ``write_weights``)."""
    write_weights(path, state_dict_of(modules), dtype, metadata)


# --- metadata ---------------------------------------------------------------------------------

def _uniform(values: list, fmt) -> str | None:
    return (fmt(values[0]) if len(set(values)) == 1 else "Dynamic") if values else None


def rank_metadata(modules: dict[str, Module], metadata: dict[str, str]) -> dict[str, str]:
    """metadata with ss_network_dim / ss_network_alpha (Linear and 1x1 modules) and conv_dim /
    conv_alpha in ss_network_args (3x3 modules) set from the modules: the common value, or
    "Dynamic" when they differ (what sd-scripts writes for varying ranks)."""
    out = dict(metadata)
    small = [m for m in modules.values() if not m.is_conv3x3]
    conv = [m for m in modules.values() if m.is_conv3x3]
    dim = _uniform([m.rank for m in small], str)
    alpha = _uniform([m.alpha for m in small], lambda a: str(float(a)))
    if dim is not None:
        out["ss_network_dim"], out["ss_network_alpha"] = dim, alpha
    try:
        args = json.loads(out.get("ss_network_args") or "{}")
        args = args if isinstance(args, dict) else {}
    except json.JSONDecodeError:
        args = {}
    if conv:
        args["conv_dim"] = _uniform([m.rank for m in conv], str)
        args["conv_alpha"] = _uniform([m.alpha for m in conv], lambda a: str(float(a)))
    else:
        args.pop("conv_dim", None)
        args.pop("conv_alpha", None)
    out["ss_network_args"] = json.dumps(args)
    out.setdefault("ss_network_module", "networks.lora")
    return out


def add_comment(metadata: dict[str, str], note: str) -> dict[str, str]:
    """Prepend what a tool did to ss_training_comment (sd-scripts' resize_lora does the same)."""
    out = dict(metadata)
    old = out.get("ss_training_comment")
    out["ss_training_comment"] = note if not old or old == "None" else f"{note}; {old}"
    return out


def title_of(path: str, metadata: dict[str, str]) -> str:
    return metadata.get("modelspec.title") or os.path.splitext(os.path.basename(path))[0]


def _sd_family_of(base_model_version: str) -> str | None:
    """The SD family whose files carry this ss_base_model_version (its home's metadata), or None."""
    for fam in registry.FAMILIES.values():
        if fam.flow is None and \
                registry.home(fam.name).metadata_fields("epsilon", None)["ss_base_model_version"] == base_model_version:
            return fam.name
    return None


def lora_modelspec(metadata: dict[str, str], save_to: str, merged_from: list[str] | None = None) -> dict[str, str]:
    """modelspec.* for a LoRA written by a tool: title and date of the new file, architecture from
    the inputs' ss_base_model_version / modelspec when known."""
    out = dict(metadata)
    family = _sd_family_of(metadata.get("ss_base_model_version", ""))
    if family is not None and "modelspec.architecture" not in out:
        prediction = "v" if out.get("modelspec.prediction_type") == "v" else "epsilon"
        fields = registry.home(family).metadata_fields(prediction, "lora")  # the family's own strings
        out["modelspec.architecture"] = fields["modelspec.architecture"]
        out["modelspec.implementation"] = fields["modelspec.implementation"]
    out["modelspec.sai_model_spec"] = "1.0.0"
    out["modelspec.title"] = os.path.splitext(os.path.basename(save_to))[0]
    out["modelspec.date"] = datetime.datetime.now().isoformat(timespec="seconds")
    if merged_from:
        out["modelspec.merged_from"] = ", ".join(merged_from)
    return out


# --- low-rank factorisation ---------------------------------------------------------------------

def max_rank(weight_shape: tuple[int, ...]) -> int:
    """The largest rank a delta of this shape can have: min(out, in * k * k)."""
    return min(weight_shape[0], math.prod(weight_shape[1:]))


def svd(delta: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U, S, Vh of the delta flattened to (out, in * k * k), in float32 (on device), S descending."""
    mat = delta.to(device=device, dtype=torch.float32).reshape(delta.shape[0], -1)
    return torch.linalg.svd(mat, full_matrices=False)


def factored_svd(m: Module, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U, S, Vh of the module's up @ down (without its scale), flattened to (out, in * k * k),
    computed from the factors: with up = Qu Ru and down^T = Qd Rd, up @ down = Qu (Ru Rd^T) Qd^T,
    so only a rank x rank matrix is decomposed. Exact (no low-rank iteration) and O(n * rank^2)
    instead of the full SVD's O(n^3); S has at most `rank` entries, the delta's whole spectrum."""
    up = m.up.to(device=device, dtype=torch.float32).reshape(m.up.shape[0], m.rank)
    down = m.down.to(device=device, dtype=torch.float32).reshape(m.rank, -1)
    qu, ru = torch.linalg.qr(up)
    qd, rd = torch.linalg.qr(down.T)
    um, S, vmh = torch.linalg.svd(ru @ rd.T, full_matrices=False)
    return qu @ um, S, vmh @ qd.T


def factor(U: torch.Tensor, S: torch.Tensor, Vh: torch.Tensor, rank: int,
           weight_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(down, up) of the rank-`rank` truncation, singular values in up (sd-scripts): down is
    (rank, in[, k, k]), up is (out, rank[, 1, 1]); up @ down is the truncated delta (scale 1)."""
    up = (U[:, :rank] * S[:rank]).cpu()
    down = Vh[:rank].cpu()
    if len(weight_shape) == 4:
        return down.reshape(rank, *weight_shape[1:]), up.reshape(weight_shape[0], rank, 1, 1)
    return down.reshape(rank, weight_shape[1]), up


def clamp_quantile(down: torch.Tensor, up: torch.Tensor, quantile: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sd-scripts' outlier clamp: both factors to +-(the quantile of their joined values).
    quantile 1 (or above) leaves them as they are."""
    if quantile >= 1:
        return down, up
    dist = torch.cat([up.flatten(), down.flatten()]).float()
    if dist.numel() <= _QUANTILE_LIMIT:
        hi = float(torch.quantile(dist, quantile))
    else:
        hi = float(np.quantile(dist.numpy(), quantile))
    return down.clamp(-hi, hi), up.clamp(-hi, hi)


def module_from_delta(name: str, delta: torch.Tensor, rank: int, device, quantile: float) -> Module:
    """The rank-``rank`` LoRA module of a weight difference (the extract tools): its SVD
    truncated, split into down / up, clamped at ``quantile``; alpha = rank."""
    U, S, Vh = svd(delta, device)
    down, up = factor(U, S, Vh, rank, tuple(delta.shape))
    down, up = clamp_quantile(down, up, quantile)
    return Module(name, down, up, float(rank))


def check_dynamic(method: str | None, param: float | None) -> None:
    """The range each criterion's parameter must have (one line naming the option)."""
    if method is None:
        if param is not None:
            raise LoRAError("--dynamic_param is given without --dynamic_method")
        return
    if method not in DYNAMIC_METHODS:
        raise LoRAError(f"--dynamic_method {method!r}: expected one of {', '.join(DYNAMIC_METHODS)}")
    if param is None:
        raise LoRAError(f"--dynamic_method {method} needs --dynamic_param")
    if not math.isfinite(param):
        raise LoRAError(f"--dynamic_param {param}: must be a finite number")
    if method == "sv_ratio" and param < 1:
        raise LoRAError(f"--dynamic_param {param}: sv_ratio keeps singular values >= S_max / param, so it must be >= 1")
    if method in ("sv_fro", "sv_cumulative") and not 0 < param <= 1:
        raise LoRAError(f"--dynamic_param {param}: {method} is a retained fraction, so it must be in (0, 1]")


def dynamic_rank(S: torch.Tensor, method: str, param: float) -> int:
    """The smallest rank that meets the criterion (at least 1), over singular values S (descending):
    sv_ratio: keep every S_i >= S_0 / param; sv_cumulative: sum(S[:r]) >= param * sum(S);
    sv_fro: sqrt(sum(S[:r]^2)) >= param * ||S||. (sd-scripts keeps one more than this.)"""
    s = S.detach().double().cpu()
    if len(s) == 0 or float(s[0]) <= MIN_SV:
        return 1
    if method == "sv_ratio":
        r = int((s >= s[0] / param).sum())
    else:
        v = s if method == "sv_cumulative" else s.pow(2)
        target = param if method == "sv_cumulative" else param ** 2
        frac = torch.cumsum(v, 0) / v.sum()
        # A relative tolerance so that a criterion met exactly is not missed by rounding.
        r = int((frac < target * (1 - 1e-12)).sum()) + 1
    return max(1, min(r, len(s)))


def retained(S: torch.Tensor, rank: int) -> tuple[float, float]:
    """(Frobenius fraction, sum-of-singular-values fraction) a rank-`rank` truncation keeps."""
    s = S.detach().double().cpu()
    total_fro, total_sum = float(s.pow(2).sum().sqrt()), float(s.sum())
    if total_fro == 0:
        return 1.0, 1.0
    return float(s[:rank].pow(2).sum().sqrt()) / total_fro, float(s[:rank].sum()) / total_sum


# --- several files ------------------------------------------------------------------------------

@dataclass
class LoRAInput:
    path: str
    modules: dict[str, Module]
    metadata: dict[str, str]
    ratio: float


def read_inputs(paths: list[str], ratios: list[float], operation: str | None = None) -> list[LoRAInput]:
    """Every file read and checked to belong to one base model: the same ss_base_model_version
    where recorded, and the same weight shape for every module name they share."""
    for path in paths:
        check_lora_path("--models", path)
    inputs = [LoRAInput(path, *read_lora(path, operation), ratio) for path, ratio in zip(paths, ratios)]
    first_base: tuple[str, str] | None = None
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for inp in inputs:
        base = inp.metadata.get("ss_base_model_version")
        if base:
            if first_base is not None and base != first_base[0]:
                raise LoRAError(f"{inp.path} is for {base} but {first_base[1]} is for {first_base[0]}")
            first_base = first_base or (base, inp.path)
        for name, m in inp.modules.items():
            seen = shapes.setdefault(name, (m.weight_shape, inp.path))
            if seen[0] != m.weight_shape:
                raise LoRAError(f"mismatched modules: {name} is {seen[0]} in {seen[1]} but {m.weight_shape} "
                                f"in {inp.path} (LoRAs for different base models?)")
    return inputs


def add_lbws(p) -> None:
    """The merge tools' --lbws (sd-scripts' name): one LoRA Block Weight list per file."""
    p.add_argument("--lbws", nargs="+", default=None,
                   help="per file, block weights as a JSON list: 17 or 26 values (SD1/SD2), 12 or 20 (SDXL), "
                        "e.g. '[1,1,1,1,1,1,1,1,1,1,1,0.5,0.5,0.5,0.5,0.5,0.5]'")


def check_lbws_family(lbw_sdxl: bool, is_sdxl: bool, what: str) -> None:
    """--lbws lists of one family's length for a LoRA / model of the other: one line naming it."""
    if lbw_sdxl != is_sdxl:
        fam = {True: "SDXL", False: "SD1/SD2"}
        raise LoRAError(f"--lbws: the lists have {fam[lbw_sdxl]}'s lengths ({'12 or 20' if lbw_sdxl else '17 or 26'}) "
                        f"but {what} is {fam[is_sdxl]}")


def block_weighted(inputs: list[LoRAInput], weights: list[list[float]], lbw_sdxl: bool) -> list[LoRAInput]:
    """Each input's modules with their block's weight (lora_blocks.lbw_factor) folded into the
    down factor, so a module's delta is scaled by it exactly once."""
    out = []
    for inp, w in zip(inputs, weights):
        is_sdxl = lora_blocks.is_sdxl_names(inp.modules)
        check_lbws_family(lbw_sdxl, is_sdxl, inp.path)
        modules = {name: Module(name, m.down.float() * lora_blocks.lbw_factor(w, name, is_sdxl), m.up, m.alpha)
                   for name, m in inp.modules.items()}
        out.append(replace(inp, modules=modules))
    return out


def common_metadata(inputs: list[LoRAInput]) -> dict[str, str]:
    """The minimum ss_* metadata of a file made from several: base model and v2 from the first
    file that records them (sd-scripts' rule). The network module is networks.lora, or the
    FLUX.1 / SD3 module when every input names that one (a file networks.lora_flux can read back)."""
    modules = {inp.metadata.get("ss_network_module") for inp in inputs}
    dit = modules & {"networks.lora_flux", "networks.lora_sd3"}
    out = {"ss_network_module": dit.pop() if len(modules) == 1 and dit else "networks.lora"}
    for key in ("ss_v2", "ss_base_model_version", "modelspec.architecture", "modelspec.implementation",
                "modelspec.prediction_type"):
        for inp in inputs:
            if inp.metadata.get(key):
                out[key] = inp.metadata[key]
                break
    return out


def concat(inputs: list[LoRAInput], shuffle: bool = False,
           generator: torch.Generator | None = None) -> dict[str, Module]:
    """Per module: the inputs' ranks stacked (down rows, up columns), alpha = the total rank
    (scale 1), each input's s = ratio * alpha / rank split as sqrt(|s|) into its up and
    sign(s) * sqrt(|s|) into its down, so up @ down = sum_i ratio_i * delta_i exactly (up to
    float rounding). shuffle permutes the stacked ranks (the product is unchanged), as
    sd-scripts' merge_lora --shuffle."""
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for inp in inputs:
        for name, m in inp.modules.items():
            s = inp.ratio * m.scale
            root = math.sqrt(abs(s))
            parts.setdefault(name, []).append((m.down.float() * math.copysign(root, s), m.up.float() * root))
    out = {}
    for name, pieces in parts.items():
        down = torch.cat([d for d, _ in pieces], dim=0)
        up = torch.cat([u for _, u in pieces], dim=1)
        if shuffle:
            perm = torch.randperm(down.shape[0], generator=generator)
            down, up = down[perm], up[:, perm]
        out[name] = Module(name, down, up, float(down.shape[0]))
    return out

