#!/usr/bin/env python
"""Train a LoRA (or any network with the kohya interface) on SD1.x, SD2.x or SDXL.

Usage: accelerate launch train_lora.py --config run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("train_lora"))
