"""Two CPU processes (gloo) train as one job: 2 processes x batch 1 == 1 process x batch 2.

One ``accelerate launch --multi_gpu --num_processes 2`` of ``train_lora`` (~10-20 s) checks at once:
the processes joined one gloo job of world size 2 with distinct ranks; the plan it prints says
``processes: 2`` and ``global_batch: 2`` and is what happened; each step's samples are split
between the ranks (never repeated), an odd bucket gives rank 1 an empty share of some steps and
nothing hangs; the learning rate and the logged loss of every step (the global mean) equal the
in-process one-process run's; both ranks end with identical weights and the saved LoRA equals the
one-process run's within float32 summation noise. ``max_grad_norm`` engages on every step, so
clipping of the summed gradient is covered too. The run stops mid-epoch (``max_train_steps 5``
with 3 steps per epoch).

This file is also the worker: launched as a script it runs train_lora.py under
``TrainingCapture`` and writes what each rank saw to ``<report_dir>/rank<N>.json``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(report_dir: str, argv: list[str]) -> int:
    """Runs the real entry script (train_lora.py) in this process and reports what happened."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import runpy

    import torch.distributed as dist
    from safetensors.torch import save_file

    from tests.test_equivalence import TrainingCapture

    sys.argv = [os.path.join(ROOT, "train_lora.py"), *argv]
    with TrainingCapture() as cap:
        fail = os.environ.get("SDTK_TEST_FAIL_AT")  # "rank:step": that rank raises at that step
        if fail and fail.split(":")[0] == os.environ.get("RANK"):
            _inject_failure(int(fail.split(":")[1]))
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    if rc != 0 or cap.run is None:
        return rc or 1
    r, acc = cap.run, cap.run.accelerator
    rank = dist.get_rank()
    report = {
        "pid": os.getpid(), "rank": rank, "world_size": dist.get_world_size(),
        "backend": dist.get_backend(), "num_processes": acc.num_processes,
        "process_index": acc.process_index, "distributed_type": str(acc.distributed_type),
        "global_step": r.global_step, "epoch": r.epoch, "scheduler_steps": r.scheduler.last_epoch,
        "loss_log": r.loss_log, "lr_log": r.lr_log, "micro_steps": cap.micro_steps,
    }
    weights = {k: v.detach().cpu().contiguous() for k, v in r.method.network.state_dict().items()}
    save_file(weights, os.path.join(report_dir, f"rank{rank}.safetensors"))
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    return 0


def _inject_failure(at_step: int):
    from library import trainer

    captured = trainer.Run.micro_step_loss  # restored by TrainingCapture on exit

    def micro_step_loss(run_self, epoch, idx, images, n_global):
        if run_self.global_step == at_step:
            raise RuntimeError(f"injected failure on rank {os.environ['RANK']} at step {at_step}")
        return captured(run_self, epoch, idx, images, n_global)

    trainer.Run.micro_step_loss = micro_step_loss


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2:]))


# -- the test (imports below are for pytest only) ------------------------------------------------
import pytest  # noqa: E402

from tests.conftest import free_port, two_process_command  # noqa: E402
from tests.test_equivalence import (CLIP, TOL, make_two_bucket_dataset, max_rel_diff,  # noqa: E402
                                    plan_values, read_file, train_args, train_in_process)


def launch_two_processes(report_dir: str, args: list[str], **env_extra):
    """``accelerate launch --multi_gpu --num_processes 2`` of this file's worker."""
    cmd, env = two_process_command(os.path.abspath(__file__), [report_dir, *args], **env_extra)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_two_bucket_dataset(str(tmp_path_factory.mktemp("twobuckets")))


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, data_dir):
    data = data_dir
    common = ["--max_train_steps", "5", "--max_grad_norm", CLIP]
    out = str(tmp_path_factory.mktemp("two_proc"))
    report = str(tmp_path_factory.mktemp("report"))
    proc = launch_two_processes(report, train_args(data, out, "--train_batch_size", "1", *common))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = []
    for r in (0, 1):
        with open(os.path.join(report, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    reference = train_in_process(train_args(data, str(tmp_path_factory.mktemp("one_proc")),
                                            "--train_batch_size", "2", *common))
    return {"stdout": proc.stdout, "ranks": ranks, "reference": reference,
            "tensors": read_file(os.path.join(out, "last.safetensors"))[0],
            "rank_weights": [read_file(os.path.join(report, f"rank{r}.safetensors"))[0]
                             for r in (0, 1)]}


def test_two_processes_are_one_gloo_job(two_process_run):
    ranks = two_process_run["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["process_index"] for r in ranks] == [0, 1]
    assert ranks[0]["pid"] != ranks[1]["pid"]
    for r in ranks:
        assert r["world_size"] == 2 and r["num_processes"] == 2
        assert r["backend"] == "gloo" and r["distributed_type"].endswith("MULTI_CPU")


def test_plan_of_two_processes_is_what_happened(two_process_run):
    stdout = two_process_run["stdout"]
    assert stdout.count("step plan:") == 1  # printed by the main process only
    plan = plan_values(stdout)
    ref = plan_values(two_process_run["reference"]["stdout"])
    assert plan["processes"] == "2" and ref["processes"] == "1"
    assert plan["train_batch_size"] == "1" and plan["global_batch"] == "2"
    assert (plan["steps_per_epoch"], plan["epochs"], plan["total_steps"]) == ("3", "2", "5")
    for key in ("samples_per_epoch", "global_batch", "steps_per_epoch", "epochs", "total_steps",
                "warmup_steps"):
        assert plan[key] == ref[key], key
    assert "done: steps 5, epochs 2" in stdout
    for r in two_process_run["ranks"]:
        assert (r["global_step"], r["epoch"], r["scheduler_steps"]) == (5, 2, 5)


def test_samples_are_sharded_not_repeated(two_process_run):
    by_rank = [{}, {}]
    for rank, r in enumerate(two_process_run["ranks"]):
        for step, epoch, idx in r["micro_steps"]:
            assert step not in by_rank[rank], "train_batch_size 1, no accumulation: one micro-step"
            by_rank[rank][step] = (epoch, tuple(idx))
    ref_steps = two_process_run["reference"]["capture"].samples_per_step()
    assert len(ref_steps) == 5
    empty_shares = 0
    for step, (epoch, ref_idx) in enumerate(ref_steps):
        shares = [by_rank[k].get(step, (epoch, ())) for k in (0, 1)]
        assert all(e == epoch for e, _ in shares)
        assert tuple(sorted(shares[0][1] + shares[1][1])) == ref_idx  # split, never repeated
        assert len(shares[0][1]) == 1  # rank 0 takes the first slot of each global batch
        empty_shares += not shares[1][1]
    assert empty_shares >= 1  # a partial global batch left rank 1 without a sample
    epoch1 = sorted(i for e, idx in ref_steps if e == 1 for i in idx)
    assert epoch1 == [0, 1, 2, 3]


def test_same_learning_rates_losses_and_weights_as_one_process(two_process_run):
    ref = two_process_run["reference"]
    ranks = two_process_run["ranks"]
    assert ranks[0]["lr_log"] == ranks[1]["lr_log"] == ref["run"].lr_log
    assert len(ref["run"].lr_log) == 5
    # the logged loss is the global batch's mean on every rank
    assert ranks[0]["loss_log"] == ranks[1]["loss_log"]
    assert ranks[0]["loss_log"] == pytest.approx(ref["run"].loss_log, rel=1e-5)
    # both ranks took identical steps (the same summed gradient)
    w0, w1 = two_process_run["rank_weights"]
    assert w0.keys() == w1.keys()
    for k in w0:
        assert w0[k].equal(w1[k]), k
    worst, key = max_rel_diff(two_process_run["tensors"], ref["tensors"])
    assert worst <= TOL, f"{key}: {worst:.2e}"
    ups = [k for k in ref["tensors"] if k.endswith("lora_up.weight")]
    assert all(ref["tensors"][k].abs().max() > 0 for k in ups)  # the comparison is not of zeros


def test_a_failing_process_ends_the_job(tmp_path, data_dir):
    """Rank 1 raises at step 2 while rank 0 waits for it in the gradient sum: the job ends
    (non-zero, the error named) instead of hanging. The launcher terminates the surviving rank;
    the process group's timeout (distributed.DEFAULT_TIMEOUT_S) bounds a peer that hangs alive."""
    import time

    report = str(tmp_path / "report")
    os.makedirs(report)
    started = time.monotonic()
    proc = launch_two_processes(report, train_args(data_dir, str(tmp_path / "out"),
                                                   "--train_batch_size", "1",
                                                   "--max_train_steps", "5"),
                                SDTK_TEST_FAIL_AT="1:1")
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert "injected failure on rank 1 at step 1" in proc.stderr
    assert not os.listdir(report)  # neither rank finished
    assert not os.path.exists(tmp_path / "out" / "last.safetensors")
    assert elapsed < 120, elapsed


def _sum_gradients_worker(rank: int, port: int, queue) -> None:
    """One of two gloo processes: gradients present on both, one or no rank, several buckets."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from library.distributed import all_reduce_sum, sum_gradients

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    shapes = [((3, 4), torch.float32), ((5,), torch.float32), ((2, 2), torch.float64),
              ((7,), torch.float32), ((4,), torch.float32)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dt)) for s, dt in shapes]
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    # param 1 only on rank 0, param 4 only on rank 1, param 3 on neither
    has_grad = {0: [0, 1, 2], 1: [0, 2, 4]}[rank]
    for i in has_grad:
        params[i].grad = torch.full_like(params[i], float((i + 1) * 10 ** rank))
    sum_gradients(params + [frozen], bucket_bytes=40)  # 40 bytes: several buckets per dtype
    queue.put((rank, [None if p.grad is None else (str(p.grad.dtype), p.grad.flatten().tolist())
                      for p in params], frozen.grad is None, all_reduce_sum(rank + 0.5, "cpu")))
    dist.destroy_process_group()


def test_sum_gradients_across_two_processes():
    """Bucketed sum: present on both ranks -> sum; on one -> that one (the other adds zeros);
    on none -> stays None (so optimizers skip it, as in one process); dtypes kept; frozen
    parameters untouched. Two bare gloo processes (no model), a couple of seconds."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_sum_gradients_worker, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = dict((res[0], res[1:]) for res in (queue.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    assert all(p.exitcode == 0 for p in procs)
    expected = [("torch.float32", [11.0] * 12), ("torch.float32", [2.0] * 5),
                ("torch.float64", [33.0] * 4), None, ("torch.float32", [50.0] * 4)]
    for rank in (0, 1):
        grads, frozen_untouched, loss_sum = results[rank]
        assert [None if g is None else (g[0], g[1]) for g in grads] == expected
        assert frozen_untouched
        assert loss_sum == 2.0
