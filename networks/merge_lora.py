"""Merge one or more kohya LoRA files, each with a ratio, into a Stable Diffusion model.

    python networks/merge_lora.py --sd_model MODEL --models a.safetensors b.safetensors \\
        --ratios 1.0 0.5 --save_to merged.safetensors [--save_precision fp16|bf16|float]

MODEL is anything `pretrained_model_name_or_path` accepts (diffusers folder, single file, built-in
name). --save_to ending in .safetensors/.ckpt/.pt writes a single file in the original SD layout;
any other path is written as a diffusers folder. Flag names follow sd-scripts' merge_lora.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from networks.lora import LoRAError, create_network_from_weights, load_state_dict_file  # noqa: E402

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt")
PRECISIONS = {"float": "float32", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def merge_lora_into(text_encoders, unet, weights_sd: dict, ratio: float) -> int:
    """Add ratio * up @ down * alpha / rank of every module in weights_sd to the model's own
    weights, in place (the sum is formed in float32, stored in each weight's dtype).
    Returns the number of modules merged. Raises LoRAError when the file does not fit the model."""
    network, _ = create_network_from_weights(ratio, None, None, list(text_encoders), unet, weights_sd=weights_sd)
    network.merge_to(text_encoders, unet, weights_sd)
    return len(network.text_encoder_loras) + len(network.unet_loras)


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Merge kohya LoRA files into a Stable Diffusion model.")
    p.add_argument("--sd_model", required=True,
                   help="base model: diffusers folder, single .safetensors/.ckpt, or a built-in name (tiny-sd15 ...)")
    p.add_argument("--models", nargs="+", required=True, help="LoRA files (.safetensors, .ckpt, .pt)")
    p.add_argument("--ratios", nargs="+", type=float, default=None, help="one ratio per LoRA file (default 1.0 each)")
    p.add_argument("--save_to", required=True,
                   help="output: a .safetensors/.ckpt/.pt single file, or a folder for the diffusers layout")
    p.add_argument("--save_precision", choices=sorted(PRECISIONS), default=None,
                   help="dtype of the saved model (default: the loaded model's dtype)")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="float",
                   help="accepted for sd-scripts compatibility: merging is always done in float32")
    p.add_argument("--v2", action="store_true", help="the base model is SD2 (checked against the weights)")
    p.add_argument("--v_parameterization", action="store_true", help="the base model predicts v")
    p.add_argument("--tokenizer_path", default=None, help="tokenizer files for a single-file model")
    p.add_argument("--no_metadata", action="store_true", help="do not record the merged LoRA files in the output")
    args = p.parse_args(argv)
    if args.ratios is None:
        args.ratios = [1.0] * len(args.models)
    if len(args.ratios) != len(args.models):
        p.error(f"--ratios: {len(args.ratios)} value(s) given for {len(args.models)} file(s) in --models")
    return args


def run(args) -> None:
    import torch

    from library.models import load_model_bundle
    from library.sd_checkpoint import save_diffusers, save_single_file

    # Read every LoRA before the model, so a bad file fails fast.
    loras = [(path, load_state_dict_file(path), ratio) for path, ratio in zip(args.models, args.ratios)]
    bundle = load_model_bundle(args.sd_model, v2=args.v2, v_parameterization=args.v_parameterization,
                               tokenizer_path=args.tokenizer_path)
    for path, weights_sd, ratio in loras:
        try:
            n = merge_lora_into(bundle.text_encoders, bundle.unet, weights_sd, ratio)
        except LoRAError as e:
            raise LoRAError(f"{path}: {e}") from e
        print(f"merged {path} (ratio {ratio}): {n} modules")

    dtype = getattr(torch, PRECISIONS[args.save_precision]) if args.save_precision else None
    components = bundle.components()
    if args.save_to.lower().endswith(SINGLE_FILE_SUFFIXES):
        metadata = None
        if not args.no_metadata:
            metadata = {"merged_loras": json.dumps([[os.path.basename(p), r] for p, _, r in loras])}
        save_single_file(components, bundle.family, args.save_to, dtype=dtype, metadata=metadata)
    else:
        save_diffusers(components, bundle.family, args.save_to, dtype=dtype)
    print(f"saved {args.save_to}")


def main(argv=None) -> int:
    args = _parse_args(argv)
    from library.errors import UserError
    from library.models import ModelError
    try:
        run(args)
    except (LoRAError, ModelError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
