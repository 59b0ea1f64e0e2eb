#!/usr/bin/env python
"""sd-scripts' anima_train.py: full fine-tuning of an Anima DiT with its LLM adapter (Qwen3 and the
VAE stay frozen), at sd-scripts' per-part learning rates (llm_adapter_lr, self_attn_lr,
cross_attn_lr, mlp_lr, mod_lr; 0 freezes a part), saved in the released layout. Images with
captions from a metadata file (in_json, or a dataset subset's metadata_file) train as finetune.py, image folders as
train_dreambooth.py (sd-scripts' anima_train.py takes both kinds of dataset); a model of another
family is refused in one line.

Usage: accelerate launch anima_train.py --config run.toml [--option value ...]; see --help.
"""
import sys

from library.cli import full_training_script, main

if __name__ == "__main__":
    sys.exit(main(full_training_script(), entry="anima_train.py"))
