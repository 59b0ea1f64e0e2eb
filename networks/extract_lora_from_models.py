"""Extract a kohya LoRA (LoCon with --conv_dim) from the difference of two models by SVD.

    python networks/extract_lora_from_models.py --model_org base.safetensors --model_tuned tuned/ \\
        --save_to extracted.safetensors --dim 8 [--conv_dim 4] [--clamp_quantile 0.99] [--min_diff 0.01] \\
        [--save_precision fp16] [--load_precision fp16] [--device cuda] [--sdxl | --v2] [--no_metadata]

Models are anything `pretrained_model_name_or_path` accepts (single file, diffusers folder, built-in
name). The family comes from the weights; --sdxl / --v2 (needed by sd-scripts) are checked against
them. The modules and their kohya names are those train_lora.py creates (networks.lora's
LoRANetwork, with conv_dim: the 3x3 convs too), so the file loads wherever our LoRAs load. Each
module's delta W_tuned - W_org is factorised by SVD, truncated to dim (conv_dim), clamped at the
quantile as sd-scripts does, and saved with alpha = rank (scale 1). A text encoder whose largest
weight change is at most min_diff is left out. Differences from sd-scripts: docs/LORA_TOOLS.md.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library.models.families import registry  # noqa: E402
from library.models.loading import load_model_bundle  # noqa: E402
from networks import lora_svd  # noqa: E402
from networks.lora import LoRAError, LoRANetwork  # noqa: E402


def text_encoder_prefix(lora_name: str) -> str:
    return lora_name.split("_text_model_", 1)[0]


def target_modules(bundle, with_conv3x3: bool) -> dict:
    """kohya name -> the model's own Linear/Conv2d, exactly as training selects them (with
    conv_dim: the 3x3 convs too). Built at rank 1: only the selection and names are used, so a
    large --dim does not allocate two throw-away networks."""
    net = LoRANetwork(bundle.text_encoders, bundle.unet, lora_dim=1, alpha=1,
                      conv_lora_dim=1 if with_conv3x3 else None, conv_alpha=1 if with_conv3x3 else None)
    return {m.lora_name: m.org_module for m in net.text_encoder_loras + net.unet_loras}


def extract(org: dict, tuned: dict, dim: int, conv_dim: int | None, clamp_quantile: float,
            min_diff: float, device=None, log=print) -> dict[str, lora_svd.Module]:
    """Low-rank modules of tuned - org (both: kohya name -> module); text encoders that changed by
    at most min_diff are skipped."""
    if set(org) != set(tuned):
        only = sorted(set(org) ^ set(tuned))
        raise LoRAError(f"--model_org and --model_tuned have different modules (different architectures?), "
                        f"e.g. {only[0]}")
    te_change: dict[str, float] = {}
    for name in org:
        if name.startswith("lora_te"):
            if org[name].weight.shape != tuned[name].weight.shape:
                raise LoRAError(f"--model_org and --model_tuned differ in the shape of {name}")
            change = float((tuned[name].weight.float() - org[name].weight.float()).abs().max())
            prefix = text_encoder_prefix(name)
            te_change[prefix] = max(te_change.get(prefix, 0.0), change)
    for prefix, change in te_change.items():
        verdict = "extracted" if change > min_diff else "unchanged, not extracted"
        log(f"text encoder {prefix}: max |diff| {change:.3g} (min_diff {min_diff:g}): {verdict}")

    out: dict[str, lora_svd.Module] = {}
    for name, o in org.items():
        if name.startswith("lora_te") and te_change[text_encoder_prefix(name)] <= min_diff:
            continue
        t = tuned[name]
        if o.weight.shape != t.weight.shape:
            raise LoRAError(f"--model_org and --model_tuned differ in the shape of {name}")
        delta = t.weight.detach().to(device, torch.float32) - o.weight.detach().to(device, torch.float32)
        if not torch.isfinite(delta).all():
            raise LoRAError(f"{name}: the difference of the two models has non-finite values (a broken checkpoint?)")
        shape = tuple(delta.shape)
        conv3x3 = delta.dim() == 4 and shape[2:] != (1, 1)
        rank = min(conv_dim if conv3x3 else dim, lora_svd.max_rank(shape))
        out[name] = lora_svd.module_from_delta(name, delta, rank, device, clamp_quantile)
    return out


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Extract a kohya LoRA from the difference of two Stable Diffusion models.")
    p.add_argument("--model_org", required=True,
                   help="original model: single file, diffusers folder or built-in name (tiny-sd15 ...)")
    p.add_argument("--model_tuned", required=True, help="tuned model; the LoRA is the difference tuned - org")
    p.add_argument("--save_to", required=True, help="output LoRA file (.safetensors, .ckpt, .pt, .pth)")
    p.add_argument("--dim", type=int, default=4, help="rank of the Linear/1x1 modules (default 4)")
    p.add_argument("--conv_dim", type=int, default=None,
                   help="rank of the 3x3 conv modules (LoCon); default: no 3x3 conv modules")
    p.add_argument("--clamp_quantile", type=float, default=0.99,
                   help="clamp up and down at this quantile of their values, as sd-scripts (default 0.99; 1 = no clamp)")
    p.add_argument("--min_diff", type=float, default=0.01,
                   help="a text encoder whose largest weight change is <= this is not extracted (default 0.01)")
    p.add_argument("--save_precision", default=None, choices=["float", "fp16", "bf16"],
                   help="dtype of the output (default float)")
    p.add_argument("--load_precision", default=None, choices=["float", "fp16", "bf16"],
                   help="cast both models to this dtype after loading (default: as stored)")
    p.add_argument("--device", default=None, help="device for the differences and SVDs (cpu, cuda; default cpu)")
    p.add_argument("--load_original_model_to", default=None,
                   help="device to hold --model_org's weights (cpu, cuda, cuda:0; default cpu)")
    p.add_argument("--load_tuned_model_to", default=None,
                   help="device to hold --model_tuned's weights (cpu, cuda, cuda:0; default cpu)")
    p.add_argument("--sdxl", action="store_true", help="the models are SDXL (checked against the weights)")
    p.add_argument("--v2", action="store_true", help="the models are SD2 (checked against the weights)")
    p.add_argument("--v_parameterization", action="store_true", default=None,
                   help="record v-prediction in the metadata (default: the model's own prediction type)")
    p.add_argument("--no_metadata", action="store_true",
                   help="write only the minimum ss_* metadata (no modelspec.*), as sd-scripts")
    return p.parse_args(argv)


def _check_family(option: str, family: str, args) -> None:
    for flag, expected in (("--sdxl", "sdxl"), ("--v2", "sd2")):
        if getattr(args, flag[2:]) and family != expected:
            raise LoRAError(f"{flag} is given but {option} holds {registry.get(family).title} weights")


def run(args) -> None:
    if args.sdxl and args.v2:
        raise LoRAError("--sdxl and --v2 cannot both be given")
    for option, value in (("--dim", args.dim), ("--conv_dim", args.conv_dim)):
        if value is not None and value < 1:
            raise LoRAError(f"{option} {value}: must be >= 1")
    if not 0 < args.clamp_quantile <= 1:
        raise LoRAError(f"--clamp_quantile {args.clamp_quantile}: must be in (0, 1]")
    if not args.min_diff >= 0:
        raise LoRAError(f"--min_diff {args.min_diff}: must be >= 0")
    lora_svd.check_save_to(args.save_to)
    device = lora_svd.parse_device(args.device)
    load_dtype = lora_svd.PRECISIONS[args.load_precision] if args.load_precision else None

    places = {"--model_org": lora_svd.parse_device(args.load_original_model_to, "--load_original_model_to"),
              "--model_tuned": lora_svd.parse_device(args.load_tuned_model_to, "--load_tuned_model_to")}

    def load(option: str, source: str):
        bundle = load_model_bundle(source, v_parameterization=bool(args.v_parameterization))
        _check_family(option, bundle.family, args)
        for m in bundle.text_encoders + [bundle.unet]:
            m.to(device=places[option], dtype=load_dtype)
        return bundle

    with torch.no_grad():
        org = load("--model_org", args.model_org)
        tuned = load("--model_tuned", args.model_tuned)
        if tuned.family != org.family:
            raise LoRAError(f"--model_org is {registry.get(org.family).title} but --model_tuned is "
                            f"{registry.get(tuned.family).title}")
        with_conv = args.conv_dim is not None
        modules = extract(target_modules(org, with_conv), target_modules(tuned, with_conv),
                          args.dim, args.conv_dim, args.clamp_quantile, args.min_diff, device)

    family = org.family
    v_param = bool(args.v_parameterization) or org.v_parameterization
    fields = registry.home(family).metadata_fields("v" if v_param else "epsilon", "lora")  # its own strings
    metadata = {"ss_v2": str(registry.get(family).v2_metadata), "ss_base_model_version": fields["ss_base_model_version"],
                "ss_network_module": "networks.lora"}
    conv = f", conv_dim {args.conv_dim}" if args.conv_dim else ""
    metadata = lora_svd.add_comment(metadata, f"extracted by SVD from {os.path.basename(str(args.model_tuned))} - "
                                              f"{os.path.basename(str(args.model_org))} (dim {args.dim}{conv}, "
                                              f"clamp_quantile {args.clamp_quantile})")
    metadata = lora_svd.rank_metadata(modules, metadata)
    if not args.no_metadata:
        metadata.update({k: fields[k] for k in ("modelspec.architecture", "modelspec.implementation",
                                                "modelspec.prediction_type")})
        metadata = lora_svd.lora_modelspec(metadata, args.save_to)
    dtype = lora_svd.PRECISIONS[args.save_precision or "float"]
    lora_svd.save_lora(args.save_to, modules, metadata, dtype)
    n_te = sum(1 for n in modules if n.startswith("lora_te"))
    print(f"extracted {len(modules)} modules ({n_te} text encoder, {len(modules) - n_te} U-Net) into {args.save_to}")


def main(argv=None) -> int:
    return lora_svd.tool_main(_parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
