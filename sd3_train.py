#!/usr/bin/env python
"""sd-scripts' sd3_train.py: full training of an SD3 transformer. Images with captions from a metadata
file (in_json, or a dataset subset's metadata_file) train as finetune.py, image folders as
train_dreambooth.py (sd-scripts' sd3_train.py takes both kinds of dataset); a model of another
family is refused in one line (docs/KOHYA_GUI.md, "sd-scripts' script names").

Usage: accelerate launch sd3_train.py --config_file run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import full_training_script, main

if __name__ == "__main__":
    sys.exit(main(full_training_script(), entry="sd3_train.py"))
