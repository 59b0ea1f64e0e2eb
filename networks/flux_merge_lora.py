"""Merge FLUX.1 LoRA files into a FLUX.1 transformer, or into one LoRA file (sd-scripts' networks/flux_merge_lora.py).

    python networks/flux_merge_lora.py --flux_model flux1-dev.safetensors --models a.safetensors b.safetensors \\
        --ratios 1.0 0.5 --save_to merged.safetensors [--save_precision bf16] [--working_device cuda]
    python networks/flux_merge_lora.py --models a.safetensors b.safetensors --save_to ab.safetensors [--concat]

With --flux_model (a transformer merge_lora.py cannot load: BFL single file, diffusers folder), each
file's ``lora_unet_`` modules add ratio x up @ down x alpha / rank to the transformer's weights in
float32 (networks.lora_flux's modules, so every name the trainer writes is found; a name of another
model is an error), and the transformer is saved in the layout it came in. Without it, the files
become one LoRA file exactly as merge_lora.py merges them. sd-scripts' text-encoder merge
(--clip_l, --t5xxl and their --*_save_to) and --diffusers output are not built here: a file with
lora_te modules is refused by name rather than merged partly.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library.models.families.flux import flux_checkpoint  # noqa: E402
from networks import lora_flux, lora_svd, merge_lora  # noqa: E402
from networks.lora import LoRAError, load_state_dict_file  # noqa: E402

NOT_BUILT = ("clip_l", "t5xxl", "clip_l_save_to", "t5xxl_save_to", "diffusers", "loading_device", "mem_eff_load_save")


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Merge FLUX.1 LoRA files into a FLUX.1 transformer or into one LoRA.")
    p.add_argument("--flux_model", default=None,
                   help="FLUX.1 transformer (BFL .safetensors or diffusers folder); without it the LoRAs are merged "
                        "into one LoRA file")
    merge_lora.add_models_and_ratios(p)
    p.add_argument("--save_to", required=True, help="output transformer (with --flux_model) or LoRA file")
    p.add_argument("--precision", default="float", choices=["float", "fp16", "bf16"],
                   help="dtype the transformer is loaded and merged in (default float)")
    p.add_argument("--save_precision", default=None, choices=["float", "fp16", "bf16"],
                   help="dtype of the output (default: --precision)")
    p.add_argument("--working_device", default=None, help="device for the deltas (cpu, cuda; default cpu)")
    p.add_argument("--no_metadata", action="store_true", help="LoRA output: only the minimum ss_* metadata")
    p.add_argument("--concat", action="store_true", help="LoRA output: stack the ranks (the exact sum)")
    p.add_argument("--shuffle", action="store_true", help="with --concat: permute the stacked ranks (as sd-scripts)")
    for flag in NOT_BUILT:
        p.add_argument("--" + flag, default=None, nargs="?", const=True, help=argparse.SUPPRESS)
    return merge_lora.parse_with_ratios(p, argv)


def merge_into(flux, weights_sd: dict, ratio: float, device=None, source: str = "(state dict)") -> int:
    """Add ratio x each module's delta to the transformer's weights; returns the module count."""
    te = sorted({k.split(".")[0] for k in weights_sd if k.startswith("lora_te")})
    if te:
        raise LoRAError(f"{source}: has text encoder modules (e.g. {te[0]}), which this tool does not merge "
                        "(sd-scripts' --clip_l / --t5xxl are not built here)")
    network, _ = lora_flux.create_network_from_weights(ratio, source, None, [None], flux, weights_sd=weights_sd)
    network.merge_to(None, flux, weights_sd, device=device)
    return len(network.unet_loras)


def run(args) -> None:
    for flag in NOT_BUILT:
        if getattr(args, flag) is not None:
            raise LoRAError(f"--{flag} (sd-scripts' flux_merge_lora.py) is not supported here")
    if args.flux_model is None:
        merge_lora.run_lora_merge(args)
        return
    if args.concat or args.shuffle:
        raise LoRAError("--concat / --shuffle merge LoRA files into one LoRA file; leave out --flux_model to use them")
    loras = [(path, load_state_dict_file(path), ratio) for path, ratio in zip(args.models, args.ratios)]
    dtype = lora_svd.PRECISIONS[args.precision]
    flux, weights = flux_checkpoint.load_transformer(args.flux_model, dtype)
    device = lora_svd.parse_device(args.working_device, "--working_device")
    with torch.no_grad():
        for path, sd, ratio in loras:
            n = merge_into(flux, sd, ratio, device, path)
            print(f"merged {path} (ratio {ratio}): {n} modules")
    save_dtype = lora_svd.PRECISIONS[args.save_precision] if args.save_precision else dtype
    flux_checkpoint.save_flux_transformer(args.save_to, flux.state_dict(), weights.layout, weights.config,
                                          dtype=save_dtype)
    print(f"saved {args.save_to}")


def main(argv=None) -> int:
    return lora_svd.tool_main(_parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
