#!/usr/bin/env python
"""Fine-tuning: train the U-Net (and optionally the text encoders) on images listed with their
captions in a metadata file (``in_json`` with ``train_data_dir``, or a dataset config subset's
``metadata_file``), as sd-scripts' fine_tune.py / sdxl_train.py.

Usage: accelerate launch finetune.py --config run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("finetune"))
