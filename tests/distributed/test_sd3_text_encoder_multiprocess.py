"""An SD3 full fine-tune that trains CLIP-L, CLIP-G and T5-XXL (train_text_encoder, train_t5xxl,
their own rates) as 2 processes x batch 1 (one gloo launch of tests/distributed/
test_multiprocess.py's worker) against 1 process x batch 1 x accumulation 2 in this process: every
tensor of the saved file, the encoders' included, bit-identical (the same batch-1 forwards, and
g0 + g1 is the same float sum whether gloo or the accumulation adds it), and both ranks' weights
equal."""
from __future__ import annotations

import json
import os

import torch

from library.models.families.sd3 import sd3_builtins
from tests.distributed.test_multiprocess import launch_two_processes
from tests.training.test_equivalence import read_file, train_in_process


def sd3_args(data: str, out: str, *extra) -> list[str]:
    return ["--pretrained_model_name_or_path", "tiny-sd3", "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", "2", "--cache_latents", "--seed", "7",
            "--optimizer_type", "SGD", "--learning_rate", "0.05", "--train_text_encoder", "--train_t5xxl",
            "--learning_rate_te1", "0.1", "--learning_rate_te3", "0.02", *extra]


def test_sd3_text_encoders_2x1_equal_accumulation_2(dataset, tmp_path):
    report = str(tmp_path / "report")
    os.makedirs(report)
    proc = launch_two_processes(report, sd3_args(dataset, str(tmp_path / "two"), "--train_batch_size", "1"),
                                script="finetune")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.load(open(os.path.join(report, f"rank{r}.json"))) for r in (0, 1)]
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]
    acc = train_in_process(sd3_args(dataset, str(tmp_path / "acc"), "--train_batch_size", "1",
                                    "--gradient_accumulation_steps", "2"), script="finetune")
    two, acc2 = read_file(str(tmp_path / "two" / "last.safetensors"))[0], acc["tensors"]
    prefixes = ("text_encoders.clip_l.", "text_encoders.clip_g.", "text_encoders.t5xxl.", "model.diffusion_model.")
    assert all(any(k.startswith(p) for k in two) for p in prefixes)
    assert two.keys() == acc2.keys() and [k for k in two if not torch.equal(two[k], acc2[k])] == []
    w0, w1 = (read_file(os.path.join(report, f"rank{r}.safetensors"))[0] for r in (0, 1))
    assert any("encoder.block" in k for k in w0)  # T5 is among the trained parameters
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    t5_init = sd3_builtins.build_builtin("tiny-sd3")["t5xxl"].state_dict()
    key = "encoder.block.0.layer.0.SelfAttention.q.weight"
    assert not torch.equal(two["text_encoders.t5xxl.transformer." + key], t5_init[key])  # T5 trained
