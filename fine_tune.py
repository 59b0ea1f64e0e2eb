#!/usr/bin/env python
"""sd-scripts' fine_tune.py: fine-tuning of an SD1.x / SD2.x model on images listed with their captions
in a metadata file (in_json). It is finetune.py, refusing a model of another family in one line
(docs/KOHYA_GUI.md, "sd-scripts' script names").

Usage: accelerate launch fine_tune.py --config_file run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("finetune", entry="fine_tune.py"))
