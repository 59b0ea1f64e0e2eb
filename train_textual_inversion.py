#!/usr/bin/env python
"""Textual inversion: learn the embedding of a new token (SD1.x, SD2.x, SDXL), everything else frozen.

Usage: accelerate launch train_textual_inversion.py --config run.toml [--option value ...]; see --help
and docs/TEXTUAL_INVERSION.md.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("train_textual_inversion"))
