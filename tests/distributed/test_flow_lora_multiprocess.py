"""A FLUX.1 LoRA (transformer and CLIP-L), an SD3 LoRA (transformer, CLIP-L and CLIP-G), a Chroma
LoRA (transformer), an Anima LoRA (the DiT) and a Lumina 2 LoRA (transformer and Gemma-2), each
trained as 2 processes x batch 1 (one gloo launch of this file's worker, which runs both through
tests/distributed/test_multiprocess.py's worker, one after the other in the same job), 1 process x
batch 1 x accumulation 2 and 1 process x batch 2, in this process: the same plan, samples and
learning rates; 2 x 1 is bit-identical to accumulation 2 (the same batch-1 forwards, and g0 + g1
is the same float sum whether gloo or the accumulation adds it); batch 2 is within the issue's
1e-5 per tensor (SGD, docs/DESIGN's bound; measured 9.6e-7 for FLUX.1, 1.1e-6 for SD3). The
two-bucket data of tests/training/test_equivalence.py (128 px square and 192 x 64 wide, partial
global batches), max_grad_norm engaged, 5 steps over 2 epochs.

Launched as a script (``<report_dir> <out_dir> <data_dir>``) this file is the worker: the runs'
reports go to ``<report_dir>/<family>/rank<N>.json`` (and ``.safetensors``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# family -> (model, sd-scripts' LoRA module)
FAMILIES = {"flux": ("tiny-flux", "networks.lora_flux"), "sd3": ("tiny-sd3", "networks.lora_sd3"),
            "chroma": ("tiny-chroma", "networks.lora_flux"), "anima": ("tiny-anima", "networks.lora_anima"),
            "lumina": ("tiny-lumina", "networks.lora_lumina")}


def flow_lora_args(family: str, data: str, out: str, *extra) -> list[str]:
    """test_equivalence's LoRA run (SGD with Nesterov momentum, cosine with warmup, buckets,
    max_grad_norm 0.02) on the tiny FLUX.1 dev or SD3 medium with sd-scripts' LoRA module."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests.training.test_equivalence import train_args

    model, module = FAMILIES[family]
    args = train_args(data, out, "--network_module", module, "--max_grad_norm", "0.02",
                      "--max_train_steps", "5", *extra)
    args[args.index("tiny-sd15")] = model
    return args


def _worker(report_dir: str, out_dir: str, data: str) -> int:
    """Both families' 2-process runs in one job: test_multiprocess's worker for each, the
    accelerate state reset between them."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests.conftest import reset_accelerate
    from tests.distributed.test_multiprocess import _worker as run_and_report

    for family in FAMILIES:
        report = os.path.join(report_dir, family)
        os.makedirs(report, exist_ok=True)
        rc = run_and_report(report, "train_lora",
                            flow_lora_args(family, data, os.path.join(out_dir, family), "--train_batch_size", "1"))
        if rc:
            return rc
        reset_accelerate()
    return 0


if __name__ == "__main__":
    sys.exit(_worker(*sys.argv[1:4]))


# -- the tests (imports below are for pytest only) -----------------------------------------------
import pytest  # noqa: E402
import torch  # noqa: E402

from tests.conftest import two_process_command  # noqa: E402
from tests.distributed.test_multiprocess import ISSUE_TOL, NORM_FLOOR, trained_micro_steps  # noqa: E402
from tests.training.test_equivalence import (PLAN_KEYS, make_two_bucket_dataset, max_rel_diff,  # noqa: E402
                                             plan_values, read_file, train_in_process)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The one 2-process launch of both families' runs."""
    data = make_two_bucket_dataset(str(tmp_path_factory.mktemp("flow_buckets")))
    out, report = str(tmp_path_factory.mktemp("flow_two")), str(tmp_path_factory.mktemp("flow_report"))
    cmd, env = two_process_command(os.path.abspath(__file__), [report, out, data])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {"data": data, "out": out, "report": report, "stdout": proc.stdout}


def family_runs(launch, family, tmp_path_factory):
    report, out = os.path.join(launch["report"], family), os.path.join(launch["out"], family)
    ranks = [json.load(open(os.path.join(report, f"rank{r}.json"))) for r in (0, 1)]
    refs = {name: train_in_process(flow_lora_args(family, launch["data"], str(tmp_path_factory.mktemp(name)),
                                                  *split))
            for name, split in (("bs2", ["--train_batch_size", "2"]),
                                ("acc2", ["--train_batch_size", "1", "--gradient_accumulation_steps", "2"]))}
    plans = launch["stdout"].split("step plan:")[1:]  # the launch's output: one plan per run, in order
    assert len(plans) == len(FAMILIES)
    return {"stdout": "step plan:" + plans[list(FAMILIES).index(family)], "ranks": ranks, "refs": refs,
            "tensors": read_file(os.path.join(out, "last.safetensors"))[0],
            "rank_weights": [read_file(os.path.join(report, f"rank{r}.safetensors"))[0] for r in (0, 1)]}


@pytest.mark.parametrize("family, te_prefix, block_prefix", [
    ("flux", "lora_te1_", "lora_unet_single_"), ("sd3", "lora_te2_", "lora_unet_joint_"),
    ("chroma", None, "lora_unet_single_"),  # Chroma: T5 alone, no text-encoder LoRA
    ("anima", "lora_unet_blocks_0_", "lora_unet_blocks_1_"),  # Anima: no text-encoder LoRA
    ("lumina", "lora_te_", "lora_unet_layers_")])
def test_flow_lora_1x2_2x1_and_accumulation_2_train_the_same(launch, tmp_path_factory, family, te_prefix,
                                                               block_prefix):
    runs = family_runs(launch, family, tmp_path_factory)
    ranks, refs = runs["ranks"], runs["refs"]
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]
    assert [r["num_processes"] for r in ranks] == [2, 2]
    plan = plan_values(runs["stdout"])
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

    w0, w1 = runs["rank_weights"]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # both ranks took the same steps
    two, acc2, bs2 = runs["tensors"], refs["acc2"]["tensors"], refs["bs2"]["tensors"]
    assert (te_prefix is None or any(k.startswith(te_prefix) for k in two)) and any(k.startswith(block_prefix)
                                                                                  for k in two)
    assert two.keys() == acc2.keys() and [k for k in two if not torch.equal(two[k], acc2[k])] == []
    worst, key = max_rel_diff(two, bs2, floor=NORM_FLOOR)
    assert worst <= ISSUE_TOL, f"{key}: {worst:.2e}"
    # Lumina 2 reads Gemma-2's penultimate states: a LoRA on its last layer (tiny: layer 2) gets no
    # gradient (sd-scripts' lora_lumina puts one there too)
    unused = {"lumina": "lora_te_layers_2_"}.get(family, "\0")
    ups = [k for k in bs2 if k.endswith("lora_up.weight") and not k.startswith(unused)]
    assert all(float(bs2[k].abs().max()) > 0 for k in ups)  # the comparison is not of zeros
