#!/usr/bin/env python
"""sd-scripts' train_network.py: a LoRA (or another network module) on an SD1.x / SD2.x model, with sd-
scripts' flags. It is train_lora.py, refusing a model of another family in one line
(docs/KOHYA_GUI.md, "sd-scripts' script names").

Usage: accelerate launch train_network.py --config_file run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("train_lora", entry="train_network.py"))
