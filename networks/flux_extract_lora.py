"""Extract a FLUX.1 LoRA (networks.lora_flux's layout) from the difference of two transformers by SVD.

    python networks/flux_extract_lora.py --model_org flux1-dev.safetensors --model_tuned tuned.safetensors \\
        --save_to extracted.safetensors --dim 4 [--clamp_quantile 0.99] [--save_precision bf16] \\
        [--device cuda] [--no_metadata]

Flags are those of sd-scripts' networks/flux_extract_lora.py. Both models are BFL-layout single
files (with or without ``model.diffusion_model.``; bf16, fp16, float32 or plain fp8 storage), read
one tensor at a time, so two 12B models need no more memory than one weight. The modules are the
2-D weights of the double and single blocks (biases and norms left out), which are exactly
networks.lora_flux's default targets, named ``lora_unet_double_blocks_0_img_attn_qkv`` ...; each
delta W_tuned - W_org (in float32) is factorised by SVD, truncated to dim, clamped at the quantile
as sd-scripts does, and saved with alpha = rank (scale 1) by the one LoRA writer.
"""
from __future__ import annotations

import argparse
import os
import sys

from safetensors import safe_open

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library.errors import first_line  # noqa: E402
from networks import lora_flux, lora_svd  # noqa: E402
from networks.lora import LoRAError  # noqa: E402

BFL_PREFIX = "model.diffusion_model."


def block_weight_keys(keys) -> list[str]:
    """sd-scripts' selection: block weights, no bias, no norm (the RMS norm scales)."""
    return sorted(k for k in keys if k.startswith(("double_blocks.", "single_blocks."))
                  and k.endswith(".weight") and ".norm." not in k)


class _Transformer:
    """A BFL single file's tensors by key (prefix removed), read on demand."""

    def __init__(self, option: str, path: str):
        if not os.path.isfile(path):
            raise LoRAError(f"{option} {path}: file not found")
        if not path.endswith((".safetensors", ".sft")):
            raise LoRAError(f"{option} {path}: not a .safetensors file (a BFL-layout FLUX.1 transformer)")
        try:
            self.file = safe_open(path, framework="pt")
        except Exception as e:  # a truncated or foreign file
            raise LoRAError(f"{option} {path}: cannot read: {first_line(e)}") from None
        names = list(self.file.keys())
        self.prefix = BFL_PREFIX if any(k.startswith(BFL_PREFIX) for k in names) else ""
        self.keys = {k[len(self.prefix):] for k in names if k.startswith(self.prefix)}
        if "double_blocks.0.img_attn.qkv.weight" not in self.keys:
            raise LoRAError(f"{option} {path}: not a BFL-layout FLUX.1 transformer (no double_blocks.0.img_attn.qkv)")
        if any(k.endswith(".scale_weight") for k in self.keys):
            raise LoRAError(f"{option} {path}: a scaled-fp8 checkpoint (scale_weight tensors); use an unscaled one")

    def get(self, key: str) -> torch.Tensor:
        return self.file.get_tensor(self.prefix + key)


def extract(org: _Transformer, tuned: _Transformer, dim: int, clamp_quantile: float,
            device=None) -> dict[str, lora_svd.Module]:
    keys = block_weight_keys(org.keys)
    if keys != block_weight_keys(tuned.keys):
        only = sorted(set(keys) ^ set(block_weight_keys(tuned.keys)))
        raise LoRAError(f"--model_org and --model_tuned have different blocks (different models?), e.g. {only[0]}")
    out = {}
    for key in keys:
        o, t = org.get(key), tuned.get(key)
        if o.shape != t.shape:
            raise LoRAError(f"--model_org and --model_tuned differ in the shape of {key}")
        delta = t.to(device, torch.float32) - o.to(device, torch.float32)
        if not torch.isfinite(delta).all():
            raise LoRAError(f"{key}: the difference of the two models has non-finite values (a broken checkpoint?)")
        name = "lora_unet_" + key[:-len(".weight")].replace(".", "_")
        shape = tuple(delta.shape)
        rank = min(dim, lora_svd.max_rank(shape))
        out[name] = lora_svd.module_from_delta(name, delta, rank, device, clamp_quantile)
    return out


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Extract a FLUX.1 LoRA from the difference of two transformers.")
    p.add_argument("--model_org", required=True, help="original FLUX.1 transformer (BFL-layout .safetensors)")
    p.add_argument("--model_tuned", required=True, help="tuned transformer; the LoRA is the difference tuned - org")
    p.add_argument("--save_to", required=True, help="output LoRA file (.safetensors, .ckpt, .pt, .pth)")
    p.add_argument("--dim", type=int, default=4, help="rank of the LoRA (default 4)")
    p.add_argument("--clamp_quantile", type=float, default=0.99,
                   help="clamp up and down at this quantile of their values, as sd-scripts "
                        "(default 0.99; 1 = no clamp)")
    p.add_argument("--save_precision", default=None, choices=["float", "fp16", "bf16"],
                   help="dtype of the output (default float)")
    p.add_argument("--device", default=None, help="device for the differences and SVDs (cpu, cuda; default cpu)")
    p.add_argument("--mem_eff_safe_open", action="store_true",
                   help="accepted for sd-scripts' configs: tensors are always read one at a time here")
    p.add_argument("--no_metadata", action="store_true",
                   help="write only the minimum ss_* metadata (no modelspec.*), as sd-scripts")
    return p.parse_args(argv)


def run(args) -> None:
    if args.dim < 1:
        raise LoRAError(f"--dim {args.dim}: must be >= 1")
    if not 0 < args.clamp_quantile <= 1:
        raise LoRAError(f"--clamp_quantile {args.clamp_quantile}: must be in (0, 1]")
    lora_svd.check_save_to(args.save_to)
    device = lora_svd.parse_device(args.device)
    org = _Transformer("--model_org", args.model_org)
    tuned = _Transformer("--model_tuned", args.model_tuned)
    with torch.no_grad():
        modules = extract(org, tuned, args.dim, args.clamp_quantile, device)
    variant = "dev" if "guidance_in.in_layer.weight" in org.keys else "schnell"
    family = lora_flux.file_metadata(variant)
    metadata = {k: v for k, v in family.items() if k.startswith("ss_")}
    metadata = lora_svd.add_comment(metadata, f"extracted by SVD from {os.path.basename(args.model_tuned)} - "
                                              f"{os.path.basename(args.model_org)} (dim {args.dim}, "
                                              f"clamp_quantile {args.clamp_quantile})")
    metadata = lora_svd.rank_metadata(modules, metadata)
    if not args.no_metadata:
        metadata.update({k: v for k, v in family.items() if k.startswith("modelspec.")})
        metadata = lora_svd.lora_modelspec(metadata, args.save_to)
    lora_svd.save_lora(args.save_to, modules, metadata, lora_svd.PRECISIONS[args.save_precision or "float"])
    print(f"extracted {len(modules)} modules into {args.save_to}")


def main(argv=None) -> int:
    return lora_svd.tool_main(_parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
