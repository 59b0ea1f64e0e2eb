#!/usr/bin/env python
"""sd-scripts' sd3_train_network.py: a LoRA (or another network module) on an SD3 model
(networks.lora_sd3 by default), with sd-scripts' flags (--clip_l, --clip_g, --t5xxl, ...). It is
train_lora.py, refusing a model of another family in one line (docs/KOHYA_GUI.md, "sd-scripts'
script names").

Usage: accelerate launch sd3_train_network.py --config_file run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("train_lora", entry="sd3_train_network.py"))
