"""FLUX.1 LoRA in ai-toolkit's layout (diffusers / PEFT names), and the conversion to and from
kohya's layout (networks.lora_flux, sd-scripts), as sd-scripts' networks/convert_flux_lora.py does it.

ai-toolkit's file: ``transformer.<diffusers module>.lora_A.weight`` (down, rank x in) and
``.lora_B.weight`` (up, out x rank), no alpha (scale 1), the fused BFL projections kept apart
(``attn.to_q`` / ``to_k`` / ``to_v``, a single block's ``proj_mlp``). The module map is the one the
model loader uses between the BFL and diffusers layouts (library/models/families/flux/flux_checkpoint.py).

kohya -> ai-toolkit (sd-scripts' arithmetic): the scale alpha / rank goes into the factors
(into lora_A, balanced by powers of two with lora_B when it is below 1/2); a fused qkv / linear1
module whose up is block-diagonal (sd-scripts' and our split_qkv files: rank = parts x r) is cut
into its parts' own downs and ups, any other gives every part the whole down and its rows of up.
ai-toolkit -> kohya: one module per part renamed, alpha = rank; the parts of a fused projection
concatenated into one module of the summed rank (downs stacked, ups block-diagonal), alpha = that
rank. Either way every weight's delta is unchanged. Beyond sd-scripts: any number of blocks and
any width (sd-scripts assumes FLUX.1's 19 / 38 blocks and width 3072 for linear1), the input
layers and the final layer, parts of unequal rank, ``.alpha`` keys and diffusers'
``lora_adapter_metadata`` (lora_alpha) on the ai-toolkit side. Text-encoder modules have no
ai-toolkit form: they are left out with a warning, as sd-scripts does.
"""
from __future__ import annotations

import json
import re

import torch

from library.models.families.flux import flux_checkpoint
from networks.lora import LoRAError
from networks.lora_svd import Module

AIT_PREFIX = "transformer."
KOHYA_UNET = "lora_unet_"
ADAPTER_METADATA = "lora_adapter_metadata"  # diffusers' save_lora_weights: the PEFT LoraConfig
_KOHYA_BLOCK = re.compile(r"^lora_unet_(double|single)_blocks_(\d+)_")
_AIT_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.")
_AIT_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".alpha")


def _linear_rules(double: int, single: int) -> list[tuple[str, list[str], str]]:
    """(kohya name, [diffusers modules], kind) of every Linear of a FLUX.1 transformer with these
    block counts (norm scales are not LoRA targets)."""
    return [(KOHYA_UNET + b.replace(".", "_"), ds, kind)
            for b, ds, kind in flux_checkpoint.module_rules(double, single, guidance_embed=True)
            if not b.endswith((".scale", ".weight"))]


def _depths(names, pattern: re.Pattern, kinds: tuple[str, str]) -> tuple[int, int]:
    found = {kinds[0]: 0, kinds[1]: 0}
    for n in names:
        m = pattern.match(n)
        if m:
            found[m.group(1)] = max(found[m.group(1)], int(m.group(2)) + 1)
    return found[kinds[0]], found[kinds[1]]


def _part_widths(kind: str, rows: int, hidden: int, name: str) -> list[int]:
    if kind == "qkv":
        if rows % 3:
            raise LoRAError(f"{name}: lora_up has {rows} rows, not three equal q, k, v parts")
        return [rows // 3] * 3
    if kind == "qkvm":
        if rows <= 3 * hidden:
            raise LoRAError(f"{name}: lora_up has {rows} rows, not q, k, v of width {hidden} and an MLP input")
        return [hidden, hidden, hidden, rows - 3 * hidden]
    return [rows]


def _scale_split(scale: float) -> tuple[float, float]:
    """sd-scripts' (scale_down, scale_up): the scale into lora_A, moved into lora_B by powers of two
    while lora_A's share is below half of lora_B's (so small scales are shared, exactly)."""
    down, up = scale, 1.0
    while down * 2 < up:
        down *= 2
        up /= 2
    return down, up


def _block_diagonal(up: torch.Tensor, widths: list[int], parts: int) -> bool:
    """Whether up (sum(widths) x rank) is block-diagonal with rank / parts columns per part."""
    rank = up.shape[1]
    if rank % parts:
        return False
    r = rank // parts
    row = 0
    for j, w in enumerate(widths):
        block = up[row:row + w]
        if torch.count_nonzero(block[:, :j * r]) or torch.count_nonzero(block[:, (j + 1) * r:]):
            return False
        row += w
    return True


def to_ai_toolkit(modules: dict[str, Module], source: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """kohya FLUX.1 modules (networks.lora_svd.read_lora) -> (ai-toolkit state dict, names of the
    text-encoder modules left out)."""
    dropped = sorted(n for n in modules if n.startswith("lora_te"))
    rules = {name: (ds, kind) for name, ds, kind in _linear_rules(*_depths(modules, _KOHYA_BLOCK, ("double", "single")))}
    unknown = sorted(n for n in modules if n not in rules and n not in dropped)
    if unknown:
        raise LoRAError(f"{source}: module {unknown[0]} is not one of a FLUX.1 transformer "
                        f"({len(unknown)} such; a LoRA of another model?)")
    if len(dropped) == len(modules):
        raise LoRAError(f"{source}: no FLUX.1 transformer modules (lora_unet_double_blocks_... / single_blocks_...)")
    out = {}
    for name, m in modules.items():
        if name in dropped:
            continue
        if m.down.dim() != 2:
            raise LoRAError(f"{source}: module {name} is not a Linear LoRA (lora_down {tuple(m.down.shape)})")
        ds, kind = rules[name]
        s_down, s_up = _scale_split(m.alpha / m.rank)
        down, up = m.down * s_down, m.up * s_up
        keys = [AIT_PREFIX + d for d in ds]
        if kind == "swap":  # final_layer.adaLN_modulation: (shift, scale) in BFL, (scale, shift) in diffusers
            up = flux_checkpoint.split_fused(up, kind, 0)[0]
        widths = _part_widths(kind, up.shape[0], down.shape[1], f"{source}: module {name}")
        if len(widths) == 1:
            out[keys[0] + ".lora_A.weight"], out[keys[0] + ".lora_B.weight"] = down, up
            continue
        ups = torch.split(up, widths, dim=0)
        if _block_diagonal(up, widths, len(widths)):
            r = m.rank // len(widths)
            for j, key in enumerate(keys):
                out[key + ".lora_A.weight"] = down[j * r:(j + 1) * r]
                out[key + ".lora_B.weight"] = ups[j][:, j * r:(j + 1) * r]
        else:
            for key, u in zip(keys, ups):
                out[key + ".lora_A.weight"], out[key + ".lora_B.weight"] = down, u
    return {k: v.contiguous() for k, v in out.items()}, dropped


def _adapter_alpha(metadata: dict[str, str], source: str) -> float | None:
    """lora_alpha of diffusers' PEFT metadata for the transformer, or None (scale 1)."""
    raw = metadata.get(ADAPTER_METADATA)
    if not raw:
        return None
    try:
        cfg = json.loads(raw)
        cfg = {k[len(AIT_PREFIX):]: v for k, v in cfg.items() if k.startswith(AIT_PREFIX)} or cfg
    except (json.JSONDecodeError, AttributeError):
        raise LoRAError(f"{source}: metadata {ADAPTER_METADATA} is not a JSON object") from None
    if cfg.get("alpha_pattern") or cfg.get("use_rslora") or cfg.get("use_dora"):
        key = next(k for k in ("alpha_pattern", "use_rslora", "use_dora") if cfg.get(k))
        raise LoRAError(f"{source}: metadata {ADAPTER_METADATA} sets {key}, which this converter does not handle")
    return None if cfg.get("lora_alpha") is None else float(cfg["lora_alpha"])


def _ait_modules(sd: dict[str, torch.Tensor], source: str) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """{diffusers module: {"A", "B"[, "alpha"]}} with the prefix removed, and the text-encoder keys left out."""
    if any(k.endswith((".lora_down.weight", ".lora_up.weight")) for k in sd):
        raise LoRAError(f"{source}: a kohya (sd-scripts) LoRA file (lora_down / lora_up keys); use --src sd-scripts")
    dropped, parts = [], {}
    for key, value in sd.items():
        if key.startswith("text_encoder"):
            dropped.append(key)
            continue
        suffix = next((s for s in _AIT_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise LoRAError(f"{source}: key {key} is not a LoRA key of ai-toolkit's layout "
                            "(<module>.lora_A.weight / .lora_B.weight)")
        module = key[:-len(suffix)]
        module = module[len(AIT_PREFIX):] if module.startswith(AIT_PREFIX) else module
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise LoRAError(f"{source}: {key} has non-finite values")
        parts.setdefault(module, {})[{".lora_A.weight": "A", ".lora_B.weight": "B", ".alpha": "alpha"}[suffix]] = value
    for module, p in parts.items():
        if "A" not in p or "B" not in p:
            raise LoRAError(f"{source}: module {module} has no {'lora_B' if 'A' in p else 'lora_A'}.weight")
        if p["A"].dim() != 2 or p["B"].dim() != 2 or p["B"].shape[1] != p["A"].shape[0]:
            raise LoRAError(f"{source}: module {module} has inconsistent shapes: lora_A {tuple(p['A'].shape)}, "
                            f"lora_B {tuple(p['B'].shape)}")
    return parts, sorted(dropped)


def from_ai_toolkit(sd: dict[str, torch.Tensor], metadata: dict[str, str],
                    source: str) -> tuple[dict[str, Module], list[str]]:
    """An ai-toolkit (diffusers / PEFT layout) FLUX.1 LoRA -> (kohya modules, text-encoder keys
    left out)."""
    parts, dropped = _ait_modules(sd, source)
    if not parts:
        raise LoRAError(f"{source}: no FLUX.1 transformer modules (transformer.transformer_blocks.N...)")
    meta_alpha = _adapter_alpha(metadata, source)
    rules = _linear_rules(*_depths(parts, _AIT_BLOCK, ("transformer_blocks", "single_transformer_blocks")))
    used, out = set(), {}
    for name, ds, kind in rules:
        present = [d for d in ds if d in parts]
        if not present:
            continue
        if len(present) < len(ds):
            missing = next(d for d in ds if d not in parts)
            raise LoRAError(f"{source}: has {present[0]} but not {missing}: the parts of {name} go together")
        downs, ups = [], []
        for d in ds:
            p = parts[d]
            rank = p["A"].shape[0]
            alpha = float(p["alpha"]) if "alpha" in p else meta_alpha
            scale = 1.0 if alpha is None else alpha / rank
            downs.append(p["A"])
            ups.append(p["B"] if scale == 1.0 or len(ds) == 1 else p["B"] * scale)
            used.add(d)
        if len({a.shape[1] for a in downs}) > 1:
            raise LoRAError(f"{source}: the parts of {name} ({', '.join(ds)}) have different input widths")
        if len(ds) == 1:
            up = flux_checkpoint.split_fused(ups[0], kind, 0)[0] if kind == "swap" else ups[0]
            out[name] = Module(name, downs[0], up, scale * downs[0].shape[0])
            continue
        down = torch.cat(downs, dim=0)
        up = torch.zeros(sum(u.shape[0] for u in ups), down.shape[0], dtype=ups[0].dtype)
        row = col = 0
        for u in ups:
            up[row:row + u.shape[0], col:col + u.shape[1]] = u
            row, col = row + u.shape[0], col + u.shape[1]
        out[name] = Module(name, down, up, float(down.shape[0]))
    unknown = sorted(set(parts) - used)
    if unknown:
        raise LoRAError(f"{source}: module {unknown[0]} is not one of a FLUX.1 transformer "
                        f"({len(unknown)} such; a LoRA of another model?)")
    return out, dropped
