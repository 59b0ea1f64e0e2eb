#!/usr/bin/env python
"""Generate images with SD1/SD2/SDXL/FLUX.1/SD3 models, LoRAs and embeddings: sd-scripts' gen_img.py
flags and prompt-line options, A1111's PNG parameters text; docs/GENERATION.md.

Usage: python gen_img.py --ckpt MODEL --outdir OUT --prompt "a cat --n blurry --d 1" [--options]
"""
import sys

from library.log import setup_logging

setup_logging(True)  # before diffusers loads bitsandbytes, whose optional-kernel notice it silences

from library.outputs import gen_options, generation  # noqa: E402


def main(argv=None) -> int:
    return gen_options.run_main(lambda a: generation.generate(gen_options.parse_args(a)), argv)


if __name__ == "__main__":
    sys.exit(main())
