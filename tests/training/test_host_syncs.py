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
noise and timesteps are drawn on the host by design, library/training/losses.py) and what
``distributed.sum_gradients`` does (the gradient reduction; the
reads and collectives inside it are reported separately).

This file is also the two-process worker: ``<report_dir> <train_lora args>``.
"""
from __future__ import annotations

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
        self._host_steps: set[int] = set()  # ids of the optimizer's host step counters
        self._host_drawn: dict = {}  # id -> weak reference: tensors drawn from a CPU generator
        self._undo = []

    def _patch(self, owner, name, wrapper):
        real = getattr(owner, name)
        setattr(owner, name, wrapper(real))
        self._undo.append((owner, name, real))

    def _drawn_on_host(self, t) -> bool:
        ref = self._host_drawn.get(id(t))
        return ref is not None and ref() is t

    def _where(self) -> str:
        frames = [f for f in traceback.extract_stack()[:-3] if "test_host_syncs" not in f.filename]
        return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                           for f in reversed(frames[-6:]))

    def _record(self, book: dict, what: str):
        if self._grad_sum:
            self.in_gradient_sum[self.step] = self.in_gradient_sum.get(self.step, 0) + 1
            return
        book.setdefault(self.step, []).append(f"{what}: {self._where()}")

    def __enter__(self):
        import torch
        import torch.distributed as dist

        from library.distributed import accelerator as distributed
        from library.training.run_state import HOOKS

        def read(name):
            def wrapper(real):
                def counted(t, *a, **k):
                    if self._depth == 0 and id(t) not in self._host_steps \
                            and not self._drawn_on_host(t):
                        self._record(self.reads, f"Tensor.{name}")
                    self._depth += 1
                    try:
                        return real(t, *a, **k)
                    finally:
                        self._depth -= 1
                return counted
            return wrapper

        for name in READS:
            self._patch(torch.Tensor, name, read(name))

        def drawn(real):
            def marked(*a, **k):
                out = real(*a, **k)
                g = k.get("generator")
                if g is not None and g.device.type == "cpu" and out.device.type == "cpu":
                    self._host_drawn[id(out)] = weakref.ref(out)
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
            def marked(*a, **k):
                self._grad_sum += 1
                try:
                    return real(*a, **k)
                finally:
                    self._grad_sum -= 1
            return marked

        self._patch(distributed, "sum_gradients", gradient_sum)

        def before_micro_step(run, epoch, idx):
            step = run.progress.global_step + 1
            if step != self.step:
                self.step = step
                opt = run.parts.stepper.optimizer
                opt = getattr(opt, "optimizer", opt)  # Accelerate's wrapper
                self._host_steps = {id(s["step"]) for s in opt.state.values()
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


@pytest.mark.parametrize("extra", [
    # accumulation (micro-step losses summed on the device), clipping, EMA, TensorBoard scalars
    ["--gradient_accumulation_steps", "2", "--max_grad_norm", "1", "--ema_decay", "0.9",
     "--logging_dir", "LOGS"],
    # scale_weight_norms: its statistics stay on the device unless logged
    ["--scale_weight_norms", "0.05", "--max_grad_norm", "0"],
], ids=["accumulation-clip-ema-tensorboard", "scale_weight_norms"])
def test_one_host_read_per_steady_step(extra, data, train, tmp_path):
    extra = [str(tmp_path / "logs") if a == "LOGS" else a for a in extra]
    with HostSyncCounter() as counter:
        rc, _, err, run = train("train_lora", lora_args(data, tmp_path / "out", *extra))
    assert rc == 0, err[-3000:]
    assert run.progress.global_step == STEPS and len(run.progress.loss_log) == STEPS
    steady = counter.steady(STEPS)
    assert_bound(steady, reads=1, collectives=0)
    # the counter sees the reads the loop makes: the step's one read is there, every step
    assert all(len(r) == 1 and "step_sync.py" in r[0] for r, _ in steady.values()), steady


def test_counter_sees_a_per_step_read(data, train, tmp_path, monkeypatch):
    """The instrumentation is not blind: a loss read per micro-step (what the loop did before)
    is counted."""
    from library.training import step_sync

    real = step_sync.add_loss

    def reading(total, loss):
        float(loss.detach())
        return real(total, loss)

    monkeypatch.setattr(step_sync, "add_loss", reading)
    with HostSyncCounter() as counter:
        rc, _, err, _ = train("train_lora", lora_args(data, tmp_path / "out",
                                                      "--gradient_accumulation_steps", "2"))
    assert rc == 0, err[-3000:]
    assert all(len(r) == 3 for r, _ in counter.steady(STEPS).values())


def test_two_processes_one_small_collective_per_step(data, tmp_path):
    from tests.conftest import two_process_command

    report = tmp_path / "report"
    report.mkdir()
    cmd, env = two_process_command(os.path.abspath(__file__),
                                   [report, *lora_args(data, tmp_path / "out", "--max_grad_norm",
                                                       "1")])
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    for rank in (0, 1):
        r = json.load(open(report / f"rank{rank}.json"))
        assert r["rc"] == 0
        steady = {int(k): v for k, v in r["steady"].items()}
        assert_bound(steady, reads=1, collectives=1)
        assert all(len(c) == 1 and "step_sync.py" in c[0] for _, c in steady.values()), steady
