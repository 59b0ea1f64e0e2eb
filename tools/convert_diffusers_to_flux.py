"""Write a diffusers FLUX.1 transformer as one BFL-layout file (sd-scripts' tools/convert_diffusers_to_flux.py).

    python tools/convert_diffusers_to_flux.py --diffusers_path FLUX.1-dev/ --save_to flux1-dev.safetensors \\
        [--save_precision bf16] [--mem_eff_load_save]

--diffusers_path: a diffusers FLUX folder, its transformer/ folder, or the first of the
transformer's shards (``diffusion_pytorch_model-00001-of-00003.safetensors``). The output is what
``flux1-dev.safetensors`` is (no ``model.diffusion_model.`` prefix), loadable as
``pretrained_model_name_or_path`` and in ComfyUI / Forge / diffusers' single-file loader. The
conversion is library/models/families/flux/flux_convert.py (the model loader's map and writer).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.errors import UserError  # noqa: E402
from library.models import fp8_storage  # noqa: E402
from library.models.families.flux import flux_convert  # noqa: E402


def _parse_args(argv):
    p = argparse.ArgumentParser(description="Convert a diffusers FLUX.1 transformer to one BFL-layout file.")
    p.add_argument("--diffusers_path", required=True,
                   help="diffusers FLUX folder, its transformer/ folder, or *-00001-of-0000N.safetensors")
    p.add_argument("--save_to", required=True, help="the BFL-layout .safetensors file to write")
    p.add_argument("--mem_eff_load_save", action="store_true",
                   help="accepted for sd-scripts' commands: the file is always written one tensor at a time")
    p.add_argument("--save_precision", default=None,
                   help=f"dtype of the output: {', '.join(fp8_storage.SAVE_PRECISIONS)} (default: as stored)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    try:
        weights = flux_convert.diffusers_to_bfl_file(args.diffusers_path, args.save_to,
                                                     fp8_storage.save_dtype(args.save_precision))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = weights.config
    print(f"saved {args.save_to}: FLUX.1 {weights.variant}, {cfg.depth} double and {cfg.depth_single_blocks} "
          f"single blocks, width {cfg.hidden_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
