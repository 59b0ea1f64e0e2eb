"""Convert a FLUX.1 LoRA between sd-scripts' (kohya) layout and ai-toolkit's (diffusers / PEFT) layout
(sd-scripts' networks/convert_flux_lora.py and its flags).

    python networks/convert_flux_lora.py --src ai-toolkit --dst sd-scripts \\
        --src_path ait_lora.safetensors --dst_path kohya_lora.safetensors [--save_precision bf16]
    python networks/convert_flux_lora.py --src sd-scripts --dst ai-toolkit --src_path a.safetensors --dst_path b.safetensors

What is converted and how: networks/flux_peft_layout.py. Every weight's delta is unchanged. The
metadata is kept (as sd-scripts); a kohya output also gets the ss_* keys of networks.lora_flux
(module, base model, ranks) and a note in ss_training_comment. --save_precision (ours): the dtype
of the output, default that of the input.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from networks import flux_peft_layout, lora_flux, lora_svd  # noqa: E402
from networks.lora import LoRAError, load_state_dict_file, write_weights  # noqa: E402

LAYOUTS = ("ai-toolkit", "sd-scripts")


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Convert a FLUX.1 LoRA between sd-scripts' and ai-toolkit's layouts.")
    p.add_argument("--src", default="ai-toolkit", help="layout of --src_path: ai-toolkit or sd-scripts (default ai-toolkit)")
    p.add_argument("--dst", default="sd-scripts", help="layout to write: ai-toolkit or sd-scripts (default sd-scripts)")
    p.add_argument("--src_path", default=None, help="the LoRA file to convert (.safetensors)")
    p.add_argument("--dst_path", default=None, help="the file to write (.safetensors)")
    p.add_argument("--save_precision", default=None, choices=["float", "fp16", "bf16"],
                   help="dtype of the output (default: the input's)")
    return p.parse_args(argv)


def _check(args) -> None:
    for flag in ("src", "dst"):
        if getattr(args, flag) not in LAYOUTS:
            raise LoRAError(f"--{flag} {getattr(args, flag)!r}: expected ai-toolkit or sd-scripts")
    if args.src == args.dst:
        raise LoRAError(f"--src and --dst are both {args.src}: nothing to convert")
    for flag in ("src_path", "dst_path"):
        path = getattr(args, flag)
        if not path:
            raise LoRAError(f"--{flag} is required")
        if not path.lower().endswith(".safetensors"):
            raise LoRAError(f"--{flag} {path}: must be a .safetensors file")
    if not os.path.isfile(args.src_path):
        raise LoRAError(f"--src_path {args.src_path}: file not found")
    if os.path.isdir(args.dst_path):
        raise LoRAError(f"--dst_path {args.dst_path}: is a folder")
    if os.path.exists(args.dst_path) and os.path.samefile(args.src_path, args.dst_path):
        raise LoRAError(f"--dst_path {args.dst_path}: is --src_path; write the conversion to another file")


def run(args) -> None:
    _check(args)
    source = args.src_path
    sd = load_state_dict_file(source)
    metadata = lora_svd.read_metadata(source)
    if args.src == "sd-scripts":
        if any(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in sd):
            raise LoRAError(f"{source}: an ai-toolkit (diffusers / PEFT) LoRA file (lora_A / lora_B keys); "
                            "use --src ai-toolkit")
        modules = lora_svd.modules_of(sd, source)
        out, dropped = flux_peft_layout.to_ai_toolkit(modules, source)
        counts = f"{len(modules) - len(dropped)} kohya modules into {len({k.rsplit('.', 2)[0] for k in out})}"
    else:
        modules, dropped = flux_peft_layout.from_ai_toolkit(sd, metadata, source)
        out = lora_svd.state_dict_of(modules)
        metadata = {k: v for k, v in metadata.items() if k != flux_peft_layout.ADAPTER_METADATA}
        metadata.setdefault("ss_network_module", lora_flux.NETWORK_MODULE)
        metadata.setdefault("ss_base_model_version", "flux1")
        metadata = lora_svd.rank_metadata(modules, metadata)
        metadata = lora_svd.add_comment(metadata, f"converted from ai-toolkit's layout ({os.path.basename(source)})")
        counts = f"{len({k.rsplit('.', 2)[0] for k in sd if not k.startswith('text_encoder')})} modules into " \
                 f"{len(modules)} kohya"
    if dropped:
        print(f"warning: {len(dropped)} text-encoder {'modules' if args.src == 'sd-scripts' else 'keys'} left out "
              f"(ai-toolkit's layout has none; sd-scripts' converter drops them too), e.g. {dropped[0]}",
              file=sys.stderr)
    dtype = lora_svd.PRECISIONS[args.save_precision] if args.save_precision else None
    write_weights(args.dst_path, out, dtype, metadata)
    print(f"converted {counts} modules ({args.src} -> {args.dst}): {args.dst_path}")


def main(argv=None) -> int:
    return lora_svd.tool_main(_parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
