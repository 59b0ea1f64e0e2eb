"""Anima's DiT file: the configuration read from the header's shapes, every check before a weight
loads (one line naming the file and key), loading (the LLM adapter inside the file or in a
separate ``llm_adapter_path`` file, as sd-scripts' anima_utils reads them) and saving in the
released layout (keys under ``net.``, ComfyUI's and sd-scripts' save).
"""
from __future__ import annotations

import re

import torch
from safetensors.torch import load_file

from library import safetensors_file
from library.files import atomic_path
from library.models.families.anima.model import (PREFIX, ROPE_BUFFERS, AdapterConfig, Anima, AnimaConfig,
                                                AnimaModelError, rope_tables)

ADAPTER = "llm_adapter."
_BLOCK = re.compile(r"^blocks\.(\d+)\.")
_ADAPTER_BLOCK = re.compile(r"^llm_adapter\.blocks\.(\d+)\.")
_DTYPES = {v: k for k, v in safetensors_file.DTYPES.items()}


def strip_prefix(keys) -> dict:
    """{file key: key without ``net.``} (files saved without the prefix are taken as they are)."""
    return {k: k[len(PREFIX):] if k.startswith(PREFIX) else k for k in keys}


def header_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """{key without net.: shape} from a safetensors header, without reading a weight."""
    try:
        _, header = safetensors_file.read_header(path)
    except (OSError, ValueError) as e:
        raise AnimaModelError(f"{path}: not a readable safetensors file ({e})") from None
    names = strip_prefix(k for k in header if k != "__metadata__")
    return {names[k]: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def is_anima(keys) -> bool:
    """Whether the keys are an Anima DiT's (with or without ``net.``)."""
    keys = set(strip_prefix(keys).values())
    return "x_embedder.proj.1.weight" in keys and "blocks.0.adaln_modulation_cross_attn.1.weight" in keys


def _need(shapes: dict, key: str, source: str, ndim: int) -> tuple[int, ...]:
    if key not in shapes:
        raise AnimaModelError(f"{source}: not an Anima DiT (no {key})")
    if len(shapes[key]) != ndim:
        raise AnimaModelError(f"{source}: {key} has shape {list(shapes[key])}, expected {ndim} dimensions")
    return shapes[key]


def adapter_config(shapes: dict, source: str) -> AdapterConfig:
    """The LLM adapter's configuration from its keys (``llm_adapter.``-prefixed)."""
    vocab, target = _need(shapes, ADAPTER + "embed.weight", source, 2)
    model_dim = _need(shapes, ADAPTER + "out_proj.weight", source, 2)[1]
    layers = 1 + max((int(m.group(1)) for k in shapes if (m := _ADAPTER_BLOCK.match(k))), default=-1)
    if layers == 0:
        raise AnimaModelError(f"{source}: the LLM adapter has no blocks (llm_adapter.blocks.0.*)")
    head = _need(shapes, ADAPTER + "blocks.0.cross_attn.q_norm.weight", source, 1)[0]
    source_dim = _need(shapes, ADAPTER + "blocks.0.cross_attn.k_proj.weight", source, 2)[1]
    hidden = _need(shapes, ADAPTER + "blocks.0.mlp.0.weight", source, 2)[0]
    if model_dim % head:
        raise AnimaModelError(f"{source}: the LLM adapter's width {model_dim} is not a multiple of its head "
                              f"width {head} (llm_adapter.blocks.0.cross_attn.q_norm.weight)")
    return AdapterConfig(source_dim=source_dim, target_dim=target, model_dim=model_dim, num_layers=layers,
                         num_heads=model_dim // head, vocab_size=vocab, mlp_ratio=hidden / model_dim)


def config_from_shapes(shapes: dict, source: str) -> AnimaConfig:
    """The DiT's configuration from its keys' shapes (``net.`` stripped); the adapter's when its
    keys are there. Widths that do not fit each other: one line naming the key."""
    width, patch_in = _need(shapes, "x_embedder.proj.1.weight", source, 2)
    blocks = 1 + max((int(m.group(1)) for k in shapes if (m := _BLOCK.match(k))), default=-1)
    if blocks == 0:
        raise AnimaModelError(f"{source}: not an Anima DiT (no blocks.0.*)")
    head = _need(shapes, "blocks.0.self_attn.q_norm.weight", source, 1)[0]
    if width % head:
        raise AnimaModelError(f"{source}: width {width} (x_embedder.proj.1.weight) is not a multiple of the head "
                              f"width {head} (blocks.0.self_attn.q_norm.weight)")
    mod = _need(shapes, "blocks.0.adaln_modulation_self_attn.1.weight", source, 2)
    if "blocks.0.adaln_modulation_self_attn.2.weight" not in shapes:
        raise AnimaModelError(f"{source}: a Cosmos DiT without AdaLN-LoRA (no blocks.0.adaln_modulation_self_attn.2"
                              ".weight) is not Anima")
    out = _need(shapes, "final_layer.linear.weight", source, 2)[0]
    patch = 2
    if patch_in % (patch * patch) or out % (patch * patch):
        raise AnimaModelError(f"{source}: x_embedder.proj.1.weight takes {patch_in} values per patch, not "
                              "(channels + 1) x 2 x 2")
    has_adapter = any(k.startswith(ADAPTER) for k in shapes)
    return AnimaConfig(model_channels=width, num_blocks=blocks, num_heads=width // head,
                       crossattn_dim=_need(shapes, "blocks.0.cross_attn.k_proj.weight", source, 2)[1],
                       adaln_lora_dim=mod[0], mlp_hidden=_need(shapes, "blocks.0.mlp.layer1.weight", source, 2)[0],
                       in_channels=patch_in // (patch * patch) - 1, out_channels=out // (patch * patch),
                       adapter=adapter_config(shapes, source) if has_adapter else None)


def check_shapes(cfg: AnimaConfig, shapes: dict, source: str) -> None:
    """Every key the model needs is there with its shape, and nothing else (the RoPE tables may be
    absent: they are rebuilt)."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Anima(cfg).state_dict().items()}
    for key, shape in expected.items():
        if key not in shapes:
            if key in ROPE_BUFFERS:
                continue
            raise AnimaModelError(f"{source}: missing {key} (an Anima DiT of width {cfg.model_channels} with "
                                  f"{cfg.num_blocks} blocks has it)")
        if tuple(shapes[key]) != shape:
            raise AnimaModelError(f"{source}: {key} has shape {list(shapes[key])}, expected {list(shape)} for an "
                                  f"Anima DiT of width {cfg.model_channels}")
    extra = sorted(k for k in shapes if k not in expected)
    if extra:
        raise AnimaModelError(f"{source}: {len(extra)} keys that are not Anima's, first {extra[0]}")


def read_config(path: str, llm_adapter_path: str | None = None) -> AnimaConfig:
    """The configuration of a DiT file (and a separate adapter file), all checks done, no weight read."""
    shapes = header_shapes(path)
    if llm_adapter_path:
        shapes = {k: v for k, v in shapes.items() if not k.startswith(ADAPTER)}
        shapes.update(_adapter_shapes(llm_adapter_path))
    cfg = config_from_shapes(shapes, path)
    if cfg.adapter is None:
        raise AnimaModelError(f"{path}: the DiT has no LLM adapter (llm_adapter.*); give llm_adapter_path")
    check_shapes(cfg, shapes, path if not llm_adapter_path else f"{path} + {llm_adapter_path}")
    return cfg


def _adapter_key(k: str) -> str:
    return k if k.startswith(ADAPTER) else ADAPTER + k


def _adapter_shapes(path: str) -> dict:
    return {_adapter_key(k): v for k, v in header_shapes(path).items()}


def load_dit(path: str, llm_adapter_path: str | None = None, dtype: torch.dtype | None = None) -> Anima:
    """The DiT from sd-scripts' single file (keys with or without ``net.``), the adapter from the
    file or ``llm_adapter_path`` (keys with or without ``llm_adapter.``)."""
    cfg = read_config(path, llm_adapter_path)
    sd = dict(zip(strip_prefix(raw := load_file(path)).values(), raw.values()))
    if llm_adapter_path:
        sd = {k: v for k, v in sd.items() if not k.startswith(ADAPTER)}
        sd.update({_adapter_key(k): v for k, v in load_file(llm_adapter_path).items()})
    with torch.device("meta"):
        model = Anima(cfg)
    sd.update({k: v for k, v in rope_tables(cfg).items() if k not in sd})  # a file may leave them out
    model.load_state_dict(sd, strict=True, assign=True)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def save_dit(model: Anima, path: str, dtype: torch.dtype | None = None, metadata: dict | None = None) -> None:
    """The released layout: every key under ``net.`` (the adapter inside), atomically."""
    sd = {PREFIX + k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
          for k, v in model.state_dict().items()}
    with atomic_path(path) as tmp:
        safetensors_file.save(sd, tmp, metadata)
