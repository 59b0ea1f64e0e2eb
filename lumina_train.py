#!/usr/bin/env python
"""sd-scripts' lumina_train.py: full fine-tuning of a Lumina Image 2.0 transformer (Gemma-2 and the
autoencoder stay frozen), saved in the layout it was loaded from. Images with captions from a
metadata file (in_json, or a dataset subset's metadata_file) train as finetune.py, image folders as
train_dreambooth.py (sd-scripts' lumina_train.py takes both kinds of dataset); a model of another
family is refused in one line.

Usage: accelerate launch lumina_train.py --config run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import full_training_script, main

if __name__ == "__main__":
    sys.exit(main(full_training_script(), entry="lumina_train.py"))
