"""Where a diffusers U-Net's modules sit in the original (SAI / ldm) U-Net layout.

One mapping serves the single-file conversion (state-dict keys) and the SDXL LoRA names (module
paths). It is derived from the topology in the U-Net's config, so it holds for any width and
depth: the original numbers its input blocks 1.. (0 is conv_in), one per resnet (with its
attention as sub-block 1) and one per downsampler; its output blocks one per resnet, the
upsampler riding as the last sub-block of the level's last layer; the middle block is resnet,
attention, resnet.
"""
from __future__ import annotations

import re

# diffusers ResnetBlock2D child -> original ResBlock child
RESNET_CHILDREN = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}

# U-Net modules outside the blocks: diffusers prefix -> original prefix
TOP_LEVEL = [("time_embedding.linear_1.", "time_embed.0."), ("time_embedding.linear_2.", "time_embed.2."),
             ("add_embedding.linear_1.", "label_emb.0.0."), ("add_embedding.linear_2.", "label_emb.0.2."),
             ("conv_in.", "input_blocks.0.0."), ("conv_norm_out.", "out.0."), ("conv_out.", "out.2.")]

_BLOCK_RE = re.compile(r"^((?:down_blocks|up_blocks)\.\d+\.(?:resnets|attentions|downsamplers|upsamplers)\.\d+"
                       r"|mid_block\.(?:resnets|attentions)\.\d+)(?:\.(.*))?$")


def block_map(config) -> dict[str, str]:
    """{diffusers block path: original block path} for every resnet, attention and resampler."""
    lpb = config["layers_per_block"]
    down, up = list(config["down_block_types"]), list(config["up_block_types"])
    mapping: dict[str, str] = {}
    index = 1
    for i, block_type in enumerate(down):
        for j in range(lpb):
            mapping[f"down_blocks.{i}.resnets.{j}"] = f"input_blocks.{index}.0"
            if "CrossAttn" in block_type:
                mapping[f"down_blocks.{i}.attentions.{j}"] = f"input_blocks.{index}.1"
            index += 1
        if i < len(down) - 1:
            mapping[f"down_blocks.{i}.downsamplers.0"] = f"input_blocks.{index}.0"
            index += 1
    mapping.update({"mid_block.resnets.0": "middle_block.0", "mid_block.attentions.0": "middle_block.1",
                    "mid_block.resnets.1": "middle_block.2"})
    index = 0
    for i, block_type in enumerate(up):
        has_attn = "CrossAttn" in block_type
        for j in range(lpb + 1):
            mapping[f"up_blocks.{i}.resnets.{j}"] = f"output_blocks.{index}.0"
            if has_attn:
                mapping[f"up_blocks.{i}.attentions.{j}"] = f"output_blocks.{index}.1"
            index += 1
        if i < len(up) - 1:
            mapping[f"up_blocks.{i}.upsamplers.0"] = f"output_blocks.{index - 1}.{2 if has_attn else 1}"
    return mapping


def original_path(path: str, blocks: dict[str, str]) -> str:
    """Translate a module path or state-dict key (inside a U-Net block, or one of TOP_LEVEL);
    KeyError if it is in none."""
    for new, old in TOP_LEVEL:
        if (path + ".").startswith(new):
            return (old + path[len(new):]).rstrip(".")
    m = _BLOCK_RE.match(path)
    if m is None or m.group(1) not in blocks:
        raise KeyError(f"no original-layout name for U-Net module {path!r}")
    block, rest = m.group(1), m.group(2) or ""
    if ".resnets." in block and rest:
        head, _, tail = rest.partition(".")
        rest = RESNET_CHILDREN.get(head, head) + ("." + tail if tail else "")
    elif ".downsamplers." in block and (rest == "conv" or rest.startswith("conv.")):
        rest = "op" + rest[4:]  # the original Downsample's conv is called op; Upsample's stays conv
    return blocks[block] + ("." + rest if rest else "")
