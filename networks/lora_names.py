"""Kohya LoRA module names.

A kohya name is ``<prefix>_<module path with "." replaced by "_">``. The paths that the
ecosystem (A1111, Forge, ComfyUI, diffusers' kohya loader) expects are:

- SD1/SD2 U-Net: the diffusers layout (``down_blocks.0.attentions.0...``), because sd-scripts trains
  SD1/2 on a diffusers-shaped U-Net;
- SDXL U-Net: the SAI/original layout (``input_blocks.4.1...``), because sd-scripts trains SDXL on
  its own SAI-shaped U-Net; our models are diffusers models, so their paths are translated
  by ``library.unet_layout``;
- text encoders: the transformers layout under ``text_model.`` (transformers 5 dropped the
  ``text_model`` wrapper from ``CLIPTextModel`` but not from ``CLIPTextModelWithProjection``;
  the names in the file must not depend on that).
"""
from __future__ import annotations

from library import unet_layout

PREFIX_UNET = "lora_unet"
PREFIX_TE = "lora_te"
PREFIX_TE1 = "lora_te1"
PREFIX_TE2 = "lora_te2"


def kohya_name(prefix: str, module_path: str) -> str:
    return (prefix + "." + module_path).replace(".", "_")


def text_encoder_path(path: str) -> str:
    """The module path as the text encoder had it inside ``text_model`` (see module docstring)."""
    return path if path.startswith("text_model.") else "text_model." + path


def text_encoder_prefix(index: int, count: int) -> str:
    if count == 1:
        return PREFIX_TE
    return PREFIX_TE1 if index == 0 else PREFIX_TE2


def is_sdxl_unet(unet) -> bool:
    config = getattr(unet, "config", None)
    return getattr(config, "addition_embed_type", None) == "text_time"


def sdxl_block_map(unet) -> dict[str, str]:
    """Map each diffusers block path of an SDXL-shaped U-Net to its SAI path."""
    return unet_layout.block_map(unet.config)


def sdxl_module_path(path: str, block_map: dict[str, str]) -> str:
    """Translate a diffusers module path inside an SDXL U-Net to the SAI path."""
    return unet_layout.original_path(path, block_map)
