"""FLUX.1 transformer files: the BFL layout (``flux1-dev.safetensors``, sd-scripts' and ComfyUI's),
the diffusers layout (``transformer/`` of a diffusers FLUX folder), the mapping between them, and
reading / writing both.

The two layouts differ in names and in fusion: BFL fuses q/k/v into one ``qkv`` projection per
stream, and a single block's q/k/v and MLP input into ``linear1``; diffusers keeps them apart.
The final adaLN modulation holds (shift, scale) in BFL and (scale, shift) in diffusers.

Variant and layout come from the weights: ``double_blocks.0.img_attn.qkv.weight`` -> BFL,
``transformer_blocks.0.attn.add_k_proj.weight`` -> diffusers; a guidance embedder
(``guidance_in`` / ``time_text_embed.guidance_embedder``) -> dev, else schnell.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any

import torch

from library import safetensors_file
from library.errors import ModelError, first_line
from library.files import atomic_dir, atomic_path
from library.models import embedded_config, fp8_storage
from library.models.families.flux.flux import Flux, FluxConfig
from library.models.sd_checkpoint import read_state_dict

logger = logging.getLogger("sdtk")

BFL_PREFIX = "model.diffusion_model."  # full ComfyUI-style checkpoints nest the transformer here
BFL_MARKER = "double_blocks.0.img_attn.qkv.weight"
DIFFUSERS_MARKER = "transformer_blocks.0.attn.add_k_proj.weight"
BFL_GUIDANCE = "guidance_in.in_layer.weight"
DIFFUSERS_GUIDANCE = "time_text_embed.guidance_embedder.linear_1.weight"
META_CONFIG_KEY = "sdtk.flux_config"  # the FluxConfig of files this toolkit writes (tiny widths)
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
SHARD_NAME = re.compile(r"^(.+)-(0*1)-of-(\d+)(\.safetensors)$")  # the first of a diffusers model's shards

# How one BFL tensor maps to diffusers tensors: "same" (renamed), "qkv" (three equal chunks),
# "qkvm" (q, k, v of hidden_size each, then the MLP input), "swap" (halves exchanged).
_DOUBLE = [
    ("img_mod.lin", ["norm1.linear"], "same"),
    ("txt_mod.lin", ["norm1_context.linear"], "same"),
    ("img_attn.qkv", ["attn.to_q", "attn.to_k", "attn.to_v"], "qkv"),
    ("txt_attn.qkv", ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"], "qkv"),
    ("img_attn.norm.query_norm.scale", ["attn.norm_q.weight"], "same"),
    ("img_attn.norm.key_norm.scale", ["attn.norm_k.weight"], "same"),
    ("txt_attn.norm.query_norm.scale", ["attn.norm_added_q.weight"], "same"),
    ("txt_attn.norm.key_norm.scale", ["attn.norm_added_k.weight"], "same"),
    ("img_attn.proj", ["attn.to_out.0"], "same"),
    ("txt_attn.proj", ["attn.to_add_out"], "same"),
    ("img_mlp.0", ["ff.net.0.proj"], "same"),
    ("img_mlp.2", ["ff.net.2"], "same"),
    ("txt_mlp.0", ["ff_context.net.0.proj"], "same"),
    ("txt_mlp.2", ["ff_context.net.2"], "same"),
]
_SINGLE = [
    ("modulation.lin", ["norm.linear"], "same"),
    ("linear1", ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"], "qkvm"),
    ("linear2", ["proj_out"], "same"),
    ("norm.query_norm.scale", ["attn.norm_q.weight"], "same"),
    ("norm.key_norm.scale", ["attn.norm_k.weight"], "same"),
]
_TOP = [
    ("img_in", ["x_embedder"], "same"),
    ("txt_in", ["context_embedder"], "same"),
    ("time_in.in_layer", ["time_text_embed.timestep_embedder.linear_1"], "same"),
    ("time_in.out_layer", ["time_text_embed.timestep_embedder.linear_2"], "same"),
    ("vector_in.in_layer", ["time_text_embed.text_embedder.linear_1"], "same"),
    ("vector_in.out_layer", ["time_text_embed.text_embedder.linear_2"], "same"),
    ("guidance_in.in_layer", ["time_text_embed.guidance_embedder.linear_1"], "same"),
    ("guidance_in.out_layer", ["time_text_embed.guidance_embedder.linear_2"], "same"),
    ("final_layer.linear", ["proj_out"], "same"),
    ("final_layer.adaLN_modulation.1", ["norm_out.linear"], "swap"),
]


def module_rules(depth: int, depth_single_blocks: int, guidance_embed: bool = True) -> list:
    """(bfl name, [diffusers names], kind) for every module and norm scale of a model with these
    block counts; a name without a .weight/.scale suffix is a Linear (its .weight and .bias).
    Also the map of LoRA modules between kohya's and diffusers' layouts (networks/flux_peft_layout.py)."""
    out = []
    for i in range(depth):
        out += [(f"double_blocks.{i}.{b}", [f"transformer_blocks.{i}.{d}" for d in ds], k) for b, ds, k in _DOUBLE]
    for i in range(depth_single_blocks):
        out += [(f"single_blocks.{i}.{b}", [f"single_transformer_blocks.{i}.{d}" for d in ds], k) for b, ds, k in _SINGLE]
    out += [(b, ds, k) for b, ds, k in _TOP if guidance_embed or not b.startswith("guidance_in")]
    return out


def _rules(config: FluxConfig):
    """(bfl name, [diffusers names], kind) for every tensor of a model of this shape."""
    out = module_rules(config.depth, config.depth_single_blocks, config.guidance_embed)
    expanded = []
    for b, ds, k in out:
        if b.endswith((".scale", ".weight")):
            expanded.append((b, ds, k))
        else:
            expanded += [(f"{b}.{p}", [f"{d}.{p}" for d in ds], k) for p in ("weight", "bias")]
    return expanded


def split_fused(t: torch.Tensor, kind: str, hidden: int) -> list[torch.Tensor]:
    """A BFL tensor's diffusers parts along dim 0 (a rule's kind; hidden: the model's width)."""
    if kind == "qkv":
        return list(t.chunk(3, dim=0))
    if kind == "qkvm":
        return list(torch.split(t, [hidden, hidden, hidden, t.shape[0] - 3 * hidden], dim=0))
    if kind == "swap":
        a, b = t.chunk(2, dim=0)
        return [torch.cat([b, a], dim=0)]
    return [t]


def bfl_to_diffusers(state_dict: dict, config: FluxConfig) -> dict:
    """BFL-layout tensors -> diffusers FluxTransformer2DModel tensors."""
    _check_keys(state_dict, {b for b, _, _ in _rules(config)}, "BFL")
    out = {}
    for b, ds, kind in _rules(config):
        for d, t in zip(ds, split_fused(state_dict[b], kind, config.hidden_size)):
            out[d] = t
    return out


def diffusers_to_bfl(state_dict: dict, config: FluxConfig) -> dict:
    """diffusers FluxTransformer2DModel tensors -> BFL layout (q/k/v concatenated into qkv)."""
    rules = _rules(config)
    _check_keys(state_dict, {d for _, ds, _ in rules for d in ds}, "diffusers")
    out = {}
    for b, ds, kind in rules:
        parts = [state_dict[d] for d in ds]
        if kind == "swap":
            a, c = parts[0].chunk(2, dim=0)
            out[b] = torch.cat([c, a], dim=0)
        else:
            out[b] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out


def _check_keys(state_dict: dict, expected: set, layout: str) -> None:
    missing = sorted(expected - state_dict.keys())
    if missing:
        raise ModelError(f"FLUX transformer ({layout} layout): missing {missing[0]} ({len(missing)} tensors missing)")
    extra = sorted(state_dict.keys() - expected)
    if extra:
        raise ModelError(f"FLUX transformer ({layout} layout): unexpected tensor {extra[0]} "
                         f"({len(extra)} not in a FLUX.1 transformer of this shape)")


# --- what the weights are --------------------------------------------------------------------

def layout_of(keys) -> str | None:
    """'bfl', 'diffusers', or None when the keys are not a FLUX.1 transformer's."""
    keys = set(keys)
    if BFL_MARKER in keys or BFL_PREFIX + BFL_MARKER in keys:
        return "bfl"
    if DIFFUSERS_MARKER in keys:
        return "diffusers"
    return None


def variant_of(keys) -> str:
    """'dev' (a guidance embedder: guidance-distilled) or 'schnell'."""
    keys = set(keys)
    return "dev" if ({BFL_GUIDANCE, BFL_PREFIX + BFL_GUIDANCE, DIFFUSERS_GUIDANCE} & keys) else "schnell"


def _count(keys, prefix: str, suffix: str) -> int:
    idx = [int(k[len(prefix):].split(".", 1)[0]) for k in keys if k.startswith(prefix) and k.endswith(suffix)]
    return max(idx) + 1 if idx else 0


def config_from_bfl(state_dict: dict, path: str, meta_config: dict | None = None) -> FluxConfig:
    """The FluxConfig of BFL-layout weights: widths and depths from the shapes; RoPE axes from the
    file's metadata, else FLUX.1's (16, 56, 56), which needs the real head dim 128."""
    try:
        hidden, in_ch = state_dict["img_in.weight"].shape
        head_dim = state_dict["double_blocks.0.img_attn.norm.query_norm.scale"].shape[0]
        cfg = FluxConfig(
            in_channels=in_ch, vec_in_dim=state_dict["vector_in.in_layer.weight"].shape[1],
            context_in_dim=state_dict["txt_in.weight"].shape[1], hidden_size=hidden,
            mlp_ratio=state_dict["double_blocks.0.img_mlp.0.weight"].shape[0] / hidden,
            num_heads=hidden // head_dim, depth=_count(state_dict, "double_blocks.", ".img_attn.qkv.weight"),
            depth_single_blocks=_count(state_dict, "single_blocks.", ".linear1.weight"),
            qkv_bias="double_blocks.0.img_attn.qkv.bias" in state_dict,
            guidance_embed=BFL_GUIDANCE in state_dict)
    except KeyError as e:
        raise ModelError(f"{path}: not a FLUX.1 transformer in the BFL layout (no {e.args[0]})") from None
    if meta_config:
        cfg = dataclasses.replace(cfg, axes_dim=tuple(meta_config["axes_dim"]), theta=int(meta_config["theta"]))
    elif head_dim != sum(cfg.axes_dim):
        raise ModelError(f"{path}: FLUX transformer with head dim {head_dim} and no {META_CONFIG_KEY} metadata: "
                         f"its RoPE axes are unknown (FLUX.1's {list(cfg.axes_dim)} need head dim 128)")
    return cfg


def config_from_diffusers(cfg: dict, path: str) -> FluxConfig:
    """A FluxConfig from a diffusers FluxTransformer2DModel config.json."""
    try:
        heads, head_dim = int(cfg["num_attention_heads"]), int(cfg["attention_head_dim"])
        return FluxConfig(
            in_channels=int(cfg.get("in_channels", 64)), vec_in_dim=int(cfg.get("pooled_projection_dim", 768)),
            context_in_dim=int(cfg.get("joint_attention_dim", 4096)), hidden_size=heads * head_dim,
            num_heads=heads, depth=int(cfg["num_layers"]), depth_single_blocks=int(cfg["num_single_layers"]),
            axes_dim=tuple(cfg.get("axes_dims_rope", (16, 56, 56))), guidance_embed=bool(cfg.get("guidance_embeds")))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{path}: not a FLUX transformer config ({first_line(e, typed=True)})") from None


def diffusers_config(config: FluxConfig) -> dict:
    """The config.json of the same model as a diffusers FluxTransformer2DModel."""
    if config.mlp_ratio != 4.0 or config.theta != 10_000 or not config.qkv_bias:
        raise ModelError("FLUX transformer: diffusers' FluxTransformer2DModel has mlp_ratio 4, theta 10000 and "
                         "q/k/v biases; this model cannot be saved in the diffusers layout")
    return {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": config.in_channels,
            "out_channels": None, "num_layers": config.depth, "num_single_layers": config.depth_single_blocks,
            "attention_head_dim": config.head_dim, "num_attention_heads": config.num_heads,
            "joint_attention_dim": config.context_in_dim, "pooled_projection_dim": config.vec_in_dim,
            "guidance_embeds": config.guidance_embed, "axes_dims_rope": list(config.axes_dim)}


def config_record(config: FluxConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


# --- reading ---------------------------------------------------------------------------------

@dataclasses.dataclass
class TransformerWeights:
    state_dict: dict  # BFL layout, prefix removed
    config: FluxConfig
    layout: str  # the layout the weights came in: 'bfl' or 'diffusers' (saved back in it)
    variant: str  # 'dev' or 'schnell'


def shard_files(path: str) -> list[str]:
    """A file named like diffusers' first shard (``...-00001-of-00003.safetensors``, what sd-scripts'
    convert_diffusers_to_flux.py takes) -> all its shards, in order; any other path -> [path]."""
    m = SHARD_NAME.match(os.path.basename(path))
    if not m:
        return [path]
    head, total, tail = m.group(1), m.group(3), m.group(4)
    files = [os.path.join(os.path.dirname(path), f"{head}-{i:0{len(total)}d}-of-{total}{tail}")
             for i in range(1, int(total) + 1)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ModelError(f"{path}: shard {os.path.basename(missing[0])} of {total} is missing beside it")
    return files


def read_transformer(path: str, dtype: torch.dtype | None = torch.float32) -> TransformerWeights:
    """The transformer's weights, in BFL layout, from a BFL single file (with or without the
    ``model.diffusion_model.`` prefix, fp8-stored or not), a diffusers transformer folder (one
    file or shards with an index), a diffusers FLUX folder (its ``transformer/``) or the first of
    a diffusers transformer's shards. Floating tensors are returned in ``dtype`` (None: as stored)."""
    if os.path.isdir(path):
        sub = os.path.join(path, "transformer")
        folder = sub if os.path.isdir(sub) else path
        return _read_diffusers_folder(folder, dtype)
    sd: dict = {}
    meta: dict = {}
    for f in shard_files(path):
        part, part_meta = read_state_dict(f)
        sd.update(part)
        meta = meta or part_meta
    layout = layout_of(sd.keys())
    if layout is None:
        raise ModelError(f"{path}: not a FLUX.1 transformer (no {BFL_MARKER} or {DIFFUSERS_MARKER})")
    if any(k.startswith(BFL_PREFIX) for k in sd):
        others = [k for k in sd if not k.startswith(BFL_PREFIX)]
        if others:
            logger.info("%s: using the %s* tensors; %d others (text encoders, VAE) are ignored",
                        path, BFL_PREFIX, len(others))
        sd = {k[len(BFL_PREFIX):]: v for k, v in sd.items() if k.startswith(BFL_PREFIX)}
    sd = fp8_storage.load_dtype(sd, dtype, path)
    meta_cfg = _meta_config(meta, path)
    if layout == "diffusers":  # a lone file or shards: the transformer's config.json beside them, else the shapes
        cfg = _config_beside(path) or _diffusers_config_from_weights(sd, path, meta_cfg)
        sd = diffusers_to_bfl(sd, cfg)
    else:
        cfg = config_from_bfl(sd, path, meta_cfg)
    return TransformerWeights(sd, cfg, layout, variant_of(sd.keys()))


def _meta_config(meta: dict, path: str) -> dict | None:
    cfg = embedded_config.read_record(meta, META_CONFIG_KEY, path)
    if cfg is None:
        return None
    try:
        return {"axes_dim": [int(d) for d in cfg["axes_dim"]], "theta": int(cfg["theta"])}
    except (KeyError, TypeError, ValueError):
        raise ModelError(f"{path}: metadata {META_CONFIG_KEY} is not a FLUX config") from None


def _diffusers_config_from_weights(sd: dict, path: str, meta_cfg: dict | None) -> FluxConfig:
    # A lone diffusers-layout file: the shapes give everything but the RoPE axes (as for BFL).
    hidden, in_ch = sd["x_embedder.weight"].shape
    head_dim = sd["transformer_blocks.0.attn.norm_q.weight"].shape[0]
    cfg = FluxConfig(in_channels=in_ch, vec_in_dim=sd["time_text_embed.text_embedder.linear_1.weight"].shape[1],
                     context_in_dim=sd["context_embedder.weight"].shape[1], hidden_size=hidden,
                     num_heads=hidden // head_dim, depth=_count(sd, "transformer_blocks.", ".attn.to_q.weight"),
                     depth_single_blocks=_count(sd, "single_transformer_blocks.", ".attn.to_q.weight"),
                     guidance_embed=DIFFUSERS_GUIDANCE in sd)
    if meta_cfg:
        return dataclasses.replace(cfg, axes_dim=tuple(meta_cfg["axes_dim"]), theta=int(meta_cfg["theta"]))
    if head_dim != sum(cfg.axes_dim):
        raise ModelError(f"{path}: FLUX transformer with head dim {head_dim} and no config: its RoPE axes are unknown")
    return cfg


def _config_beside(path: str) -> FluxConfig | None:
    """The FluxTransformer2DModel config.json in the file's folder (diffusers' transformer/), if any."""
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")
    try:
        with open(beside, encoding="utf-8") as f:
            is_flux = json.load(f).get("_class_name") == "FluxTransformer2DModel"
    except (OSError, ValueError, AttributeError):
        return None
    return _read_config(beside) if is_flux else None


def _read_config(cfg_path: str) -> FluxConfig:
    try:
        with open(cfg_path, encoding="utf-8") as f:
            return config_from_diffusers(json.load(f), cfg_path)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{cfg_path}: cannot read ({first_line(e, typed=True)})") from None


def read_diffusers_weights(folder: str, dtype: torch.dtype | None, what: str) -> dict:
    """A diffusers model folder's tensors (one file, or the shards its index names), floating
    ones in ``dtype``; ``what`` names the weights in messages."""
    index = os.path.join(folder, DIFFUSERS_INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ModelError(f"{index}: not a safetensors index ({first_line(e, typed=True)})") from None
    else:
        files = [DIFFUSERS_WEIGHTS]
    sd: dict[str, Any] = {}
    for name in files:
        p = os.path.join(folder, name)
        if not os.path.isfile(p):
            raise ModelError(f"{folder}: no {name} ({what})")
        sd.update(read_state_dict(p)[0])
    return fp8_storage.load_dtype(sd, dtype, folder)


def _read_diffusers_folder(folder: str, dtype: torch.dtype | None) -> TransformerWeights:
    cfg = _read_config(os.path.join(folder, "config.json"))
    sd = read_diffusers_weights(folder, dtype, "diffusers FLUX transformer weights")
    return TransformerWeights(diffusers_to_bfl(sd, cfg), cfg, "diffusers", variant_of(sd.keys()))


def build_transformer(weights: TransformerWeights):
    """A Flux module holding the weights (built on the meta device, then assigned: no second copy)."""
    return build_assigned(Flux, weights, "FLUX transformer")


def build_assigned(cls, weights, title: str):
    """A ``cls(weights.config)`` module holding ``weights.state_dict`` (its config checked, the
    module built on the meta device and the tensors assigned: no second copy); a config that
    does not hold or a tensor missing or left over is one ModelError naming ``title``."""
    try:
        weights.config.check()
    except ValueError as e:
        raise ModelError(str(e)) from None
    with torch.device("meta"):
        model = cls(weights.config)
    missing, unexpected = model.load_state_dict(weights.state_dict, strict=False, assign=True)
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise ModelError(f"{title}: {'missing' if missing else 'unexpected'} tensor {name}")
    return model.eval()


def load_transformer(path: str, dtype: torch.dtype | None = torch.float32):
    """(Flux module, TransformerWeights without the tensors' second reference) from ``path``."""
    weights = read_transformer(path, dtype)
    model = build_transformer(weights)
    weights.state_dict = {}
    return model, weights


# --- writing ---------------------------------------------------------------------------------

def save_flux_transformer(path: str, state_dict: dict, layout: str, config: FluxConfig,
                          metadata: dict | None = None, dtype: torch.dtype | None = None) -> None:
    """Save BFL-layout transformer weights in ``layout``: 'bfl' writes one .safetensors file,
    one tensor at a time (cast and copied to the host just before it is written: sd-scripts'
    ``mem_eff_save``, always), 'diffusers' a transformer folder (config.json +
    diffusion_pytorch_model.safetensors). Atomic: a crash leaves the previous file or folder as
    it was."""

    meta = {k: str(v) for k, v in (metadata or {}).items()}
    meta[META_CONFIG_KEY] = config_record(config)
    if layout == "bfl":
        with atomic_path(path) as tmp:
            safetensors_file.save_streaming(state_dict, tmp, meta, lambda v: fp8_storage.cast_floating(v, dtype))
        return
    sd = {}
    for k, v in state_dict.items():
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        sd[k] = v.contiguous().cpu()
    if layout == "diffusers":
        dconf = diffusers_config(config)
        dsd = {k: v.contiguous() for k, v in bfl_to_diffusers(sd, config).items()}
        with atomic_dir(path) as tmp:
            os.makedirs(tmp, exist_ok=True)
            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
                json.dump(dconf, f, indent=2)
            safetensors_file.save(dsd, os.path.join(tmp, DIFFUSERS_WEIGHTS), metadata=meta)
    else:
        raise ModelError(f"FLUX transformer: unknown layout {layout!r}; expected 'bfl' or 'diffusers'")
