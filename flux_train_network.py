#!/usr/bin/env python
"""sd-scripts' flux_train_network.py: a LoRA (or another network module) on a FLUX.1 or Chroma model
(networks.lora_flux by default), with sd-scripts' flags (--ae, --clip_l, --t5xxl, --model_type
chroma, ...). It is train_lora.py, refusing a model of another family in one line
(docs/KOHYA_GUI.md, "sd-scripts' script names").

Usage: accelerate launch flux_train_network.py --config_file run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("train_lora", entry="flux_train_network.py"))
