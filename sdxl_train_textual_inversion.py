#!/usr/bin/env python
"""sd-scripts' sdxl_train_textual_inversion.py: textual inversion on an SDXL model (one embedding per
text encoder, saved as clip_l / clip_g). It is train_textual_inversion.py, refusing a model of
another family in one line (docs/KOHYA_GUI.md, "sd-scripts' script names").

Usage: accelerate launch sdxl_train_textual_inversion.py --config_file run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("train_textual_inversion", entry="sdxl_train_textual_inversion.py"))
