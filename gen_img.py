#!/usr/bin/env python
"""Generate images with SD1/SD2/SDXL/FLUX.1/SD3 models, LoRAs and embeddings: sd-scripts' gen_img.py
flags and prompt-line options, A1111's PNG parameters text; docs/GENERATION.md.

Usage: python gen_img.py --ckpt MODEL --outdir OUT --prompt "a cat --n blurry --d 1" [--options]
"""
import logging
import sys

from library.log import setup_logging

setup_logging(True)  # before diffusers loads bitsandbytes, whose optional-kernel notice it silences

from library.errors import UserError  # noqa: E402
from library.outputs import gen_options, generation  # noqa: E402


def main(argv=None) -> int:
    try:
        generation.generate(gen_options.parse_args(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    logging.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
