"""A FLUX.1 LoRA (transformer and CLIP-L) trained as 2 processes x batch 1 (one gloo launch of
tests/distributed/test_multiprocess.py's worker), 1 process x batch 1 x accumulation 2 and
1 process x batch 2, in this process: the same plan, samples and learning rates; 2 x 1 is
bit-identical to accumulation 2 (the same batch-1 forwards, and g0 + g1 is the same float sum
whether gloo or the accumulation adds it); batch 2 is within the issue's 1e-5 per tensor (SGD,
docs/DESIGN's bound; measured 9.6e-7). The two-bucket data of tests/training/test_equivalence.py (128 px square and
192 x 64 wide, partial global batches), max_grad_norm engaged, 5 steps over 2 epochs."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed.test_multiprocess import ISSUE_TOL, NORM_FLOOR, launch_two_processes, trained_micro_steps
from tests.training.test_equivalence import (PLAN_KEYS, make_two_bucket_dataset, max_rel_diff, plan_values,
                                             read_file, train_args, train_in_process)


def flux_lora_args(data: str, out: str, *extra) -> list[str]:
    """test_equivalence's LoRA run (SGD with Nesterov momentum, cosine with warmup, buckets,
    max_grad_norm 0.02) on the tiny FLUX.1 dev with sd-scripts' FLUX LoRA module."""
    args = train_args(data, out, "--network_module", "networks.lora_flux", "--max_grad_norm", "0.02",
                      "--max_train_steps", "5", *extra)
    args[args.index("tiny-sd15")] = "tiny-flux"
    return args


@pytest.fixture(scope="module")
def flux_runs(tmp_path_factory):
    data = make_two_bucket_dataset(str(tmp_path_factory.mktemp("flux_buckets")))
    out, report = str(tmp_path_factory.mktemp("flux_two")), str(tmp_path_factory.mktemp("flux_report"))
    proc = launch_two_processes(report, flux_lora_args(data, out, "--train_batch_size", "1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.load(open(os.path.join(report, f"rank{r}.json"))) for r in (0, 1)]
    refs = {name: train_in_process(flux_lora_args(data, str(tmp_path_factory.mktemp(name)), *split))
            for name, split in (("bs2", ["--train_batch_size", "2"]),
                                ("acc2", ["--train_batch_size", "1", "--gradient_accumulation_steps", "2"]))}
    return {"stdout": proc.stdout, "ranks": ranks, "refs": refs,
            "tensors": read_file(os.path.join(out, "last.safetensors"))[0],
            "rank_weights": [read_file(os.path.join(report, f"rank{r}.safetensors"))[0] for r in (0, 1)]}


def test_flux_lora_1x2_2x1_and_accumulation_2_train_the_same(flux_runs):
    ranks, refs = flux_runs["ranks"], flux_runs["refs"]
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]
    plan = plan_values(flux_runs["stdout"])
    assert (plan["processes"], plan["global_batch"], plan["total_steps"], plan["epochs"]) == ("2", "2", "5", "2")
    for ref in refs.values():
        assert {k: plan[k] for k in PLAN_KEYS} == {k: plan_values(ref["stdout"])[k] for k in PLAN_KEYS}
    lrs = refs["bs2"]["run"].progress.lr_log
    assert ranks[0]["lr_log"] == ranks[1]["lr_log"] == lrs == refs["acc2"]["run"].progress.lr_log
    assert ranks[0]["loss_log"] == ranks[1]["loss_log"] == refs["acc2"]["run"].progress.loss_log
    assert ranks[0]["loss_log"] == pytest.approx(refs["bs2"]["run"].progress.loss_log, rel=1e-5)
    steps: dict = {}  # the same samples in every step, split between the ranks
    for micro_steps in trained_micro_steps(ranks):
        for step, epoch, idx in micro_steps:
            steps.setdefault(step, [epoch, []])[1].extend(idx)
    split = [(e, tuple(sorted(i))) for _, (e, i) in sorted(steps.items())]
    assert split == refs["bs2"]["capture"].samples_per_step() == refs["acc2"]["capture"].samples_per_step()

    w0, w1 = flux_runs["rank_weights"]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # both ranks took the same steps
    two, acc2, bs2 = flux_runs["tensors"], refs["acc2"]["tensors"], refs["bs2"]["tensors"]
    assert any(k.startswith("lora_te1_") for k in two) and any(k.startswith("lora_unet_single_") for k in two)
    assert two.keys() == acc2.keys() and [k for k in two if not torch.equal(two[k], acc2[k])] == []
    worst, key = max_rel_diff(two, bs2, floor=NORM_FLOOR)
    assert worst <= ISSUE_TOL, f"{key}: {worst:.2e}"
    ups = [k for k in bs2 if k.endswith("lora_up.weight")]
    assert all(float(bs2[k].abs().max()) > 0 for k in ups)  # the comparison is not of zeros
