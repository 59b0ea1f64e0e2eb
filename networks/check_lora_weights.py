"""Print the adapter tensors of a network file (sd-scripts' networks/check_lora_weights.py).

    python networks/check_lora_weights.py lora.safetensors [--show_all_keys]

One line per adapter tensor, ``key,shape,mean |x|,min |x|`` (shape as ``(a-b)``), after
"number of LoRA modules: N" (sd-scripts' words; N counts the tensors), as sd-scripts prints them.
Every kind's tensors are listed (LoRA / LoCon / DyLoRA / LoRA-FA ``lora_down`` / ``lora_up``, LoHa
``hada_*``, LoKr ``lokr_*``, OFT ``oft_*``; sd-scripts lists only LoRA's and OFT's, the latter
with their alphas, whose keys contain ``oft_``), after one line naming the file's kinds.
``--show_all_keys`` adds the other tensors (alphas, embeddings).
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from networks import lora_svd  # noqa: E402
from networks.adapter_weights import file_kinds  # noqa: E402
from networks.lora import LoRAError, load_state_dict_file  # noqa: E402

ADAPTER_PARTS = ("lora_up", "lora_down", "lora_A", "lora_B", "oft_", "hada_", "lokr_", "dora_scale", "diff")


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Print the adapter tensors of a LoRA/LoHa/LoKr/OFT file.")
    p.add_argument("file", help="network file (.safetensors, .ckpt, .pt)")
    p.add_argument("-s", "--show_all_keys", action="store_true", help="also the other tensors (alphas, ...)")
    return p.parse_args(argv)


def rows(sd: dict[str, torch.Tensor], show_all_keys: bool) -> list[str]:
    keys = [k for k in sd if k.partition(".")[2].startswith(ADAPTER_PARTS)]  # the tensor's part, not the name
    out = [f"adapter kinds: {', '.join(file_kinds(sd)) or 'none'}", f"number of LoRA modules: {len(keys)}"]
    if show_all_keys:
        keys += [k for k in sd if k not in keys]
        out.append(f"number of all modules: {len(keys)}")
    for key in keys:
        v = sd[key].float().abs()
        shape = str(tuple(v.shape)).replace(", ", "-")
        out.append(f"{key},{shape},{v.mean() if v.numel() else 0.0},{v.min() if v.numel() else 0.0}")
    return out


def run(args) -> None:
    lora_svd.check_lora_path("file", args.file)
    sd = load_state_dict_file(args.file)
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise LoRAError(f"{args.file}: not a network file (no flat tensor dictionary)")
    print("\n".join(rows(sd, args.show_all_keys)))


def main(argv=None) -> int:
    return lora_svd.tool_main(_parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
