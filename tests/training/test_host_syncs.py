"""No host-device synchronisation in a steady-state step (library/training/step_sync.py).

Instrumentation counts, during the steady-state steps of a real train_lora run (not the first
step, not the last one, whose tail holds the final save; no save, validation or sample between),
every host read of a tensor (``item``, ``float()``, ``int()``, ``bool()``, ``tolist``, ``cpu``,
``numpy``, formatting) and every ``torch.distributed`` collective. Bound: one read per step (the
non-finite guard's, which also brings the loss, the gradient norm and the stop signal) and, with
two processes, one small collective besides the gradient reduction (the cross-process loss sum
and the stop-signal agreement together).

On this CPU machine every tensor is a host tensor, so the reads are counted, not timed: on a GPU
each would be a synchronisation. Two kinds of read are not counted: the optimizer's step counters
(torch keeps ``state["step"]`` on the host unless ``capturable`` / ``fused``, so reading it costs no
sync on a GPU either), reads of tensors drawn from a CPU ``torch.Generator`` (the sample-keyed
noise and timesteps are drawn on the host by design, library/training/losses.py) or returned by
``.cpu()`` (the copy is the read; networks/lora.py ``max_norm_summary`` computes on such a copy)
and what
``distributed.sum_gradients`` and DDP's comm hook (library/distributed/ddp.py ``sum_hook``) do (the
gradient reduction; the reads and collectives inside them are reported separately).

This file is also the two-process worker: ``<report_dir> <train_lora args>``.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import traceback
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__index__", "__bool__",
         "__format__")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "broadcast", "broadcast_object_list", "reduce", "reduce_scatter_tensor", "gather",
               "scatter", "barrier", "all_to_all_single")


class HostSyncCounter:
    """Per training step (the step whose first micro-step began last): host reads of tensors and
    collectives, each with the stack that made it (for the failure message)."""

    def __init__(self):
        self.step = 0
        self.reads: dict[int, list[str]] = {}
        self.collectives: dict[int, list[str]] = {}
        self.in_gradient_sum: dict[int, int] = {}
        self._depth = 0        # a read inside a read (e.g. __format__ -> item) counts once
        self._grad_sum = 0     # inside distributed.sum_gradients
        self._host_math = 0    # inside a function that reads one .cpu() copy (HOST_MATH)
        self._host_steps: set[int] = set()  # ids of the optimizer's host step counters
        self._host: dict = {}  # id -> weak reference: tensors drawn on / copied to the host
        self._undo = []

    def _patch(self, owner, name, wrapper):
        real = getattr(owner, name)
        setattr(owner, name, wrapper(real))
        self._undo.append((owner, name, real))

    def _on_host(self, t) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _where(self) -> str:
        """The innermost 6 frames outside this file (no source lines read: cheap)."""
        stack = traceback.StackSummary.extract(traceback.walk_stack(sys._getframe(1)), limit=16,
                                               lookup_lines=False)
        frames = [f for f in stack if "test_host_syncs" not in f.filename][:6]
        return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames)

    def _record(self, book: dict, what: str):
        if self._grad_sum:
            self.in_gradient_sum[self.step] = self.in_gradient_sum.get(self.step, 0) + 1
            return
        book.setdefault(self.step, []).append(f"{what}: {self._where()}")

    def __enter__(self):
        import torch
        import torch.distributed as dist

        from library import accelerator as distributed
        from library.run.run_state import HOOKS

        def read(name):
            def wrapper(real):
                def counted(t, *a, **k):
                    if self._depth == 0 and id(t) not in self._host_steps \
                            and not self._on_host(t) and not (self._host_math and name != "cpu"):
                        self._record(self.reads, f"Tensor.{name}")
                    self._depth += 1
                    try:
                        out = real(t, *a, **k)
                    finally:
                        self._depth -= 1
                    if name == "cpu":  # what .cpu() returns is a host tensor: reading it is free
                        self._host[id(out)] = weakref.ref(out)
                    return out
                return counted
            return wrapper

        for name in READS:
            self._patch(torch.Tensor, name, read(name))

        def drawn(real):
            def marked(*a, **k):
                out = real(*a, **k)
                g = k.get("generator")
                if g is not None and g.device.type == "cpu" and out.device.type == "cpu":
                    self._host[id(out)] = weakref.ref(out)
                return out
            return marked

        for name in ("rand", "randn", "randint", "randperm", "multinomial", "normal"):
            self._patch(torch, name, drawn)

        def collective(name):
            def wrapper(real):
                def counted(*a, **k):
                    self._record(self.collectives, f"dist.{name}")
                    return real(*a, **k)
                return counted
            return wrapper

        for name in COLLECTIVES:
            self._patch(dist, name, collective(name))

        def gradient_sum(real):
            @functools.wraps(real)
            def marked(*a, **k):
                self._grad_sum += 1
                try:
                    return real(*a, **k)
                finally:
                    self._grad_sum -= 1
            return marked

        self._patch(distributed, "sum_gradients", gradient_sum)
        from library.distributed import ddp

        self._patch(ddp, "sum_hook", gradient_sum)  # DDP's bucket all-reduce (its comm hook)

        def host_math(real):
            def marked(*a, **k):
                self._host_math += 1
                try:
                    return real(*a, **k)
                finally:
                    self._host_math -= 1
            return marked

        import networks.lora

        # computes on the one .cpu() copy of scale_weight_norms' statistics: the copy counts
        self._patch(networks.lora, "max_norm_summary", host_math)

        def before_micro_step(run, epoch, idx):
            step = run.progress.global_step + 1
            if step != self.step:
                self.step = step
                stepper = run.parts.stepper
                # every optimizer: the fused steppers have one per unit
                opts = getattr(stepper, "optimizers", None) or [stepper.optimizer]
                opts = [getattr(o, "optimizer", o) for o in opts]  # Accelerate's wrapper
                self._host_steps = {id(s["step"]) for o in opts for s in o.state.values()
                                    if isinstance(s.get("step"), torch.Tensor)
                                    and s["step"].device.type == "cpu"}

        self._hooks = HOOKS.add(before_micro_step=before_micro_step)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)
        self._undo = []

    def steady(self, steps: int) -> dict:
        """{step: (reads, collectives)} for the steady-state steps 2 .. steps - 1."""
        return {s: (self.reads.get(s, []), self.collectives.get(s, [])) for s in range(2, steps)}


def _worker(report_dir: str, argv: list[str]) -> int:
    """One process of the two-process launch: train_lora under the counter; writes
    rank<N>.json with the steady steps' reads and collectives."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import runpy

    sys.argv = [os.path.join(ROOT, "train_lora.py"), *argv]
    rc = 0
    with HostSyncCounter() as counter:
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    report = {"rc": rc, "steady": counter.steady(STEPS), "in_gradient_sum": counter.in_gradient_sum}
    with open(os.path.join(report_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(report, f)
    return rc


STEPS = 4


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2:]))


# -- the tests ------------------------------------------------------------------------------------
import subprocess  # noqa: E402

import pytest  # noqa: E402


def lora_args(data, out, *extra):
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", str(data),
            "--output_dir", str(out), "--resolution", "64", "--cache_latents", "--network_dim", "4",
            "--train_batch_size", "1", "--max_train_steps", str(STEPS), "--seed", "1",
            "--learning_rate", "1e-3", *map(str, extra)]


def assert_bound(steady: dict, reads: int, collectives: int):
    assert len(steady) == STEPS - 2
    for step, (r, c) in steady.items():
        assert len(r) <= reads, f"step {step}: {len(r)} host reads:\n" + "\n".join(r)
        assert len(c) <= collectives, f"step {step}: {len(c)} collectives:\n" + "\n".join(c)


@pytest.fixture
def data(tmp_path):
    from tools.make_sample_dataset import make_sample_dataset

    folder = tmp_path / "data"
    make_sample_dataset(str(folder), n_images=2, size=64, repeats=4)
    return folder


def test_counter_counts_reads_of_device_values():
    """The instrumentation is not blind: each kind of read is counted once, a read inside a read
    once, the host's own tensors not."""
    import torch

    with HostSyncCounter() as counter:
        t = torch.ones(2)
        float(t[0]), t[1].item(), bool(t.sum() > 0), t.tolist(), f"{t[0]:.2f}", int(t[0])
        host = t.cpu()  # the copy is the read; reading the copy is not (on CPU the same tensor)
        host.tolist()
        g = torch.Generator().manual_seed(0)
        int(torch.randint(0, 9, (1,), generator=g))  # drawn on the host
    reads = counter.reads[0]
    assert [r.split(":")[0] for r in reads] == [
        "Tensor.__float__", "Tensor.item", "Tensor.__bool__", "Tensor.tolist", "Tensor.__format__",
        "Tensor.__int__", "Tensor.cpu"], reads
    assert torch.Tensor.item is not None and not counter._undo  # patches removed


def test_one_host_read_per_steady_step(data, train, tmp_path):
    """Accumulation (the micro-step losses summed on the device), clipping, the EMA,
    scale_weight_norms and TensorBoard: per steady step the step's one read, and the tracker's
    read of scale_weight_norms' statistics (logging every step); no collective (one process)."""
    logs = tmp_path / "logs"
    with HostSyncCounter() as counter:
        rc, _, err, run = train("train_lora", lora_args(
            data, tmp_path / "out", "--gradient_accumulation_steps", "2", "--max_grad_norm", "1",
            "--ema_decay", "0.9", "--scale_weight_norms", "0.05", "--logging_dir", logs))
    assert rc == 0, err[-3000:]
    assert run.progress.global_step == STEPS and len(run.progress.loss_log) == STEPS
    steady = counter.steady(STEPS)
    assert_bound(steady, reads=2, collectives=0)
    for step, (reads, _) in steady.items():
        assert "step_sync.py" in reads[0] and "loop.py" in reads[0], reads
        # logging: the statistics are read for the tracker, not for the progress bar
        assert len(reads) == 2 and "tracking.py" in reads[1] and "max_norm_summary" in reads[1], \
            reads
    assert "Keys Scaled=" in err  # the bar shows them (read on the first step)


@pytest.mark.parametrize("extra", [["--fused_backward_pass"], ["--fused_optimizer_groups", "2"]],
                         ids=["fused_backward_pass", "fused_optimizer_groups"])
def test_one_host_read_per_steady_step_with_a_fused_stepper(data, train, tmp_path, extra):
    """The steppers that update inside the backward read the step once too, in the loop's
    ``stepper.step(read)`` (no read per parameter or group: their guard decides on the device)."""
    with HostSyncCounter() as counter:
        rc, _, err, run = train("train_lora", lora_args(data, tmp_path / "out", "--max_grad_norm",
                                                        "1", *extra))
    assert rc == 0, err[-3000:]
    assert run.parts.stepper.steps_in_backward and len(run.parts.stepper.units) > 1
    steady = counter.steady(STEPS)
    assert_bound(steady, reads=1, collectives=0)
    for step, (reads, _) in steady.items():
        assert len(reads) == 1 and "step_sync.py" in reads[0] and "stepper.py" in reads[0] \
            and "loop.py" in reads[0], reads


@pytest.mark.slow  # two launches of accelerate: ~25 s on 2 cores
def test_two_processes_one_small_collective_per_step(data, tmp_path):
    from tests.conftest import two_process_command

    report = tmp_path / "report"
    report.mkdir()
    cmd, env = two_process_command(os.path.abspath(__file__),
                                   [report, *lora_args(data, tmp_path / "out", "--max_grad_norm",
                                                       "1", "--gradient_accumulation_steps", "2")])
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    for rank in (0, 1):
        r = json.load(open(report / f"rank{rank}.json"))
        assert r["rc"] == 0
        steady = {int(k): v for k, v in r["steady"].items()}
        assert_bound(steady, reads=1, collectives=1)
        assert all(len(c) == 1 and "step_sync.py" in c[0] for _, c in steady.values()), steady
        assert all(len(rd) == 1 and "step_sync.py" in rd[0] for rd, _ in steady.values()), steady
        # the gradient reduction happened, and was told apart (DDP's hook, or the bucketed sum)
        assert all(r["in_gradient_sum"].get(str(s)) for s in steady), r["in_gradient_sum"]
