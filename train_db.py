#!/usr/bin/env python
"""sd-scripts' train_db.py: DreamBooth on an SD1.x / SD2.x model (instance and class image folders). It
is train_dreambooth.py, refusing a model of another family in one line (docs/KOHYA_GUI.md, "sd-
scripts' script names").

Usage: accelerate launch train_db.py --config_file run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("train_dreambooth", entry="train_db.py"))
