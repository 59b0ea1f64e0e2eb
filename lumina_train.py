#!/usr/bin/env python
"""sd-scripts' lumina_train.py: full fine-tuning of a Lumina Image 2.0 transformer (Gemma-2 and the
autoencoder stay frozen), saved in the layout it was loaded from. Images with captions from a
metadata file (--in_json) train as finetune.py, image folders as train_dreambooth.py (sd-scripts'
lumina_train.py takes both kinds of dataset).

Usage: accelerate launch lumina_train.py --config run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("finetune" if any(a.split("=")[0] == "--in_json" for a in sys.argv[1:]) else "train_dreambooth"))
