"""Merge kohya LoRA files into an SDXL model, or into one SDXL LoRA file (sd-scripts'
networks/sdxl_merge_lora.py and its flags).

    python networks/sdxl_merge_lora.py --sd_model sd_xl_base_1.0.safetensors --models a.safetensors \\
        b.safetensors --ratios 1.0 0.5 [--lbws '[...]' '[...]'] --save_to merged.safetensors \\
        [--precision float] [--save_precision fp16] [--no_metadata]
    python networks/sdxl_merge_lora.py --models a.safetensors b.safetensors --ratios 1.0 0.5 \\
        --save_to merged_lora.safetensors [--concat [--shuffle]] [--lbws ...]

The same code as networks/merge_lora.py (its docstring says what each mode computes), refusing
a model or LoRA file of another family by name.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from networks import merge_lora  # noqa: E402


def main(argv=None) -> int:
    return merge_lora.main(argv, only_sdxl=True)


if __name__ == "__main__":
    sys.exit(main())
