#!/usr/bin/env python
"""DreamBooth: train the U-Net (and optionally the text encoders) on instance and class images.

Usage: accelerate launch train_dreambooth.py --config run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("train_dreambooth"))
