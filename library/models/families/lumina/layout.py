"""Lumina Image 2.0 transformer layouts: the original single file (sd-scripts, Alpha-VLLM, ComfyUI
with ``model.diffusion_model.``) and diffusers' ``Lumina2Transformer2DModel``, and the config read
from either without loading a weight.

    original_keys(keys)                 the keys with ComfyUI's prefix removed (None: not Lumina 2)
    config_from_shapes(shapes, path, meta_config)   NextDiTConfig from the original tensors' shapes
    to_diffusers(sd, config) / from_diffusers(sd, config)   the key (and fused qkv) mapping
    diffusers_config(config) / config_from_diffusers(cfg, shapes)

The mapping, original -> diffusers: ``t_embedder.mlp.{0,2}`` -> ``time_caption_embed.
timestep_embedder.linear_{1,2}``, ``cap_embedder`` -> ``time_caption_embed.caption_embedder``,
per block ``attention.qkv`` -> ``attn.to_q|to_k|to_v`` (rows split n_heads : n_kv : n_kv heads),
``attention.out`` -> ``attn.to_out.0``, ``attention.{q,k}_norm`` -> ``attn.norm_{q,k}``,
``feed_forward.w{1,2,3}`` -> ``feed_forward.linear_{1,2,3}``, ``attention_norm1`` -> ``norm1.norm``
(``norm1`` in the context refiner, which has no modulation), ``attention_norm2`` -> ``norm2``,
``adaLN_modulation.1`` -> ``norm1.linear``, ``final_layer.adaLN_modulation.1`` -> ``norm_out.linear_1``,
``final_layer.linear`` -> ``norm_out.linear_2``; ``norm_final`` (never used) is not in diffusers.
"""
from __future__ import annotations

import re
from typing import Any

from library.errors import ModelError
from library.models.families.lumina.nextdit import NextDiTConfig

COMFY_PREFIX = "model.diffusion_model."
MARKER = "cap_embedder.0.weight"  # what tells a Lumina 2 transformer (diffusers' single-file check too)
DIFFUSERS_CLASS = "Lumina2Transformer2DModel"
AXES_DIMS_BY_HEAD_DIM = {96: (32, 32, 32)}  # the released 2B (head dim 96); other widths need a record

_BLOCK = re.compile(r"^(context_refiner|noise_refiner|layers)\.(\d+)\.(.+)$")
_BLOCK_RENAMES = {
    "attention.out.weight": "attn.to_out.0.weight",
    "attention.q_norm.weight": "attn.norm_q.weight",
    "attention.k_norm.weight": "attn.norm_k.weight",
    "feed_forward.w1.weight": "feed_forward.linear_1.weight",
    "feed_forward.w2.weight": "feed_forward.linear_2.weight",
    "feed_forward.w3.weight": "feed_forward.linear_3.weight",
    "attention_norm2.weight": "norm2.weight",
    "ffn_norm1.weight": "ffn_norm1.weight",
    "ffn_norm2.weight": "ffn_norm2.weight",
    "adaLN_modulation.1.weight": "norm1.linear.weight",
    "adaLN_modulation.1.bias": "norm1.linear.bias",
}
_TOP_RENAMES = {
    "x_embedder.weight": "x_embedder.weight", "x_embedder.bias": "x_embedder.bias",
    "t_embedder.mlp.0.weight": "time_caption_embed.timestep_embedder.linear_1.weight",
    "t_embedder.mlp.0.bias": "time_caption_embed.timestep_embedder.linear_1.bias",
    "t_embedder.mlp.2.weight": "time_caption_embed.timestep_embedder.linear_2.weight",
    "t_embedder.mlp.2.bias": "time_caption_embed.timestep_embedder.linear_2.bias",
    "cap_embedder.0.weight": "time_caption_embed.caption_embedder.0.weight",
    "cap_embedder.1.weight": "time_caption_embed.caption_embedder.1.weight",
    "cap_embedder.1.bias": "time_caption_embed.caption_embedder.1.bias",
    "final_layer.linear.weight": "norm_out.linear_2.weight", "final_layer.linear.bias": "norm_out.linear_2.bias",
    "final_layer.adaLN_modulation.1.weight": "norm_out.linear_1.weight",
    "final_layer.adaLN_modulation.1.bias": "norm_out.linear_1.bias",
}
UNUSED = ("norm_final.weight",)


def original_keys(keys) -> dict[str, str] | None:
    """{original key: key in the file} for a Lumina 2 transformer in the original layout (ComfyUI's
    prefix removed, other prefixed parts left out); None when the keys are not one."""
    keys = list(keys)
    if COMFY_PREFIX + MARKER in keys:
        return {k[len(COMFY_PREFIX):]: k for k in keys if k.startswith(COMFY_PREFIX)}
    if MARKER in keys and "x_embedder.weight" in keys:
        return {k: k for k in keys}
    return None


def _count(keys, prefix: str) -> int:
    ids = {int(m.group(2)) for k in keys if (m := _BLOCK.match(k)) and m.group(1) == prefix}
    return max(ids) + 1 if ids else 0


def config_from_shapes(shapes: dict[str, tuple], path: str, meta_config: dict | None = None) -> NextDiTConfig:
    """The transformer's config from its original-layout tensor shapes (a record this toolkit wrote
    wins); one line naming ``path`` when the tensors are not a Lumina 2 transformer's."""
    if meta_config is not None:
        try:
            fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in meta_config.items()}
            return NextDiTConfig(**fields)
        except TypeError as e:
            raise ModelError(f"{path}: its Lumina config record is not valid ({e})") from None
    try:
        dim, patch_in = shapes["x_embedder.weight"]
        head_dim = shapes["layers.0.attention.q_norm.weight"][0]
        qkv_rows = shapes["layers.0.attention.qkv.weight"][0]
        ffn_hidden = shapes["layers.0.feed_forward.w1.weight"][0]
        cap_feat_dim = shapes["cap_embedder.0.weight"][0]
    except KeyError as e:
        raise ModelError(f"{path}: not a Lumina 2 transformer (no {e.args[0]}; the 2B model without q/k norms "
                         "is not one sd-scripts trains)") from None
    n_heads = dim // head_dim
    n_kv = (qkv_rows - dim) // (2 * head_dim)
    if head_dim not in AXES_DIMS_BY_HEAD_DIM:
        raise ModelError(f"{path}: a Lumina transformer with head dim {head_dim} has no known RoPE axes "
                         f"(the released 2B has {next(iter(AXES_DIMS_BY_HEAD_DIM))})")
    channels = patch_in // 4
    config = NextDiTConfig(in_channels=channels, dim=dim, n_layers=_count(shapes, "layers"),
                           n_refiner_layers=_count(shapes, "noise_refiner"), n_heads=n_heads, n_kv_heads=n_kv,
                           ffn_hidden=ffn_hidden, cap_feat_dim=cap_feat_dim, axes_dims=AXES_DIMS_BY_HEAD_DIM[head_dim])
    try:
        config.check()
    except ValueError as e:
        raise ModelError(f"{path}: {e}") from None
    return config


def _block_key(key: str, layout_name: str) -> tuple[str, str, str]:
    """(block prefix "layers.3.", the key after it, the block kind) of a per-block key."""
    m = _BLOCK.match(key)
    if m is None:
        raise ModelError(f"{layout_name}: unexpected key {key}")
    return f"{m.group(1)}.{m.group(2)}.", m.group(3), m.group(1)


def to_diffusers(sd: dict, config: NextDiTConfig) -> dict:
    """Original-layout tensors -> diffusers' Lumina2Transformer2DModel keys (qkv split)."""
    hd = config.head_dim
    sizes = [config.n_heads * hd, config.n_kv_heads * hd, config.n_kv_heads * hd]
    out = {}
    for key, t in sd.items():
        if key in UNUSED:
            continue
        if key in _TOP_RENAMES:
            out[_TOP_RENAMES[key]] = t
            continue
        prefix, rest, kind = _block_key(key, "Lumina transformer")
        if rest == "attention.qkv.weight":
            for name, part in zip(("to_q", "to_k", "to_v"), t.split(sizes, dim=0)):
                out[f"{prefix}attn.{name}.weight"] = part
        elif rest == "attention_norm1.weight":
            out[prefix + ("norm1.weight" if kind == "context_refiner" else "norm1.norm.weight")] = t
        elif rest in _BLOCK_RENAMES:
            out[prefix + _BLOCK_RENAMES[rest]] = t
        else:
            raise ModelError(f"Lumina transformer: unexpected key {key}")
    return out


def from_diffusers(sd: dict, config: NextDiTConfig, norm_final=None) -> dict:
    """diffusers' keys -> the original layout (q, k, v fused); ``norm_final``: the unused norm's
    weight to write (ones when None, as the released files hold)."""
    # lazy: torch only for the fused qkv and the unused norm (this module's mapping is read without it)
    import torch

    back_top = {v: k for k, v in _TOP_RENAMES.items()}
    back_block = {v: k for k, v in _BLOCK_RENAMES.items()}
    out: dict = {}
    qkv: dict = {}
    for key, t in sd.items():
        if key in back_top:
            out[back_top[key]] = t
            continue
        prefix, rest, _ = _block_key(key, "diffusers Lumina2 transformer")
        if rest in ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight"):
            qkv.setdefault(prefix, {})[rest[5:9]] = t
        elif rest in ("norm1.weight", "norm1.norm.weight"):
            out[prefix + "attention_norm1.weight"] = t
        elif rest in back_block:
            out[prefix + back_block[rest]] = t
        else:
            raise ModelError(f"diffusers Lumina2 transformer: unexpected key {key}")
    for prefix, parts in qkv.items():
        out[prefix + "attention.qkv.weight"] = torch.cat([parts["to_q"], parts["to_k"], parts["to_v"]], dim=0)
    out["norm_final.weight"] = torch.ones(config.dim) if norm_final is None else norm_final
    return out


def diffusers_config(config: NextDiTConfig) -> dict:
    """diffusers' Lumina2Transformer2DModel config of the same shape (its feed-forward width is
    multiple_of * ceil(4 dim / multiple_of), so multiple_of = ffn_hidden gives any width >= 4 dim)."""
    if config.ffn_hidden < 4 * config.dim:
        raise ModelError(f"Lumina transformer: feed-forward width {config.ffn_hidden} below 4 x dim has no "
                         "diffusers config")
    multiple_of = 256 if config.ffn_hidden == 256 * -(-4 * config.dim // 256) else config.ffn_hidden
    return dict(_class_name=DIFFUSERS_CLASS, sample_size=128, patch_size=config.patch_size,
                in_channels=config.in_channels, out_channels=None, hidden_size=config.dim,
                num_layers=config.n_layers, num_refiner_layers=config.n_refiner_layers,
                num_attention_heads=config.n_heads, num_kv_heads=config.n_kv_heads, multiple_of=multiple_of,
                ffn_dim_multiplier=None, norm_eps=config.norm_eps, scaling_factor=1.0,
                axes_dim_rope=list(config.axes_dims), axes_lens=list(config.axes_lens),
                cap_feat_dim=config.cap_feat_dim)


def config_from_diffusers(cfg: dict, ffn_hidden: int, path: str) -> NextDiTConfig:
    """A diffusers transformer config.json (and its feed-forward width, from the weights)."""
    try:
        config = NextDiTConfig(patch_size=cfg.get("patch_size", 2), in_channels=cfg.get("in_channels", 16),
                               dim=cfg["hidden_size"], n_layers=cfg["num_layers"],
                               n_refiner_layers=cfg.get("num_refiner_layers", 2),
                               n_heads=cfg["num_attention_heads"], n_kv_heads=cfg["num_kv_heads"],
                               ffn_hidden=ffn_hidden, norm_eps=cfg.get("norm_eps", 1e-5),
                               cap_feat_dim=cfg["cap_feat_dim"], axes_dims=tuple(cfg.get("axes_dim_rope", (32, 32, 32))),
                               axes_lens=tuple(cfg.get("axes_lens", (300, 512, 512))))
        config.check()
    except (KeyError, ValueError) as e:
        raise ModelError(f"{path}: not a usable {DIFFUSERS_CLASS} config ({e})") from None
    return config
