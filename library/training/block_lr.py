"""``block_lr``: per-block learning rates of SDXL full fine-tuning, as sd-scripts' sdxl_train.py.

23 values, one per block of the SAI-layout U-Net: 0 = ``time_embed`` and ``label_emb``, 1-9 =
``input_blocks.0-8`` (input block 0 is ``conv_in``), 10-12 = ``middle_block.0-2``, 13-21 =
``output_blocks.0-8``, 22 = ``out`` (the final norm and conv). Our U-Net is a diffusers model:
each parameter's block is read from its original-layout name (library/models/unet_layout.py). A block
whose rate is 0 is not trained (no gradient, not in the optimizer).
"""
from __future__ import annotations

from library.errors import UserError
from library.models import unet_layout
from library.models.families import registry

NUM_BLOCKS = 23


class BlockLrError(UserError, ValueError):
    pass


def check_count(block_lr: list[float]) -> None:
    if len(block_lr) != NUM_BLOCKS:
        raise BlockLrError(f"block_lr: {len(block_lr)} value(s) given; SDXL's U-Net has {NUM_BLOCKS} blocks "
                           "(time/label embedding, input blocks 0-8, middle 0-2, output blocks 0-8, out)")


def check_family(family: str) -> None:
    if not registry.get(family).block_lr:
        raise BlockLrError(f"block_lr is for SDXL's U-Net (sd-scripts' sdxl_train.py); this model is "
                           f"{family}: use learning_rate")


def block_of(original_name: str) -> int:
    """sdxl_train.py's block index of an original-layout U-Net parameter name."""
    head, _, rest = original_name.partition(".")
    if head in ("time_embed", "label_emb"):
        return 0
    base = {"input_blocks": 1, "middle_block": 10, "output_blocks": 13}.get(head)
    if base is not None:
        return base + int(rest.split(".")[0])
    if head == "out":
        return 22
    raise KeyError(original_name)


def param_groups(unet, family: str, block_lr: list[float]):
    """(optimizer groups, their names "block<i>") of the U-Net's parameters by block."""
    check_family(family)
    check_count(block_lr)
    layout = unet_layout.block_map(unet.config)
    by_block: list[list] = [[] for _ in range(NUM_BLOCKS)]
    for name, p in unet.named_parameters():
        try:
            i = block_of(unet_layout.original_path(name, layout))
        except (KeyError, ValueError):
            i = -1
        if not 0 <= i < NUM_BLOCKS:
            raise BlockLrError(f"block_lr: U-Net parameter {name} is in none of the {NUM_BLOCKS} SDXL "
                               "blocks (a U-Net of another topology?)")
        by_block[i].append(p)
    groups, names = [], []
    for i, (params, lr) in enumerate(zip(by_block, block_lr)):
        if not lr:
            for p in params:
                p.requires_grad_(False)
            continue
        if params:
            groups.append({"params": params, "lr": lr})
            names.append(f"block{i}")
    return groups, names
