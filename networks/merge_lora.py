"""Merge kohya LoRA files, each with a ratio, into a Stable Diffusion model, or (without --sd_model)
into one LoRA file.

    python networks/merge_lora.py --sd_model MODEL --models a.safetensors b.safetensors \\
        --ratios 1.0 0.5 --save_to merged.safetensors [--save_precision fp16|bf16|float]
    python networks/merge_lora.py --models a.safetensors b.safetensors --ratios 1.0 0.5 \\
        --save_to merged_lora.safetensors [--concat [--shuffle]]

MODEL is anything `pretrained_model_name_or_path` accepts (diffusers folder, single file, built-in
name). --save_to ending in .safetensors/.ckpt/.pt writes a single file in the original SD layout;
any other path is written as a diffusers folder. Flag names follow sd-scripts' merge_lora.py.
Into a model, LoHa, LoKr (their deltas) and OFT, OFTv2 and BOFT files (the rotated weights; OFTv2 /
BOFT in float64) merge too, and LyCORIS'
DoRA (``dora_scale``) and full (``diff``) files: W + ratio * (W' - W) with DoRA's W' =
dora_scale * (W + delta) / ||W + delta|| (networks/adapter_weights.py), full's W + ratio * diff.
LoRA + LoRA takes LoRA-layout files only (LoRA, LoCon, DyLoRA, LoRA-FA) and names any other kind.

LoRA + LoRA: --concat stacks the modules' ranks (down rows, up columns) with each file's
ratio * alpha / rank folded into its factors, so the result is exactly sum_i ratio_i * delta_i.
Without --concat the ups and the downs are summed separately, as sd-scripts does (same file as
sd-scripts, kept for compatibility): that is not the sum of the deltas, and a warning says so.

--lbws (sd-scripts' sdxl_merge_lora.py / svd_merge_lora.py flag, here in both modes and for every
family): per file a LoRA Block Weight list (networks/lora_blocks.py); each module's delta is
scaled by its block's weight once (sd-scripts' LoRA + LoRA merge scales the up and the down
factors both, so a weight w scales the delta by w squared; here by w). networks/sdxl_merge_lora.py
is this tool restricted to SDXL models and LoRAs, under sd-scripts' name.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import math  # noqa: E402

import torch  # noqa: E402

from library.errors import ModelError, run_tool  # noqa: E402
from library.models.loading import load_model_bundle  # noqa: E402
from library.models.sd_checkpoint import save_diffusers, save_single_file  # noqa: E402
from networks import lora_blocks, lora_names, lora_svd  # noqa: E402
from networks import boft, loha, lokr, oft, oft_v2  # noqa: E402
from networks.adapter_weights import dora_weight, file_kinds, module_delta  # noqa: E402
from networks.lora import LoRAError, create_network_from_weights, load_state_dict_file  # noqa: E402

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt")
PRECISIONS = {"float": "float32", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


# a file's kind (networks/adapter_weights.py) -> the network module that reads it back
FROM_WEIGHTS = {"LoRA": create_network_from_weights, "LoHa": loha.create_network_from_weights,
                "LoKr": lokr.create_network_from_weights, "OFT": oft.create_network_from_weights,
                "OFTv2": oft_v2.create_network_from_weights, "BOFT": boft.create_network_from_weights}


# the LyCORIS kinds merged layer by layer here (merge_layerwise): not an additive delta of a module
LAYERWISE_KINDS = {"DoRA", "LyCORIS full"}


def merge_lora_into(text_encoders, unet, weights_sd: dict, ratio: float,
                    block_weights: list[float] | None = None) -> int:
    """Merge every module of weights_sd, times ratio, into the model's own weights, in place (in
    float32, stored in each weight's dtype): LoRA / LoCon / DyLoRA / LoRA-FA add
    up @ down * alpha / rank, LoHa and LoKr their deltas, OFT rotates the weights; DoRA and
    LyCORIS full files go through merge_layerwise.
    block_weights: 26 LoRA Block Weight values (networks/lora_blocks.py), each module's ratio
    times its block's. Returns the number of modules merged. Raises LoRAError when the file does
    not fit the model."""
    kinds = file_kinds(weights_sd)
    if LAYERWISE_KINDS & set(kinds):
        if block_weights is not None:
            raise LoRAError(f"--lbws applies to additive LoRA modules, not to a {'/'.join(kinds)} file "
                            "(merged layer by layer as a whole weight)")
        return merge_layerwise(text_encoders, unet, weights_sd, ratio)
    if len(kinds) != 1 or kinds[0] not in FROM_WEIGHTS:
        raise LoRAError(f"a {'/'.join(kinds) or 'non-adapter'} file: merging handles one kind per file of "
                        f"{', '.join([*FROM_WEIGHTS, *sorted(LAYERWISE_KINDS)])}")
    network, _ = FROM_WEIGHTS[kinds[0]](ratio, None, None, list(text_encoders), unet, weights_sd=weights_sd)
    if block_weights is not None:
        is_sdxl = lora_names.is_sdxl_unet(unet)
        for module in network.text_encoder_loras + network.unet_loras:
            module.multiplier = ratio * lora_blocks.lbw_factor(block_weights, module.lora_name, is_sdxl)
    network.merge_to(text_encoders, unet, weights_sd)
    return len(network.text_encoder_loras) + len(network.unet_loras)


def merge_layerwise(text_encoders, unet, weights_sd: dict, ratio: float) -> int:
    """A LyCORIS file with DoRA (``dora_scale``) or full (``diff`` / ``diff_b``) modules, each into
    the layer its kohya name names, in float64: W + ratio * (W' - W), W' the module's weight
    (DoRA: dora_scale * (W + delta) / ||W + delta|| along the file's axis; full: W + diff; any
    other LoRA / LoHa / LoKr module: W + delta)."""
    layers = lora_names.kohya_layers(list(text_encoders), unet)
    modules: dict[str, dict] = {}
    for key, value in weights_sd.items():
        name, _, part = key.partition(".")
        modules.setdefault(name, {})[part] = value
    missing = sorted(n for n in modules if not hasattr(layers.get(n), "weight"))
    if missing:
        raise LoRAError(f"{len(missing)} module(s) name no layer of this model (wrong base model?), e.g. {missing[0]}")
    with torch.no_grad():
        for name, p in modules.items():
            layer = layers[name]
            try:
                _merge_layer(layer, p, ratio)
            except (RuntimeError, ValueError) as e:
                raise LoRAError(f"module {name}: {e}") from None
    return len(modules)


def _merge_layer(layer, p: dict, ratio: float) -> None:
    w = layer.weight.double()
    if "diff" in p:
        target = w + p["diff"].double().reshape(w.shape)
        if "diff_b" in p:
            if layer.bias is None:
                raise ValueError("has diff_b but the layer has no bias")
            b = layer.bias.double()
            layer.bias.copy_((b + ratio * p["diff_b"].double().reshape(b.shape)).to(layer.bias.dtype))
    elif "lora_mid.weight" in p:
        raise ValueError("a Tucker (lora_mid) module: not merged")
    else:
        delta = module_delta({k: v for k, v in p.items() if k != "dora_scale"}, w, torch.float64)
        target = dora_weight(w, delta, p["dora_scale"].double()) if "dora_scale" in p else w + delta
    layer.weight.copy_((w + ratio * (target - w)).to(layer.weight.dtype))


APPROXIMATE_WARNING = ("warning: without --concat the LoRAs' ups and downs are summed separately (sd-scripts' "
                       "arithmetic): the result is not the sum of their deltas; use --concat for the exact sum "
                       "or svd_merge_lora.py for a chosen rank")


def sum_loras_sd_scripts(inputs: list[lora_svd.LoRAInput]) -> dict[str, lora_svd.Module]:
    """sd-scripts' plain LoRA + LoRA merge: with base_alpha the first file's alpha for the module
    and s_i = sqrt(alpha_i / base_alpha) * ratio_i, up = sum |s_i| up_i, down = sum s_i down_i,
    alpha = base_alpha. Equal to the sum of the deltas only in special cases (one file at ratio 1)."""
    out: dict[str, lora_svd.Module] = {}
    for inp in inputs:
        for name, m in inp.modules.items():
            base = out.get(name)
            base_alpha = base.alpha if base is not None else m.alpha
            if m.alpha / base_alpha < 0:
                raise LoRAError(f"{inp.path}: module {name} has alpha {m.alpha} of the opposite sign to the first "
                                f"file's {base_alpha}: use --concat")
            s = math.sqrt(m.alpha / base_alpha) * inp.ratio
            down, up = m.down.float() * s, m.up.float() * abs(s)
            if base is None:
                out[name] = lora_svd.Module(name, down, up, m.alpha)
                continue
            if base.rank != m.rank:
                raise LoRAError(f"{inp.path}: module {name} has rank {m.rank}, the files before it {base.rank}: "
                                "ranks must match without --concat (or use svd_merge_lora.py)")
            out[name] = lora_svd.Module(name, base.down + down, base.up + up, base_alpha)
    return out


def _parse_args(argv, only_sdxl: bool = False):
    what = "an SDXL model" if only_sdxl else "a Stable Diffusion model"
    p = argparse.ArgumentParser(description=f"Merge kohya LoRA files into {what} (--sd_model) or into one LoRA file.")
    p.add_argument("--sd_model", default=None,
                   help="base model: diffusers folder, single .safetensors/.ckpt, or a built-in name (tiny-sd15 "
                        "...); without it the LoRA files are merged into one LoRA file")
    add_models_and_ratios(p)
    lora_svd.add_lbws(p)
    p.add_argument("--save_to", required=True,
                   help="output: a .safetensors/.ckpt/.pt single file, or a folder for the diffusers layout")
    p.add_argument("--save_precision", choices=sorted(PRECISIONS), default=None,
                   help="dtype of the saved model (default: the loaded model's dtype)")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="float",
                   help="accepted for sd-scripts compatibility: merging is always done in float32")
    p.add_argument("--v2", action="store_true", help="the base model is SD2 (checked against the weights)")
    p.add_argument("--v_parameterization", action="store_true", help="the base model predicts v")
    p.add_argument("--tokenizer_path", default=None, help="tokenizer files for a single-file model")
    p.add_argument("--no_metadata", action="store_true",
                   help="do not record the merged LoRA files in the output (LoRA output: no modelspec.*)")
    p.add_argument("--concat", action="store_true",
                   help="LoRA output: stack the ranks (rank = the sum of the inputs'), exactly the weighted sum")
    p.add_argument("--shuffle", action="store_true", help="with --concat: permute the stacked ranks (as sd-scripts)")
    return parse_with_ratios(p, argv)


def add_models_and_ratios(p: argparse.ArgumentParser) -> None:
    """The merge tools' --models and --ratios (sd-scripts' names)."""
    p.add_argument("--models", nargs="+", required=True, help="LoRA files (.safetensors, .ckpt, .pt)")
    p.add_argument("--ratios", nargs="+", type=float, default=None, help="one ratio per LoRA file (default 1.0 each)")


def parse_with_ratios(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Parse; --ratios defaults to 1.0 per file of --models and must give one per file."""
    args = p.parse_args(argv)
    if args.ratios is None:
        args.ratios = [1.0] * len(args.models)
    if len(args.ratios) != len(args.models):
        p.error(f"--ratios: {len(args.ratios)} value(s) given for {len(args.models)} file(s) in --models")
    return args


def run_lora_merge(args, lbws: list[str] | None = None, only_sdxl: bool = False) -> None:
    """LoRA files -> one LoRA file (no --sd_model); lbws: --lbws; only_sdxl: SDXL files only."""
    if not args.save_to.lower().endswith(lora_svd.LORA_FILE_SUFFIXES):
        raise LoRAError(f"--save_to {args.save_to}: without --sd_model the output is a LoRA file "
                        f"({', '.join(lora_svd.LORA_FILE_SUFFIXES)})")
    if args.shuffle and not args.concat:
        raise LoRAError("--shuffle only applies with --concat")
    lora_svd.check_save_to(args.save_to)
    block_weights = lora_blocks.parse_lbws(lbws, len(args.models)) if lbws else None
    inputs = lora_svd.read_inputs(args.models, args.ratios, "merging into one LoRA")
    if only_sdxl:
        for inp in inputs:
            if not lora_blocks.is_sdxl_names(inp.modules):
                raise LoRAError(f"{inp.path}: not an SDXL LoRA (sdxl_merge_lora.py merges SDXL files; use merge_lora.py)")
    if block_weights:
        inputs = lora_svd.block_weighted(inputs, *block_weights)
    if args.concat:
        modules = lora_svd.concat(inputs, args.shuffle)
    else:
        if len(inputs) > 1 or inputs[0].ratio != 1:
            print(APPROXIMATE_WARNING, file=sys.stderr)
        modules = sum_loras_sd_scripts(inputs)
    metadata = lora_svd.common_metadata(inputs)
    parts = " + ".join(f"{r:g} x {os.path.basename(p)}" for p, r in zip(args.models, args.ratios))
    how = "concatenated" if args.concat else "ups and downs summed (sd-scripts)"
    metadata = lora_svd.add_comment(metadata, f"merge_lora: {parts}, {how}")
    metadata = lora_svd.rank_metadata(modules, metadata)
    if not args.no_metadata:
        metadata = lora_svd.lora_modelspec(metadata, args.save_to,
                                           [lora_svd.title_of(i.path, i.metadata) for i in inputs])
    dtype = getattr(torch, PRECISIONS[args.save_precision]) if args.save_precision else torch.float32
    lora_svd.save_lora(args.save_to, modules, metadata, dtype)
    print(f"merged {len(inputs)} LoRA files into {len(modules)} modules; saved {args.save_to}")


def run(args, only_sdxl: bool = False) -> None:
    if args.sd_model is None:
        return run_lora_merge(args, args.lbws, only_sdxl)
    if args.concat or args.shuffle:
        raise LoRAError("--concat / --shuffle merge LoRA files into one LoRA file; leave out --sd_model to use them")
    run_model_merge(args, only_sdxl)


def run_model_merge(args, only_sdxl: bool = False) -> None:
    """LoRA files merged into the weights of --sd_model."""
    # Read every LoRA before the model, so a bad file fails fast.
    lbws, lbw_sdxl = ([None] * len(args.models), None)
    if args.lbws:
        lbws, lbw_sdxl = lora_blocks.parse_lbws(args.lbws, len(args.models))
    loras = [(path, load_state_dict_file(path), ratio) for path, ratio in zip(args.models, args.ratios)]
    bundle = load_model_bundle(args.sd_model, v2=args.v2, v_parameterization=args.v_parameterization,
                               tokenizer_path=args.tokenizer_path)
    if only_sdxl and not lora_names.is_sdxl_unet(bundle.unet):
        raise ModelError(f"--sd_model {args.sd_model}: a {bundle.family} model; sdxl_merge_lora.py merges into "
                         "SDXL models (use merge_lora.py)")
    if lbw_sdxl is not None:
        lora_svd.check_lbws_family(lbw_sdxl, lora_names.is_sdxl_unet(bundle.unet), f"--sd_model {args.sd_model}")
    for (path, weights_sd, ratio), block_weights in zip(loras, lbws):
        try:
            n = merge_lora_into(bundle.text_encoders, bundle.unet, weights_sd, ratio, block_weights)
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


def main(argv=None, only_sdxl: bool = False) -> int:
    return run_tool(run, _parse_args(argv, only_sdxl), only_sdxl)


if __name__ == "__main__":
    sys.exit(main())
