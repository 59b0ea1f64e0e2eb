"""Options for unit tests, built from the schema (library/config/options.py) like a real run's.

    opts = make_opts(optimizer_type="AdamW8bit", optimizer_args={"weight_decay": 0.01})

Every option a test does not name has its schema default; a named one is read as the same key
in a run file (typed, range- and choice-checked), and a name the script does not take is an
error, so a test cannot build options no run could have. The required options
(pretrained_model_name_or_path, training length...) are not required here: a unit test names
only what its unit reads. End-to-end tests use parse_args with an argv instead.
"""
from __future__ import annotations

from library.config.parse import Options, options_from_values


def make_opts(script: str = "train_lora", **overrides) -> Options:
    return options_from_values(script, overrides)
