#!/usr/bin/env python
"""sd-scripts' anima_train_network.py: a LoRA (networks.lora_anima by default) on an Anima model,
with sd-scripts' flags (--qwen3, --vae, --llm_adapter_path, --timestep_sampling, --attn_mode, ...).
It is train_lora.py, which picks the family from the model (docs/MODELS.md).

Usage: accelerate launch anima_train_network.py --config run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import main

if __name__ == "__main__":
    sys.exit(main("train_lora", entry="anima_train_network.py"))
