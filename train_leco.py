#!/usr/bin/env python
"""Train a LECO LoRA (concept erasing or a slider) from prompts only, on SD1.x, SD2.x or SDXL.

Usage: python train_leco.py --config run.toml [--option value ...]; see --help.
The prompt file format is sd-scripts' (docs/NETWORK_OPTIONS.md, "LECO").
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("train_leco"))
