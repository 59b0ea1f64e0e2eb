"""Merge an SD3 / SD3.5 transformer with VAE, CLIP-L, CLIP-G and T5-XXL files into one all-in-one
file (sd-scripts' tools/merge_sd3_safetensors.py and its flags).

    python tools/merge_sd3_safetensors.py --dit sd3.5_large.safetensors --vae ae.safetensors \\
        --clip_l clip_l.safetensors --clip_g clip_g.safetensors --t5xxl t5xxl_fp16.safetensors \\
        --output sd3.5_large_all_in_one.safetensors [--save_precision bf16]

The keys, checks and write: library/models/families/sd3/sd3_merge.py. The output loads as
``pretrained_model_name_or_path`` without the separate files, and in ComfyUI, Forge and diffusers'
single-file loaders.
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
from library.models import fp8_storage  # noqa: E402


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Merge SD3 / SD3.5 component files into one all-in-one file.")
    p.add_argument("--dit", required=True, help="the SD3 transformer (MMDiT) .safetensors file")
    p.add_argument("--vae", help="the VAE (original layout); may be left out when --dit holds one")
    p.add_argument("--clip_l", help="CLIP-L (transformers layout)")
    p.add_argument("--clip_g", help="CLIP-G (transformers layout)")
    p.add_argument("--t5xxl", help="T5-XXL (transformers layout)")
    p.add_argument("--output", default="merged_model.safetensors",
                   help="the all-in-one file to write (default merged_model.safetensors)")
    p.add_argument("--device", default="cpu",
                   help="accepted for sd-scripts' commands: tensors are only copied, on the CPU")
    p.add_argument("--save_precision", default=None,
                   help=f"dtype of the output: {', '.join(fp8_storage.SAVE_PRECISIONS)} (default: as stored)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    log.setup_logging(True)  # before diffusers imports bitsandbytes, whose optional-kernel notice it quiets
    # lazy: diffusers and transformers (about 5 s) are imported once the options are parsed, not for --help
    from library.models.families.sd3 import sd3_merge

    files = {"dit": args.dit, "vae": args.vae, "clip_l": args.clip_l, "clip_g": args.clip_g, "t5xxl": args.t5xxl}
    try:
        n = sd3_merge.merge(files, args.output, fp8_storage.save_dtype(args.save_precision))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"saved {args.output}: {n} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
