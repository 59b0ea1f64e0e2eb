"""Block-wise LoRA: sd-scripts' block indexing, per-block ranks/alphas and learning-rate weights.

Block indices are those of sd-scripts' ``networks/lora.py`` (``get_block_index``), read from the
kohya module name:

- SD1/SD2 (diffusers names, 25 blocks): 0 = IN00 (``conv_in``, which never gets a LoRA), 1-11 =
  ``down_blocks_i_{resnets,attentions}_j`` at ``1 + 3 i + j`` (a level's downsampler at
  ``1 + 3 i + 2``), 12 = MID (``mid_block``), 13-24 = ``up_blocks_i_..._j`` at ``13 + 3 i + j``
  (upsampler at ``13 + 3 i + 2``). ``down_lr_weight`` / ``up_lr_weight`` have 12 values,
  ``mid_lr_weight`` 1.
- SDXL (SAI names, 23 blocks): 0 = ``time_embed`` / ``label_emb``, 1-9 = ``input_blocks_N`` at
  ``1 + N``, 10-12 = ``middle_block_N`` at ``10 + N``, 13-21 = ``output_blocks_N`` at ``13 + N``,
  22 = ``out``. ``down_lr_weight`` / ``up_lr_weight`` have 9 values, ``mid_lr_weight`` 3; the lr
  weights of blocks 0 and 22 are 1.

Values arrive as network_args strings; lists are comma-separated as sd-scripts passes them.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Optional

from library.errors import UserError

NUM_BLOCKS, NUM_MID = 12, 1            # SD1/SD2: IN/OUT blocks per side, MID blocks
SDXL_NUM_BLOCKS, SDXL_NUM_MID = 9, 3   # SDXL: input/output blocks, middle blocks

BLOCK_LIST_ARGS = ("block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas")
LR_WEIGHT_ARGS = ("down_lr_weight", "mid_lr_weight", "up_lr_weight")
PRESETS = ("cosine", "sine", "linear", "reverse_linear", "zeros")

_RE_UPDOWN = re.compile(r"(up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|attentions)_(\d+)_")


def total_blocks(is_sdxl: bool) -> int:
    return 1 + SDXL_NUM_BLOCKS * 2 + SDXL_NUM_MID + 1 if is_sdxl else NUM_BLOCKS * 2 + NUM_MID


def block_index(lora_name: str, is_sdxl: bool) -> int:
    """sd-scripts' block of a kohya U-Net module name; -1 for a name in no block."""
    if not is_sdxl:
        m = _RE_UPDOWN.search(lora_name)
        if m:
            side, i, kind, j = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
            idx = 3 * i + (2 if kind in ("upsamplers", "downsamplers") else j)
            return 1 + idx if side == "down" else NUM_BLOCKS + 1 + idx
        return NUM_BLOCKS if "mid_block_" in lora_name else -1
    if not lora_name.startswith("lora_unet_"):
        return -1
    name = lora_name[len("lora_unet_"):]
    if name.startswith(("time_embed_", "label_emb_")):
        return 0
    for prefix, base in (("input_blocks_", 1), ("middle_block_", 10), ("output_blocks_", 13)):
        if name.startswith(prefix):
            return base + int(name.split("_")[2])
    return 22 if name.startswith("out_") else -1


class BlockArgError(ValueError):
    """A bad block-wise network arg; the LoRA module turns it into its one-line LoRAError."""


def _numbers(key: str, value: Any, kind: type, negative: bool = False) -> list:
    """'1,2,3' (or a list) -> numbers; an empty item is 0 (sd-scripts' lr weights). negative:
    allowed (lr weights and the threshold: sd-scripts turns a weight <= threshold into 0)."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    out = []
    for s in items:
        s = str(s).strip()
        try:
            x = kind(float(s)) if s else kind(0)
            if kind is int and s and not float(s).is_integer():
                raise ValueError(s)
        except ValueError:
            raise BlockArgError(f"network_args: {key}: {s!r} is not a"
                                f"{'n integer' if kind is int else ' number'}") from None
        if (x < 0 and not negative) or (kind is float and not math.isfinite(x)):
            raise BlockArgError(f"network_args: {key}: {s!r} must be >= 0")
        out.append(x)
    return out


def check_syntax(args: dict[str, Any]) -> None:
    """Before weights load: every block list parses (the count needs the model family)."""
    for key in BLOCK_LIST_ARGS:
        if args.get(key) is not None:
            _numbers(key, args[key], int if key.endswith("dims") else float)
    for key in LR_WEIGHT_ARGS:
        v = args.get(key)
        if v is None:
            continue
        if key != "mid_lr_weight" and "," not in str(v):
            _preset(key, str(v))
        else:
            _numbers(key, v, float, negative=True)
    if args.get("block_lr_zero_threshold") is not None:
        _numbers("block_lr_zero_threshold", str(args["block_lr_zero_threshold"]), float, negative=True)
    if args.get("conv_block_alphas") is not None and args.get("conv_block_dims") is None:
        raise BlockArgError("network_args: conv_block_alphas is given without conv_block_dims")
    if args.get("block_alphas") is not None and args.get("block_dims") is None and \
            all(args.get(k) is None for k in LR_WEIGHT_ARGS):
        # sd-scripts reads block_alphas only when block_dims or an lr weight is given
        raise BlockArgError("network_args: block_alphas is given without block_dims (or an lr weight)")


def _preset(key: str, value: str) -> tuple[str, float]:
    """'sine+0.5' -> ('sine', 0.5) (a down/up value without a comma)."""
    name, _, offset = value.strip().partition("+")
    if name in PRESETS:
        try:
            return name, float(offset) if offset else 0.0
        except ValueError:
            raise BlockArgError(f"network_args: {key}: offset {offset!r} in {value!r} is not a number") from None
    try:
        float(value)
    except ValueError:
        raise BlockArgError(f"network_args: {key}: {value!r} is not a number list or one of "
                            f"{', '.join(PRESETS)} (with an optional +offset)") from None
    # sd-scripts reads a single number as an unknown preset name and ignores it (all 1.0)
    raise BlockArgError(f"network_args: {key}={value!r}: one number is not a block list; give "
                        "comma-separated values (12 for SD1/SD2, 9 for SDXL) or a preset")


def _preset_values(name: str, offset: float, n: int) -> list[float]:
    ramp = [i / (n - 1) for i in range(n)]
    if name == "sine":
        return [math.sin(math.pi * r / 2) + offset for r in ramp]
    if name == "cosine":
        return [math.sin(math.pi * r / 2) + offset for r in reversed(ramp)]
    if name == "linear":
        return [r + offset for r in ramp]
    if name == "reverse_linear":
        return [r + offset for r in reversed(ramp)]
    return [offset] * n  # zeros


def _fit(values: list[float], n: int, log) -> list[float]:
    """sd-scripts: a longer list is cut, a shorter one is filled with 1.0 (both warned)."""
    if len(values) > n:
        log(f"block lr weight list is too long: values after the {n}-th are ignored")
        return values[:n]
    if len(values) < n:
        log(f"block lr weight list is too short: filled with 1.0 up to {n} values")
        return values + [1.0] * (n - len(values))
    return values


def lr_weights(args: dict[str, Any], is_sdxl: bool, log=lambda msg: None) -> Optional[list[float]]:
    """One lr weight per block (sd-scripts' get_block_lr_weight), or None when none is given.
    A weight <= block_lr_zero_threshold becomes 0 (the block is not trained)."""
    if all(args.get(k) is None for k in LR_WEIGHT_ARGS):
        return None
    n_side, n_mid = (SDXL_NUM_BLOCKS, SDXL_NUM_MID) if is_sdxl else (NUM_BLOCKS, NUM_MID)
    threshold = _numbers("block_lr_zero_threshold", str(args.get("block_lr_zero_threshold") or "0"), float,
                         negative=True)[0]

    def side(key: str, n: int) -> list[float]:
        v = args.get(key)
        if v is None:
            return [1.0] * n
        preset = _preset(key, str(v)) if key != "mid_lr_weight" and "," not in str(v) else None
        values = _preset_values(*preset, n) if preset else _numbers(key, v, float, negative=True)
        return [w if w > threshold else 0.0 for w in _fit(values, n, log)]

    weights = side("down_lr_weight", n_side) + side("mid_lr_weight", n_mid) + side("up_lr_weight", n_side)
    return [1.0] + weights + [1.0] if is_sdxl else weights  # SDXL: time/label embedding, out


def block_dims_and_alphas(args: dict[str, Any], is_sdxl: bool, network_dim: int, network_alpha: float,
                          conv_dim: Optional[int], conv_alpha: Optional[float],
                          lr_weight: Optional[list[float]]):
    """(dims, alphas, conv_dims, conv_alphas) per block (sd-scripts' get_block_dims_and_alphas and
    remove_block_dims_and_alphas): unset lists take network_dim/alpha (conv: conv_dim/alpha, or
    None = no 3x3 conv modules); a block whose lr weight is 0 gets dim 0 (no module)."""
    n = total_blocks(is_sdxl)
    family = "SDXL" if is_sdxl else "SD1/SD2"

    def parsed(key: str, kind: type, default):
        if args.get(key) is None:
            return [default] * n
        values = _numbers(key, args[key], kind)
        if len(values) != n:
            raise BlockArgError(f"network_args: {key} has {len(values)} values; {family} has {n} blocks "
                                f"({'BASE, IN0-8, MID0-2, OUT0-8, OUT' if is_sdxl else 'IN00-IN11, MID, OUT00-OUT11'})")
        return values

    dims = parsed("block_dims", int, network_dim)
    alphas = parsed("block_alphas", float, network_alpha)
    conv_dims = conv_alphas = None  # None: no 3x3 conv modules
    if args.get("conv_block_dims") is not None or conv_dim is not None:
        conv_dims = parsed("conv_block_dims", int, conv_dim)
        # sd-scripts: unset = conv_alpha, which is None without conv_dim (alpha None = the rank)
        conv_alphas = parsed("conv_block_alphas", float, conv_alpha)
    if lr_weight is not None:
        for i, w in enumerate(lr_weight):
            if w == 0:
                dims[i] = 0
                if conv_dims is not None:
                    conv_dims[i] = 0
    return dims, alphas, conv_dims, conv_alphas


# --- LoRA Block Weight: the merge tools' --lbws ---------------------------------------------------
# sd-scripts' svd_merge_lora.py / sdxl_merge_lora.py take, per LoRA file, a JSON list of weights
# over the 26 blocks of the LoRA Block Weight extension: BASE (the text encoders), IN00-IN11, MID,
# OUT00-OUT11. The list's length says which blocks it sets (the extension's presets: 17 and 26 for
# SD1/SD2, 12 and 20 for SDXL); every other block keeps weight 1.

LBW_NAMES = ("BASE",) + tuple(f"IN{i:02d}" for i in range(12)) + ("MID",) + tuple(f"OUT{i:02d}" for i in range(12))
_IN, _OUT = (lambda *n: tuple(f"IN{i:02d}" for i in n)), (lambda *n: tuple(f"OUT{i:02d}" for i in n))
LBW_BLOCKS = {
    12: ("BASE",) + _IN(4, 5, 7, 8) + ("MID",) + _OUT(*range(6)),
    17: ("BASE",) + _IN(1, 2, 4, 5, 7, 8) + ("MID",) + _OUT(*range(3, 12)),
    20: ("BASE",) + _IN(*range(9)) + ("MID",) + _OUT(*range(9)),
    26: LBW_NAMES,
}
LBW_SDXL_LENGTHS = (12, 20)


def lbw_index(lora_name: str, is_sdxl: bool) -> int:
    """The module's place in LBW_NAMES (sd-scripts' get_lbw_block_index), -1 for none. SD1/SD2:
    one after block_index (BASE comes first). SDXL: the time / label embedding is IN00,
    ``input_blocks_N`` IN0N, the three middle blocks MID, ``output_blocks_N`` OUT0N, ``out`` OUT09."""
    if "text_model_encoder_" in lora_name:
        return 0
    i = block_index(lora_name, is_sdxl)
    if i < 0:
        return -1
    if not is_sdxl:
        return i + 1
    if i == 0:
        return 1
    if i <= SDXL_NUM_BLOCKS:
        return i
    return 13 if i <= SDXL_NUM_BLOCKS + SDXL_NUM_MID else i + 1


def parse_lbws(values: list[str], n_files: int) -> tuple[list[list[float]], bool]:
    """--lbws (one JSON list per file) -> (26 weights per file, whether they are SDXL's blocks)."""
    if len(values) != n_files:
        raise UserError(f"--lbws: {len(values)} value(s) given for {n_files} file(s) in --models")
    lists = []
    for text in values:
        try:
            weights = json.loads(text)
        except json.JSONDecodeError:
            weights = None
        if not isinstance(weights, list) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
            raise UserError(f"--lbws {text!r}: not a JSON list of numbers such as '[1,1,0.5,...]'")
        if len(weights) not in LBW_BLOCKS:
            raise UserError(f"--lbws {text!r}: {len(weights)} values; expected 17 or 26 (SD1/SD2) or 12 or 20 (SDXL)")
        lists.append(weights)
    if len({len(w) for w in lists}) != 1:
        raise UserError(f"--lbws: lists of {' and '.join(sorted({str(len(w)) for w in lists}))} values; give every "
                        "file the same length")
    n = len(lists[0])
    full = []
    for weights in lists:
        by_name = dict(zip(LBW_BLOCKS[n], weights))
        full.append([float(by_name.get(name, 1.0)) for name in LBW_NAMES])
    return full, n in LBW_SDXL_LENGTHS


def is_sdxl_names(names) -> bool:
    """Whether kohya module names are SDXL's (two text encoders, SAI U-Net blocks)."""
    return any(n.startswith(("lora_te1_", "lora_te2_", "lora_unet_input_blocks_", "lora_unet_middle_block_",
                             "lora_unet_output_blocks_")) for n in names)


def lbw_factor(weights: list[float], lora_name: str, is_sdxl: bool) -> float:
    """The block weight of one module (1 for a module in no block)."""
    i = lbw_index(lora_name, is_sdxl)
    return weights[i] if i >= 0 else 1.0
