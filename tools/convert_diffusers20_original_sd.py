"""Convert an SD1 / SD2 / SDXL model between a single file (original layout) and a diffusers folder
(sd-scripts' tools/convert_diffusers20_original_sd.py and its flags).

    python tools/convert_diffusers20_original_sd.py [--v1|--v2] [--fp16|--bf16|--float|--save_precision_as P] \\
        [--unet_use_linear_projection] [--reference_model DIR] [--use_safetensors] \\
        [--epoch N] [--global_step N] [--metadata DICT] model_to_load model_to_save

model_to_load: a single file (.safetensors, .ckpt), a diffusers folder or a built-in name
(tiny-sd15 ...); model_to_save: with an extension a single file, without one a diffusers
folder. The family is read from the weights (SDXL too, which sd-scripts' script does not
convert); --v1 / --v2 are checked against it. The conversion is library/models/sd_convert.py.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library import log  # noqa: E402
from library.errors import UserError  # noqa: E402


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Convert an SD1/SD2/SDXL model between a single file and a diffusers folder.")
    p.add_argument("--v1", action="store_true", help="the model is SD1.x (checked against the weights)")
    p.add_argument("--v2", action="store_true", help="the model is SD2.x (checked against the weights)")
    p.add_argument("--unet_use_linear_projection", action="store_true",
                   help="diffusers output: the U-Net's transformer projections as Linear layers "
                        "(use_linear_projection=true, stabilityai's SD2 form); SD2/SDXL models have them already")
    p.add_argument("--fp16", action="store_true", help="save in float16")
    p.add_argument("--bf16", action="store_true", help="save in bfloat16")
    p.add_argument("--float", action="store_true", help="save in float32")
    p.add_argument("--save_precision_as", default="no", choices=["no", "fp16", "bf16", "float"],
                   help="save precision (not with --fp16/--bf16/--float); default: as loaded")
    p.add_argument("--epoch", type=int, default=0, help="epoch written into the single file")
    p.add_argument("--global_step", type=int, default=0, help="global_step written into the single file")
    p.add_argument("--metadata", default=None,
                   help="single-file output: metadata as a dict literal, e.g. '{\"name\": \"model\"}'")
    p.add_argument("--reference_model", default=None,
                   help="diffusers output: a local diffusers folder or hub id whose tokenizer(s) and scheduler "
                        "are copied (default: the loaded model's own)")
    p.add_argument("--use_safetensors", action="store_true",
                   help="accepted for sd-scripts' commands: diffusers folders are always written as safetensors")
    p.add_argument("--allow_pickle", action="store_true",
                   help="load a .ckpt that holds pickled objects besides tensors (can run code: trusted files only)")
    p.add_argument("model_to_load", help="single file, diffusers folder or built-in name")
    p.add_argument("model_to_save", help="single file (with an extension) or diffusers folder (without)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    log.setup_logging(True)
    # lazy: torch, diffusers and transformers (seconds) are imported once the flags are parsed, not for --help
    from library.models import sd_convert

    try:
        req = sd_convert.Request(
            args.model_to_load, args.model_to_save, v1=args.v1, v2=args.v2,
            unet_use_linear_projection=args.unet_use_linear_projection,
            dtype=sd_convert.save_dtype(args.fp16, args.bf16, args.float, args.save_precision_as),
            epoch=args.epoch, global_step=args.global_step, reference_model=args.reference_model,
            metadata=sd_convert.parse_metadata(args.metadata), allow_pickle=args.allow_pickle)
        print(sd_convert.convert(req))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
