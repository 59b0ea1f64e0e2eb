"""FLUX.1 and SD3 full fine-tuning on two CPU processes (gloo), one launch for all of it.

One ``accelerate launch --multi_gpu --num_processes 2`` of this file's worker runs, in the same
job, seven 3-step fine-tunes of batch 1 per process (3 images, global batch 2: the second step of
each epoch has one sample, so rank 1 has an empty share and runs a zero-weight forward where the
strategy needs every process):

    sd3, flux   plain data parallelism (DDP); sd3 saves a state after step 2
    sd3_resumed sd3 resumed from that state on 2 processes
    sd3_fsdp    ``fsdp``: FSDP2, one unit per joint block, then the transformer; EMA (sharded)
    flux_fsdp   ``fsdp``: one unit per double- and single-stream block, then the transformer; EMA;
                gradient checkpointing (each block's recompute all-gathers it again)
    sd3_zero2   ``deepspeed`` ZeRO stage 2 (the run's own options on a plain launch)
    flux_zero2  likewise for FLUX.1

Each rank reports its world size, logs and (gathered) weights. The tests check: one gloo job of
world size 2; SD3 2 processes x batch 1 bit-identical to 1 process x batch 1 x accumulation 2 and
within the SD tests' bound (tests/distributed/test_multiprocess.py ISSUE_TOL: 1e-5 per tensor,
norms floored at 1e-4; SGD) of 1 process x batch 2; under fsdp every transformer parameter is a
DTensor sharded on dim 0, each rank holding half, and the weights, the saved file (SD3: one
file in SAI's layout, gathered from the shards) and the EMA file equal the one-process run's
within that bound; FLUX.1 on 2 processes (DDP) and ZeRO-2 likewise; the SD3 run resumed on 2
processes from its step-2 state ends bit-identical to it (one thread per process).

Launched as a script (``<report_dir> <out_dir> <data_dir>``) this file is the worker.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = {"sd3": "tiny-sd3", "flux": "tiny-flux"}
# name -> (family, strategy options)
EMA = ["--ema_decay", "0.5"]
RUNS = {"sd3": ("sd3", ["--save_every_n_steps", "2", "--save_state"]),
        "sd3_resumed": ("sd3", ["--resume", "{out}/sd3/last-step00000002-state"]),
        "flux": ("flux", []), "sd3_fsdp": ("sd3", ["--fsdp", *EMA]),
        "flux_fsdp": ("flux", ["--fsdp", *EMA, "--gradient_checkpointing"]),
        "sd3_zero2": ("sd3", ["--deepspeed", "--zero_stage", "2"]),
        "flux_zero2": ("flux", ["--deepspeed", "--zero_stage", "2"])}


def flow_args(family: str, data: str, out: str, *extra) -> list[str]:
    """3 SGD steps (2 per epoch) at 64 px; the learning rate moves most tensors by 1e-3 .. 1e-1
    of their norm."""
    return ["--pretrained_model_name_or_path", MODELS[family], "--train_data_dir", data,
            "--output_dir", out, "--resolution", "64", "--max_train_steps", "3", "--cache_latents",
            "--optimizer_type", "SGD", "--learning_rate", "0.5", "--seed", "7", *extra]


def _worker(report_dir: str, out_dir: str, data: str) -> int:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import runpy

    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    from library.outputs.train_state import named_trainable
    from tests.conftest import reset_accelerate
    from tests.training.test_equivalence import TrainingCapture

    for name, (family, extra) in RUNS.items():
        out = os.path.join(out_dir, name)
        extra = [a.replace("{out}", out_dir) for a in extra]
        sys.argv = [os.path.join(ROOT, "finetune.py"),
                    *flow_args(family, data, out, "--train_batch_size", "1", *extra)]
        with TrainingCapture() as cap:
            try:
                runpy.run_path(sys.argv[0], run_name="__main__")
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
        if rc != 0 or cap.run is None:
            return rc or 1
        r = cap.run
        rank = dist.get_rank()
        weights, shards = {}, {}
        for n, p in named_trainable(r.parts.method, r.parts.bundle):
            sharded = isinstance(p, DTensor)
            shards[n] = {"placements": [repr(x) for x in p.placements] if sharded else None,
                         "local": p.to_local().numel() if sharded else p.numel(), "global": p.numel()}
            weights[n] = (p.full_tensor() if sharded else p).detach().cpu().contiguous()  # every rank
        report = {"rank": rank, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
                  "num_processes": r.parts.accelerator.num_processes, "strategy": r.parts.strategy.name,
                  "global_step": r.progress.global_step, "loss_log": r.progress.loss_log,
                  "lr_log": r.progress.lr_log, "micro_steps": cap.micro_steps, "shards": shards,
                  "checkpointing": bool(r.parts.bundle.unet.gradient_checkpointing)}
        save_file(weights, os.path.join(report_dir, f"{name}.rank{rank}.safetensors"))
        with open(os.path.join(report_dir, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(report, f)
        reset_accelerate()
    return 0


if __name__ == "__main__":
    sys.exit(_worker(*sys.argv[1:4]))


# -- the tests (imports below are for pytest only) -----------------------------------------------
import pytest  # noqa: E402
import torch  # noqa: E402

from tests.conftest import read, two_process_command  # noqa: E402
from tests.distributed.test_multiprocess import ISSUE_TOL, NORM_FLOOR  # noqa: E402
from tests.training.test_equivalence import max_rel_diff, train_in_process  # noqa: E402


def _weights(run) -> dict:
    from library.outputs.train_state import named_trainable

    return {n: p.detach().clone() for n, p in named_trainable(run.parts.method, run.parts.bundle)}


@pytest.fixture(scope="module")
def flow_job(tmp_path_factory):
    from tools.make_sample_dataset import make_sample_dataset

    data = str(tmp_path_factory.mktemp("flow_data"))
    make_sample_dataset(data, n_images=3, size=64, repeats=1)
    out, report = str(tmp_path_factory.mktemp("flow_out")), str(tmp_path_factory.mktemp("flow_report"))
    cmd, env = two_process_command(os.path.abspath(__file__), [report, out, data])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = {name: [json.load(open(os.path.join(report, f"{name}.rank{r}.json"))) for r in (0, 1)]
             for name in RUNS}
    rank_weights = {name: [read(os.path.join(report, f"{name}.rank{r}.safetensors"))[0] for r in (0, 1)]
                    for name in RUNS}
    refs = {}
    for name, family, split in (("sd3_bs2", "sd3", ["--train_batch_size", "2", *EMA]),
                                ("sd3_ga2", "sd3", ["--gradient_accumulation_steps", "2"]),
                                ("flux_bs2", "flux", ["--train_batch_size", "2", *EMA])):
        ref_out = str(tmp_path_factory.mktemp(name))
        ref = train_in_process(flow_args(family, data, ref_out, *split), script="finetune")
        refs[name] = {"run": ref["run"], "weights": _weights(ref["run"]), "out": ref_out}
    return {"ranks": ranks, "weights": rank_weights, "refs": refs, "out": out,
            "stderr": proc.stderr, "stdout": proc.stdout}


def _close(a: dict, b: dict, what: str):
    worst, key = max_rel_diff(a, b, floor=NORM_FLOOR)
    assert worst <= ISSUE_TOL, f"{what}: {key}: {worst:.2e}"
    print(f"{what}: worst {worst:.2e} ({key})")


def _moved(family: str, w: dict) -> int:
    """How many tensors the run moved from the initial weights."""
    if family == "flux":
        from library.models.families.flux.tiny_flux import build_tiny_flux

        start = build_tiny_flux("dev")["transformer"].state_dict()
    else:
        from library.models.families.sd3 import sd3_builtins

        start = sd3_builtins.build_builtin("tiny-sd3")["mmdit"].state_dict()
    return sum(not torch.equal(start[k.removeprefix("unet.")], v) for k, v in w.items())


def test_one_gloo_job_of_two_processes(flow_job):
    for name, ranks in flow_job["ranks"].items():
        assert [(r["rank"], r["world_size"], r["num_processes"], r["backend"]) for r in ranks] == \
            [(0, 2, 2, "gloo"), (1, 2, 2, "gloo")], name
        assert ranks[0]["global_step"] == ranks[1]["global_step"] == 3, name
        w0, w1 = flow_job["weights"][name]
        assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0), name
    # an empty share for rank 1 in the one-sample step of each epoch
    steps = {s for s, _, _ in flow_job["ranks"]["sd3"][0]["micro_steps"]}
    assert steps == {0, 1, 2}
    # one FSDP unit per transformer block, and the transformer
    from library.models.families.sd3 import sd3_builtins
    from library.models.families.flux.tiny_flux import build_tiny_flux

    flux = build_tiny_flux("dev")["transformer"]
    units = {len(sd3_builtins.build_builtin("tiny-sd3")["mmdit"].joint_blocks) + 1,
             len(flux.double_blocks) + len(flux.single_blocks) + 1}
    for n in units:
        assert f"fsdp: unet sharded across 2 processes ({n} FSDP units" in flow_job["stderr"], n
    assert "ZeRO stage 2 over 2 process(es)" in flow_job["stderr"]


def test_sd3_two_processes_equal_accumulation_and_batch_2(flow_job):
    refs = flow_job["refs"]
    ddp = flow_job["weights"]["sd3"][0]
    bs2, ga2 = refs["sd3_bs2"]["weights"], refs["sd3_ga2"]["weights"]
    assert ddp.keys() == ga2.keys() == bs2.keys()
    assert all(torch.equal(ddp[k], ga2[k]) for k in ddp)  # the same batch-1 forwards, g0 + g1
    _close(ddp, bs2, "2 x 1 against 1 x 2")
    assert _moved("sd3", bs2) > len(bs2) // 2
    ranks = flow_job["ranks"]["sd3"]
    for ref in (refs["sd3_bs2"]["run"], refs["sd3_ga2"]["run"]):
        assert ranks[0]["lr_log"] == ref.progress.lr_log
        assert ranks[0]["loss_log"] == pytest.approx(ref.progress.loss_log, rel=1e-5)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_fsdp_shards_each_block_and_trains_as_one_process(flow_job, family):
    name, ref = f"{family}_fsdp", flow_job["refs"][f"{family}_bs2"]
    r0, r1 = (r["shards"] for r in flow_job["ranks"][name])
    total = sum(p["global"] for p in r0.values())
    for n, p in r0.items():
        assert p["placements"] == r1[n]["placements"] == ["Shard(dim=0)"], n
        assert p["local"] + r1[n]["local"] == p["global"], n
    assert 0.45 * total <= sum(p["local"] for p in r0.values()) <= 0.55 * total
    assert flow_job["ranks"][name][0]["checkpointing"] == (family == "flux")
    w = flow_job["weights"][name][0]
    _close(w, ref["weights"], f"{name} against 1 x 2")
    assert flow_job["ranks"][name][0]["loss_log"] == pytest.approx(ref["run"].progress.loss_log, rel=1e-5)
    assert _moved(family, w) > len(w) // 2
    # the saved file: gathered from the shards, in the family's layout, equal to the weights
    path = os.path.join(flow_job["out"], name, "last.safetensors")
    if family == "flux":
        saved = read(path)[0]
    else:
        from library.models.families.sd3 import sd3_checkpoint

        saved = dict(sd3_checkpoint.load_sd3(path).mmdit.named_parameters())
    assert {f"unet.{k}" for k in saved} == set(w)
    assert all(torch.equal(saved[k], w[f"unet.{k}"]) for k in saved)
    # the EMA (sharded beside the weights), gathered into its file, as the one-process run's
    ema, ref_ema = (read(os.path.join(d, "last-ema.safetensors"))[0]
                    for d in (os.path.join(flow_job["out"], name), ref["out"]))
    _close(ema, ref_ema, f"{name} EMA against 1 x 2")
    end = read(path)[0]
    assert any(not torch.equal(ema[k], end[k]) for k in end)  # the EMA is not the weights


def test_sd3_resumed_on_two_processes_is_bit_identical(flow_job):
    ranks = flow_job["ranks"]
    assert ranks["sd3_resumed"][0]["lr_log"] == ranks["sd3"][0]["lr_log"]
    assert ranks["sd3_resumed"][0]["loss_log"] == ranks["sd3"][0]["loss_log"]
    assert min(s for s, _, _ in ranks["sd3_resumed"][0]["micro_steps"]) == 2  # it resumed
    a, b = flow_job["weights"]["sd3_resumed"][0], flow_job["weights"]["sd3"][0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x, y = (read(os.path.join(flow_job["out"], n, "last.safetensors"))[0] for n in ("sd3", "sd3_resumed"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_flux_two_processes_equal_batch_2(flow_job):
    w = flow_job["weights"]["flux"][0]
    _close(w, flow_job["refs"]["flux_bs2"]["weights"], "flux 2 x 1 against 1 x 2")
    assert _moved("flux", w) > len(w) // 2


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_deepspeed_zero2_trains_as_one_process(flow_job, family):
    w = flow_job["weights"][f"{family}_zero2"][0]
    _close(w, flow_job["refs"][f"{family}_bs2"]["weights"], f"{family} ZeRO-2 against 1 x 2")
    assert _moved(family, w) > len(w) // 2
