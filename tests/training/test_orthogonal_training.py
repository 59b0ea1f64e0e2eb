"""networks.oft_v2 and networks.boft trained by train_lora.py on tiny models: sd-scripts' file
layout and metadata, and resuming exactly (4 steps == 2 + resume + 2, bit for bit, one thread),
with the options that draw random numbers (dropout) or change the weights in the forward (COFT).
Latents are not cached: the images load through the run's DataLoader, whose iterators must not
draw from the global generator that dropout draws from (library/data/training_data.py)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

CASES = {
    "oft_v2": ("tiny-sd15", ["oft_block_size=4", "coft=true", "coft_eps=1e-3", "dropout_probability=0.2",
                             "enable_conv=true"], "oft_R.weight"),
    "boft": ("tiny-sdxl", ["boft_block_size=2", "boft_n_butterfly_factor=2", "boft_dropout=0.25"], "boft_R"),
}


@pytest.mark.parametrize("kind", ["oft_v2", "boft"])
def test_trains_and_resumes_bit_for_bit(kind, dataset, tmp_path, run_script):
    model, args, part = CASES[kind]
    common = ["--pretrained_model_name_or_path", model, "--train_data_dir", dataset, "--resolution", "64",
              "--network_module", f"networks.{kind}", "--network_dim", "8", "--network_args", *args,
              "--learning_rate", "1e-2", "--seed", "3"]
    rc, _, err = run_script("train_lora", common + ["--output_dir", tmp_path / "a", "--max_train_steps", "4"])
    assert rc == 0, err[-2000:]
    assert run_script("train_lora", common + ["--output_dir", tmp_path / "b", "--max_train_steps", "2",
                                              "--save_state"])[0] == 0
    rc, _, err = run_script("train_lora", common + ["--output_dir", tmp_path / "b", "--max_train_steps", "4",
                                                    "--resume", tmp_path / "b" / "last-state"])
    assert rc == 0, err[-2000:]
    a, b = load_file(str(tmp_path / "a" / "last.safetensors")), load_file(str(tmp_path / "b" / "last.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert all(k.partition(".")[2] in ("oft_R.weight", "boft_R", "boft_s") for k in a)
    assert any(v.abs().sum() > 0 for k, v in a.items() if k.endswith(part))  # it trained
    assert any(k.startswith(("lora_te_", "lora_te1_")) for k in a)  # text encoders too, as sd-scripts
    with safe_open(str(tmp_path / "a" / "last.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_module"] == f"networks.{kind}"
    assert json.loads(meta["ss_network_args"]) == dict(a.split("=", 1) for a in args)
