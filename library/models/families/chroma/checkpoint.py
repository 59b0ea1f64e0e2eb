"""Chroma's transformer files: the original single-file layout (``Chroma1-HD.safetensors``, as
sd-scripts and ComfyUI read it, also with ComfyUI's ``model.diffusion_model.`` prefix) and a
diffusers ``ChromaTransformer2DModel`` folder (converted to the original layout on load, and back
on save), told apart and sized from keys and shapes before any tensor is read.

    layout_of(keys)                  "original" | "diffusers" | None (not Chroma)
    config_from_original(shapes, path, record) / config_from_diffusers(config_json, path)
    read_transformer(path, dtype)    TransformerWeights (original layout)
    build(weights) -> Chroma         save_transformer(path, state_dict, layout, config, ...)
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from library import safetensors_file
from library.errors import ModelError, first_line
from library.files import atomic_dir, atomic_path
from library.models import embedded_config, fp8_storage
from library.models.families.flux import flux_checkpoint
from library.models.families.chroma.model import Chroma, ChromaConfig
from library.models.sd_checkpoint import read_state_dict

PREFIX = "model.diffusion_model."  # ComfyUI-style full checkpoints nest the transformer here
MARKER = "distilled_guidance_layer.in_proj.weight"  # in both layouts
ORIGINAL_MARKER = "img_in.weight"
DIFFUSERS_MARKER = "x_embedder.weight"
DIFFUSERS_CLASS = "ChromaTransformer2DModel"
META_CONFIG_KEY = "sdtk.chroma_config"  # the ChromaConfig of files this toolkit writes (tiny widths)

# original tensor -> diffusers tensors, with flux_checkpoint.split_fused's kinds: FLUX.1's rules
# without its modulation layers (Chroma's blocks have none)
_DOUBLE = [r for r in flux_checkpoint._DOUBLE if r[0] not in ("img_mod.lin", "txt_mod.lin")]
_SINGLE = [r for r in flux_checkpoint._SINGLE if r[0] != "modulation.lin"]
_TOP = [
    ("img_in", ["x_embedder"], "same"),
    ("txt_in", ["context_embedder"], "same"),
    ("distilled_guidance_layer.in_proj", ["distilled_guidance_layer.in_proj"], "same"),
    ("distilled_guidance_layer.out_proj", ["distilled_guidance_layer.out_proj"], "same"),
    ("final_layer.linear", ["proj_out"], "same"),
]


def _rules(config: ChromaConfig) -> list:
    """(original name, [diffusers names], kind) of every tensor of a model of this shape."""
    modules = [(f"double_blocks.{i}.{b}", [f"transformer_blocks.{i}.{d}" for d in ds], k)
               for i in range(config.depth) for b, ds, k in _DOUBLE]
    modules += [(f"single_blocks.{i}.{b}", [f"single_transformer_blocks.{i}.{d}" for d in ds], k)
                for i in range(config.depth_single_blocks) for b, ds, k in _SINGLE]
    modules += _TOP
    for i in range(config.approximator_depth):
        p = f"distilled_guidance_layer.layers.{i}."
        modules += [(p + "in_layer", [p + "linear_1"], "same"), (p + "out_layer", [p + "linear_2"], "same"),
                    (f"distilled_guidance_layer.norms.{i}.scale", [f"distilled_guidance_layer.norms.{i}.weight"], "same")]
    out = []
    for b, ds, k in modules:
        if b.endswith(".scale"):
            out.append((b, ds, k))
        else:
            out += [(f"{b}.{p}", [f"{d}.{p}" for d in ds], k) for p in ("weight", "bias")]
    return out


def layout_of(keys) -> str | None:
    """'original', 'diffusers', or None when the keys are not a Chroma transformer's."""
    keys = set(keys)
    if MARKER in keys and ORIGINAL_MARKER in keys or PREFIX + MARKER in keys:
        return "original"
    if MARKER in keys and DIFFUSERS_MARKER in keys:
        return "diffusers"
    return None


def _count(keys, prefix: str) -> int:
    idx = {int(k[len(prefix):].split(".", 1)[0]) for k in keys if k.startswith(prefix)}
    return max(idx) + 1 if idx else 0


def _axes(head_dim: int, record: dict | None, path: str) -> dict:
    """The RoPE axes: the file's record (this toolkit's files), else Chroma's (16, 56, 56)."""
    if record is not None:
        try:
            return {"axes_dim": tuple(int(d) for d in record["axes_dim"]), "theta": int(record["theta"])}
        except (KeyError, TypeError, ValueError):
            raise ModelError(f"{path}: metadata {META_CONFIG_KEY} is not a Chroma config") from None
    if head_dim != sum(ChromaConfig.axes_dim):
        raise ModelError(f"{path}: a Chroma transformer with head dim {head_dim} and no config: its RoPE axes "
                         "are unknown")
    return {}


def config_from_original(sd: dict, path: str, record: dict | None = None) -> ChromaConfig:
    """The ChromaConfig of original-layout weights (anything with ``.shape``), from the shapes."""
    try:
        hidden, in_ch = sd["img_in.weight"].shape
        head_dim = sd["double_blocks.0.img_attn.norm.query_norm.scale"].shape[0]
        approx_hidden, approx_in = sd[MARKER].shape
        cfg = ChromaConfig(in_channels=in_ch, context_in_dim=sd["txt_in.weight"].shape[1], hidden_size=hidden,
                           mlp_ratio=sd["double_blocks.0.img_mlp.0.weight"].shape[0] / hidden,
                           num_heads=hidden // head_dim, depth=_count(sd, "double_blocks."),
                           depth_single_blocks=_count(sd, "single_blocks."),
                           qkv_bias="double_blocks.0.img_attn.qkv.bias" in sd, approximator_in_dim=approx_in,
                           approximator_depth=_count(sd, "distilled_guidance_layer.layers."),
                           approximator_hidden_size=approx_hidden)
    except KeyError as e:
        raise ModelError(f"{path}: not a whole Chroma transformer (no {e.args[0]})") from None
    return dataclasses.replace(cfg, **_axes(head_dim, record, path))


def config_from_diffusers(cfg: dict, path: str) -> ChromaConfig:
    """The ChromaConfig of a ChromaTransformer2DModel config.json."""
    try:
        heads, head_dim = int(cfg.get("num_attention_heads", 24)), int(cfg.get("attention_head_dim", 128))
        if int(cfg.get("patch_size", 1)) != 1:
            raise ValueError(f"patch_size {cfg['patch_size']}")
        return ChromaConfig(in_channels=int(cfg.get("in_channels", 64)),
                            context_in_dim=int(cfg.get("joint_attention_dim", 4096)), hidden_size=heads * head_dim,
                            num_heads=heads, depth=int(cfg.get("num_layers", 19)),
                            depth_single_blocks=int(cfg.get("num_single_layers", 38)),
                            axes_dim=tuple(int(d) for d in cfg.get("axes_dims_rope", (16, 56, 56))),
                            approximator_in_dim=int(cfg.get("approximator_num_channels", 64)),
                            approximator_depth=int(cfg.get("approximator_layers", 5)),
                            approximator_hidden_size=int(cfg.get("approximator_hidden_dim", 5120)))
    except (TypeError, ValueError) as e:
        raise ModelError(f"{path}: not a Chroma transformer config ({first_line(e, typed=True)})") from None


def diffusers_config(config: ChromaConfig) -> dict:
    return {"_class_name": DIFFUSERS_CLASS, "patch_size": 1, "in_channels": config.in_channels,
            "out_channels": None, "num_layers": config.depth, "num_single_layers": config.depth_single_blocks,
            "attention_head_dim": config.head_dim, "num_attention_heads": config.num_heads,
            "joint_attention_dim": config.context_in_dim, "axes_dims_rope": list(config.axes_dim),
            "approximator_num_channels": config.approximator_in_dim,
            "approximator_hidden_dim": config.approximator_hidden_size,
            "approximator_layers": config.approximator_depth}


def to_diffusers(sd: dict, config: ChromaConfig) -> dict:
    out = {}
    for b, ds, kind in _rules(config):
        if b not in sd:
            raise ModelError(f"Chroma transformer: missing tensor {b}")
        for d, t in zip(ds, flux_checkpoint.split_fused(sd[b], kind, config.hidden_size)):
            out[d] = t
    return out


def from_diffusers(sd: dict, config: ChromaConfig, path: str) -> dict:
    rules = _rules(config)
    missing = sorted({d for _, ds, _ in rules for d in ds} - sd.keys())
    if missing:
        raise ModelError(f"{path}: not a whole diffusers Chroma transformer (no {missing[0]})")
    return {b: sd[ds[0]] if len(ds) == 1 else torch.cat([sd[d] for d in ds], dim=0) for b, ds, _ in rules}


# --- reading ---------------------------------------------------------------------------------

@dataclasses.dataclass
class TransformerWeights:
    state_dict: dict  # original layout, prefix removed
    config: ChromaConfig
    layout: str       # 'original' or 'diffusers': saved back in it


def transformer_folder(path: str) -> str | None:
    """The ChromaTransformer2DModel folder of ``path`` (a pipeline folder's transformer/, or the
    folder itself), from its config.json's class; None when it is not one."""
    for folder in (os.path.join(path, "transformer"), path):
        try:
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                if json.load(f).get("_class_name") == DIFFUSERS_CLASS:
                    return folder
        except (OSError, ValueError, AttributeError):
            continue
    return None


def read_transformer(path: str, dtype: torch.dtype | None = torch.float32) -> TransformerWeights:
    """The weights, in the original layout, from an original single file (with or without the
    ``model.diffusion_model.`` prefix, fp8-stored or not) or a diffusers Chroma folder."""
    if os.path.isdir(path):
        return _read_folder(path, dtype)
    sd, meta = read_state_dict(path)
    if layout_of(sd.keys()) is None:
        raise ModelError(f"{path}: not a Chroma transformer (no {MARKER})")
    if any(k.startswith(PREFIX) for k in sd):
        sd = {k[len(PREFIX):]: v for k, v in sd.items() if k.startswith(PREFIX)}
    sd = fp8_storage.load_dtype(sd, dtype, path)
    record = embedded_config.read_record(meta, META_CONFIG_KEY, path)
    if DIFFUSERS_MARKER in sd:  # a lone diffusers-layout file (this toolkit's, with its record)
        if record is None:
            raise ModelError(f"{path}: a diffusers-layout Chroma file without its config.json; give its folder")
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items()}
        cfg = ChromaConfig(**fields)
        return TransformerWeights(from_diffusers(sd, cfg, path), cfg, "diffusers")
    return TransformerWeights(sd, config_from_original(sd, path, record), "original")


def _read_folder(path: str, dtype) -> TransformerWeights:
    folder = transformer_folder(path)
    if folder is None:
        raise ModelError(f"{path}: not a diffusers Chroma folder (no transformer/config.json of a {DIFFUSERS_CLASS})")
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = config_from_diffusers(json.load(f), folder)
    sd = flux_checkpoint.read_diffusers_weights(folder, dtype, "diffusers Chroma transformer weights")
    return TransformerWeights(from_diffusers(sd, cfg, folder), cfg, "diffusers")


def build(weights: TransformerWeights) -> Chroma:
    """A Chroma module holding the weights (built on the meta device, then assigned)."""
    return flux_checkpoint.build_assigned(Chroma, weights, "Chroma transformer")


# --- writing ---------------------------------------------------------------------------------

def save_transformer(path: str, state_dict: dict, layout: str, config: ChromaConfig,
                     metadata: dict | None = None, dtype: torch.dtype | None = None) -> None:
    """Original-layout weights saved in ``layout``: 'original' one .safetensors file (one tensor
    at a time), 'diffusers' a transformer folder (config.json + weights). Atomic: a crash leaves
    the previous file or folder as it was."""
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    meta[META_CONFIG_KEY] = json.dumps(config.record())
    if layout == "original":
        with atomic_path(path) as tmp:
            safetensors_file.save_streaming(state_dict, tmp, meta, lambda v: fp8_storage.cast_floating(v, dtype))
        return
    if layout != "diffusers":
        raise ModelError(f"Chroma transformer: unknown layout {layout!r}; expected 'original' or 'diffusers'")
    sd = {k: fp8_storage.cast_floating(v.detach(), dtype).contiguous().cpu() for k, v in state_dict.items()}
    dsd = {k: v.contiguous() for k, v in to_diffusers(sd, config).items()}
    with atomic_dir(path) as tmp:
        os.makedirs(tmp, exist_ok=True)
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(diffusers_config(config), f, indent=2)
        safetensors_file.save(dsd, os.path.join(tmp, flux_checkpoint.DIFFUSERS_WEIGHTS), metadata=meta)
