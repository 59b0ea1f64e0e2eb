"""Kohya LoRA module names.

A kohya name is ``<prefix>_<module path with "." replaced by "_">``. The paths that the
ecosystem (A1111, Forge, ComfyUI, diffusers' kohya loader) expects are:

- SD1/SD2 U-Net: the diffusers layout (``down_blocks.0.attentions.0...``), because sd-scripts trains
  SD1/2 on a diffusers-shaped U-Net;
- SDXL U-Net: the SAI/original layout (``input_blocks.4.1...``), because sd-scripts trains SDXL on
  its own SAI-shaped U-Net; our models are diffusers models, so their paths are translated here;
- text encoders: the transformers layout under ``text_model.`` (transformers 5 dropped the
  ``text_model`` wrapper from ``CLIPTextModel`` but not from ``CLIPTextModelWithProjection``;
  the names in the file must not depend on that).
"""
from __future__ import annotations

import re

PREFIX_UNET = "lora_unet"
PREFIX_TE = "lora_te"
PREFIX_TE1 = "lora_te1"
PREFIX_TE2 = "lora_te2"

# diffusers ResnetBlock2D child -> SAI ResBlock child
_RESNET_CHILDREN = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}


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
    """Map each diffusers block path of an SDXL-shaped U-Net to its SAI path.

    Derived from the block structure, so it holds for any width and depth: the SAI U-Net numbers
    its input blocks 1.. (0 is conv_in), one per resnet (with its attention as sub-block 1) and
    one per downsampler; its output blocks one per resnet, the upsampler riding as the last
    sub-block of the block's last layer; the middle block is resnet, attention, resnet.
    """
    mapping: dict[str, str] = {}
    index = 1
    for i, block in enumerate(unet.down_blocks):
        attentions = getattr(block, "attentions", None)
        for j in range(len(block.resnets)):
            mapping[f"down_blocks.{i}.resnets.{j}"] = f"input_blocks.{index}.0"
            if attentions is not None:
                mapping[f"down_blocks.{i}.attentions.{j}"] = f"input_blocks.{index}.1"
            index += 1
        if block.downsamplers is not None:
            mapping[f"down_blocks.{i}.downsamplers.0"] = f"input_blocks.{index}.0"
            index += 1

    mid = unet.mid_block
    if mid is not None:
        mid_attentions = getattr(mid, "attentions", None)
        for j in range(len(mid.resnets)):
            mapping[f"mid_block.resnets.{j}"] = f"middle_block.{2 * j}"
        for j in range(len(mid_attentions or [])):
            mapping[f"mid_block.attentions.{j}"] = f"middle_block.{2 * j + 1}"

    index = 0
    for i, block in enumerate(unet.up_blocks):
        attentions = getattr(block, "attentions", None)
        for j in range(len(block.resnets)):
            mapping[f"up_blocks.{i}.resnets.{j}"] = f"output_blocks.{index}.0"
            if attentions is not None:
                mapping[f"up_blocks.{i}.attentions.{j}"] = f"output_blocks.{index}.1"
            index += 1
        if block.upsamplers is not None:
            sub = 2 if attentions is not None else 1
            mapping[f"up_blocks.{i}.upsamplers.0"] = f"output_blocks.{index - 1}.{sub}"
    return mapping


_BLOCK_RE = re.compile(r"^((?:down_blocks|up_blocks)\.\d+\.(?:resnets|attentions|downsamplers|upsamplers)\.\d+"
                       r"|mid_block\.(?:resnets|attentions)\.\d+)(?:\.(.*))?$")


def sdxl_module_path(path: str, block_map: dict[str, str]) -> str:
    """Translate a diffusers module path inside an SDXL U-Net to the SAI path."""
    m = _BLOCK_RE.match(path)
    if m is None or m.group(1) not in block_map:
        raise KeyError(f"no SAI name for U-Net module {path!r}")
    block, rest = m.group(1), m.group(2) or ""
    sai = block_map[block]
    if ".resnets." in block and rest:
        head, _, tail = rest.partition(".")
        rest = _RESNET_CHILDREN.get(head, head) + ("." + tail if tail else "")
    elif ".downsamplers." in block and rest == "conv":
        rest = "op"  # SAI Downsample's conv is called op; Upsample's stays conv
    return sai + ("." + rest if rest else "")
