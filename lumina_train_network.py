#!/usr/bin/env python
"""sd-scripts' lumina_train_network.py: a LoRA (networks.lora_lumina by default) on a Lumina Image
2.0 model, with sd-scripts' flags (--gemma2, --ae, --system_prompt, --timestep_sampling, ...). It is
train_lora.py, refusing a model of another family in one line (docs/MODELS.md, docs/KOHYA_GUI.md).

Usage: accelerate launch lumina_train_network.py --config run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("train_lora", entry="lumina_train_network.py"))
