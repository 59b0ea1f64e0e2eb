#!/usr/bin/env python
"""sd-scripts' sdxl_train_network.py: a LoRA (or another network module) on an SDXL model, with sd-
scripts' flags. It is train_lora.py, refusing a model of another family in one line
(docs/KOHYA_GUI.md, "sd-scripts' script names").

Usage: accelerate launch sdxl_train_network.py --config_file run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("train_lora", entry="sdxl_train_network.py"))
