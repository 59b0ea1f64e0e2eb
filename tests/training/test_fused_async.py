"""The fused steppers under several processes: each unit's gradient sum is launched
asynchronously in its hook and the unit stepped when the sum completes
(``fused_reductions_in_flight`` k sums in flight, library/training/stepper.py ``_HookStepper``).

One spawn of two gloo processes (a few seconds) runs every case below twice in each process,
with k = 0 (the synchronous sum inside the hook) and with k >= 1, on a small net with a
channels_last convolution (strided gradients) and a parameter outside the graph (its unit is
stepped in ``step()``, on the synchronous path):
- bit-identity: AdamW per parameter (k = 1 and 3), AdamW in 4 groups, full_bf16 per parameter
  (stochastic rounding) and in groups: the weights after 3 steps are equal bit for bit to k = 0,
  and equal in both processes;
- an independent reference: the same 3 global batches of 4 in one process with
  ``torch.optim.AdamW`` over the whole batch's loss: the 2-process fused weights agree within
  float noise;
- overlap and memory: ``dist.all_reduce`` is wrapped; every sum launched in the backward is
  ``async_op``, some sum is still in flight (not waited for) when the hook of a later unit
  fires, never more than k sums are in flight, k are at some point, and the gradient tensors
  alive (parameters' gradients and the buckets of sums in flight) never cover more than
  k + 1 units; none is left after the backward;
- the non-finite guard: an inf injected into one parameter's gradient in process 1 only, at
  step 2: both processes record the same non-finite message and ``partial_update``, exactly the
  units before it (in backward order) were stepped in that step, and after ``skip()``
  (``on_nonfinite skip``) the run goes on; all of it equal to k = 0 bit for bit.
"""
from __future__ import annotations

import io
import time

import pytest
import torch

STEPS = 3
GLOBAL_BATCH = 4
LR = 1e-2
ADAMW = {"weight_decay": 0.01}


class _Net(torch.nn.Module):
    def __init__(self, unused: bool = True, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3)
        self.fc = torch.nn.Linear(8 * 6 * 6, 16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 2)
        if unused:
            self.unused = torch.nn.Parameter(torch.ones(3))  # never in the graph
        self.to(dtype)
        # a channels_last weight: its gradient has the same strides, which the flat buckets
        # of a group must give back
        with torch.no_grad():
            self.conv2.weight.data = self.conv2.weight.data.contiguous(
                memory_format=torch.channels_last)

    def forward(self, x):
        h = torch.relu(self.conv2(torch.relu(self.conv(x))))
        return self.head(torch.relu(self.fc2(torch.relu(self.fc(h.flatten(1))))))


def _batches(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g).to(dtype),
             torch.randn(GLOBAL_BATCH, 2, generator=g).to(dtype)) for _ in range(STEPS)]


def _loss(net, x, y):
    """The sum of the samples' squared errors weighted by 1/global batch (as the trainer weights
    each process's share), so the processes' losses add up to the global batch's mean."""
    return ((net(x).float() - y.float()) ** 2).mean(dim=1).sum() / GLOBAL_BATCH


def _opts(extra: dict, bound: int):
    from tests.helpers import make_opts

    return make_opts(optimizer_type="AdamW", optimizer_args=ADAMW, learning_rate=LR,
                     lr_scheduler="constant", max_grad_norm=0.0,
                     fused_reductions_in_flight=bound, **extra)


# -- inside each of the two processes --------------------------------------------------------------
class _Work:
    """An async all-reduce's work that records its wait (a plain class: a class made per call
    would keep the work, and so its buffer, alive until the garbage collector runs)."""

    def __init__(self, work, n, events):
        self.work, self.n, self.events = work, n, events

    def wait(self):
        self.events.append(("wait", self.n))
        return self.work.wait()


class _Recorder:
    """Wraps ``torch.distributed.all_reduce`` during the backward and records the launches, the
    waits and, around the stepper's own hook of each trained parameter, two observer hooks
    (post-accumulate hooks run in the order of registration): "pre" before it (the parameter's
    gradient is complete) and "post" after it, with the number of units whose gradient memory is
    alive then."""

    def __init__(self, params):
        import weakref

        self.events, self.buffers, self.active = [], [], False
        self._weakref = weakref.ref
        self.params, self.stepper, self._orig = params, None, None
        for p in params:  # before the stepper's hooks
            p.register_post_accumulate_grad_hook(lambda q: self._event("pre", q))

    def attach(self, stepper):
        import torch.distributed as dist

        self.stepper = stepper
        for p in self.params:  # after the stepper's hooks
            p.register_post_accumulate_grad_hook(lambda q: self._event("post", q))
        self._orig = dist.all_reduce
        dist.all_reduce = self._all_reduce

    def close(self):
        import torch.distributed as dist

        if self._orig is not None:
            dist.all_reduce = self._orig

    def _event(self, kind, p):
        if self.active:
            unit = self.stepper.unit_of[id(p)]
            self.events.append((kind, unit) if kind == "pre" else (kind, unit, self.live_units()))

    def _all_reduce(self, tensor, *args, async_op=False, **kw):
        if not self.active:
            return self._orig(tensor, *args, async_op=async_op, **kw)
        n = len(self.buffers)
        self.buffers.append(self._weakref(tensor))
        self.events.append(("launch", n, async_op))
        work = self._orig(tensor, *args, async_op=async_op, **kw)
        if not async_op:
            self.events.append(("wait", n))
            return work
        return _Work(work, n, self.events)

    def buckets_alive(self) -> int:
        """Reduction buffers still alive that are no parameter's gradient (a group's flat
        buckets, one per unit on this small net). gloo's worker thread drops its reference to
        a buffer just after the wait returns: a bucket already waited for is given a moment
        to go (one the stepper kept would stay)."""
        waited = {e[1] for e in self.events if e[0] == "wait"}
        deadline = time.monotonic() + 2.0
        while True:
            grads = [p.grad for p in self.params if p.grad is not None]
            alive = [(i, t) for i, t in enumerate(r() for r in self.buffers)
                     if t is not None and not any(t is g for g in grads)]
            del grads
            if all(i not in waited for i, _ in alive) or time.monotonic() > deadline:
                return len(alive)
            del alive
            time.sleep(0.002)

    def live_units(self) -> int:
        """Units holding gradient memory: those with a parameter's gradient alive, plus each
        live bucket (a group's gradients in flight)."""
        with_grad = {self.stepper.unit_of[id(p)] for p in self.params if p.grad is not None}
        return len(with_grad) + self.buckets_alive()


def _run(rank: int, extra: dict, bound: int, dtype=torch.float32, unused=True, inject=None,
         record=False) -> dict:
    """3 fused steps of this process's share (samples rank, rank + 2) of each global batch."""
    from library.training.stepper import make_stepper
    from tests.conftest import FakeAccelerator

    net = _Net(unused=unused, dtype=dtype)
    params = list(net.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    fired: list = []  # the order in which the gradients became complete, per step
    for p in params:  # before the stepper's hooks
        p.register_post_accumulate_grad_hook(lambda q: fired[-1].append(index[id(q)]))
    recorder = _Recorder(params) if record else None
    stepper = make_stepper(FakeAccelerator(), _opts(extra, bound), [{"params": params}], params,
                           warmup_steps=0, total_steps=STEPS)
    assert stepper.reductions_in_flight == bound
    if recorder is not None:
        recorder.attach(stepper)
    handle = None
    steps = []
    try:
        for s, (x, y) in enumerate(_batches(dtype)):
            if inject is not None and s == inject[0] and rank == 1:
                bad = dict(net.named_parameters())[inject[1]]
                handle = bad.register_hook(lambda g: g + float("inf"))
            before = [p.detach().clone() for p in params]
            fired.append([])
            if recorder is not None:
                recorder.active = True
            stepper.backward(_loss(net, x[rank::2], y[rank::2]))
            if recorder is not None:
                recorder.active = False
                recorder.events.append(("backward done", recorder.buckets_alive()))
            stepper.step()
            changed = [i for i, (p, b) in enumerate(zip(params, before)) if not torch.equal(p, b)]
            steps.append({"nonfinite": stepper.nonfinite, "partial": stepper.partial_update,
                          "changed": changed})
            if stepper.nonfinite is not None:
                stepper.skip()  # on_nonfinite skip: no update of the rest, the schedule goes on
            if handle is not None:
                handle.remove()
                handle = None
    finally:
        if recorder is not None:
            recorder.close()
    buf = io.BytesIO()
    torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, buf)
    return {"weights": buf.getvalue(), "steps": steps, "fired": fired,
            "units": [[index[id(p)] for p in u] for u in stepper.units],  # in backward order
            "events": recorder.events if recorder else None}


# (name, stepper options, in-flight bounds (the first is k = 0), dtype, net with an unused
# parameter, injected inf (step, parameter), recorded)
FUSED = {"fused_backward_pass": True}
GROUPS = {"fused_optimizer_groups": 4}
BF16 = {"full_bf16": True, "mixed_precision": "bf16"}
CASES = [
    ("fused", FUSED, (0, 1, 3), torch.float32, True, None, False),
    ("groups", GROUPS, (0, 2), torch.float32, True, None, False),
    ("fused bf16", {**FUSED, **BF16}, (0, 2), torch.bfloat16, True, None, False),
    ("groups bf16", {**GROUPS, **BF16}, (0, 2), torch.bfloat16, True, None, False),
    ("fused nonfinite", FUSED, (0, 2), torch.float32, True, (1, "fc.weight"), False),
    ("groups nonfinite", {"fused_optimizer_groups": 5}, (0, 2), torch.float32, False,
     (1, "conv2.bias"), False),
    ("fused overlap", FUSED, (2,), torch.float32, False, None, True),
    ("groups overlap", {"fused_optimizer_groups": 3}, (1, 2), torch.float32, False, None, True),
]


def _worker(rank: int, port: int, queue) -> None:
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=60))
        out = {}
        for name, extra, bounds, dtype, unused, inject, record in CASES:
            for k in bounds:
                out[(name, k)] = _run(rank, extra, k, dtype, unused, inject, record)
        queue.put((rank, out))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def two_ranks():
    from tests.helpers import spawn_two_processes

    results = dict(spawn_two_processes(_worker, timeout=180))
    for r in (0, 1):
        assert isinstance(results[r], dict), results[r]
    return results


def _weights(result) -> dict:
    return torch.load(io.BytesIO(result["weights"]))


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])
                                        for k in a)


def _case(name):
    return dict(zip(("name", "extra", "bounds", "dtype", "unused", "inject", "record"),
                    next(c for c in CASES if c[0] == name)))


@pytest.mark.parametrize("name", [c[0] for c in CASES if c[2][0] == 0])
def test_overlapped_sums_equal_the_synchronous_sums_bit_for_bit(two_ranks, name):
    case = _case(name)
    sync = [two_ranks[r][(name, 0)] for r in (0, 1)]
    assert _bitwise_equal(_weights(sync[0]), _weights(sync[1]))  # the ranks stepped alike
    for k in case["bounds"][1:]:
        for r in (0, 1):
            res = two_ranks[r][(name, k)]
            assert _bitwise_equal(_weights(res), _weights(sync[0])), (name, k, r)
            assert res["steps"] == sync[0]["steps"]
    if case["inject"] is None:  # it trained: every used parameter moved
        init = _Net(unused=case["unused"], dtype=case["dtype"]).state_dict()
        got = _weights(sync[0])
        assert {k for k in init if not torch.equal(init[k], got[k])} == set(init) - {"unused"}


def test_two_processes_equal_one_process_adamw_over_the_global_batch(two_ranks):
    """The independent reference: torch.optim.AdamW on the loss of each whole global batch in
    this (one) process, against the 2-process fused runs (per parameter and in groups)."""
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, **ADAMW)
    for x, y in _batches():
        opt.zero_grad()
        _loss(net, x, y).backward()
        opt.step()
    ref = net.state_dict()
    for name in ("fused", "groups"):
        got = _weights(two_ranks[0][(name, 2 if name == "groups" else 3)])
        for k, v in ref.items():
            d, n = float((got[k] - v).norm()), float(v.norm())
            assert d / max(n, 1e-4) <= 1e-5, (name, k, d / max(n, 1e-4))


def _in_flight(events):
    """Sums launched and not yet waited for, after each event."""
    live, out = set(), []
    for e in events:
        if e[0] == "launch":
            live.add(e[1])
        elif e[0] == "wait":
            live.discard(e[1])
        out.append(len(live))
    return out


@pytest.mark.parametrize("name,k", [("fused overlap", 2), ("groups overlap", 1),
                                    ("groups overlap", 2)])
def test_sums_overlap_the_backward_within_the_bounds(two_ranks, name, k):
    for r in (0, 1):
        res = two_ranks[r][(name, k)]
        events, n_units = res["events"], len(res["units"])
        launches = [i for i, e in enumerate(events) if e[0] == "launch"]
        assert len(launches) == STEPS * n_units  # one sum per unit, all in the backward
        assert all(events[i][2] for i in launches)  # async_op=True
        # overlap: a unit's sum, launched in its last hook, is still in flight when a later
        # unit's gradient is complete (its first observer hook fires before the stepper's):
        # every unit's but the last one's of each backward
        overlapped = 0
        for i in launches:
            owner = next(e[1] for e in reversed(events[:i]) if e[0] == "pre")
            waited = next(j for j in range(i, len(events)) if events[j][:2] == ("wait", events[i][1]))
            overlapped += any(e[0] == "pre" and e[1] != owner for e in events[i:waited])
        assert overlapped == STEPS * (n_units - 1)
        flight = _in_flight(events)
        assert max(flight) == k  # the bound is reached and never exceeded
        # memory: per parameter, the k units in flight; in groups, also the one being filled
        live = [e[2] for e in events if e[0] == "post"]
        assert max(live) == (k if name.startswith("fused") else k + 1), live
        # after each backward: every sum waited for, no bucket alive
        dones = [i for i, e in enumerate(events) if e[0] == "backward done"]
        assert len(dones) == STEPS and all(flight[i] == 0 and events[i][1] == 0 for i in dones)


@pytest.mark.parametrize("name", ["fused nonfinite", "groups nonfinite"])
def test_a_nonfinite_unit_in_one_process_stops_both_alike(two_ranks, name):
    case = _case(name)
    names = [n for n, _ in _Net(unused=case["unused"]).named_parameters()]
    used = set(range(len(names))) - ({names.index("unused")} if case["unused"] else set())
    runs = [two_ranks[r][(name, k)] for r in (0, 1) for k in case["bounds"]]
    ref = runs[0]
    for res in runs:  # both ranks, synchronous and overlapped: the same steps and weights
        assert res["steps"] == ref["steps"]
        assert _bitwise_equal(_weights(res), _weights(ref))
    steps = ref["steps"]
    assert [s["nonfinite"] is None for s in steps] == [True, False, True]
    assert steps[1]["nonfinite"] == "gradient norm inf" and steps[1]["partial"] is True
    # exactly the units complete before the bad one (in the backward's order, recorded by a
    # hook of this test) were stepped in that step
    fired = ref["fired"][1]
    done_at = [max(fired.index(i) for i in u) if all(i in fired for i in u) else len(fired)
               for u in ref["units"]]
    bad = done_at[next(i for i, u in enumerate(ref["units"]) if names.index(case["inject"][1]) in u)]
    before = {i for u, at in zip(ref["units"], done_at) if at < bad for i in u}
    assert before and set(steps[1]["changed"]) == before
    assert sum(bad < at < len(fired) for at in done_at) >= 2  # later units were still to come
    # skip() dropped the rest: the next step updates every used parameter again
    assert set(steps[2]["changed"]) == used


def test_one_process_makes_no_collective(monkeypatch):
    """One process (no process group): the fused steppers sum nothing, whatever the bound."""
    import torch.distributed as dist

    from library.training.stepper import make_stepper
    from tests.conftest import FakeAccelerator

    def refuse(*a, **k):
        raise AssertionError("a collective in a one-process run")

    monkeypatch.setattr(dist, "all_reduce", refuse)
    for extra in (FUSED, GROUPS):
        net = _Net()
        params = list(net.parameters())
        stepper = make_stepper(FakeAccelerator(), _opts(extra, 2), [{"params": params}], params,
                               warmup_steps=0, total_steps=1)
        x, y = _batches()[0]
        stepper.backward(_loss(net, x, y))
        stepper.step()
        assert not stepper._in_flight and stepper.nonfinite is None



def test_the_memory_estimate_counts_the_sums_in_flight():
    """--dry_run's estimate (library/training/memory_estimate.py): one process or k = 0, the
    largest unit's gradients; k sums in flight, the k + 1 largest units' (by hand)."""
    from library.training.memory_estimate import fused_gradient_bytes

    units = [5, 1, 3, 2]
    assert [fused_gradient_bytes(units, alive) for alive in (1, 2, 3, 9)] == [5, 8, 10, 11]


@pytest.mark.slow
def test_the_overlap_benchmark_runs(tmp_path):
    """benchmarks/fused_overlap.py end to end on a narrow block (64 channels, one step): every
    overlapped configuration reports the weights of its synchronous one."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "fused_overlap.py"),
                           "--channels", "64", "--steps", "1", "--warmup", "0", "--bounds", "0",
                           "1", "--groups", "2"], capture_output=True, text=True, timeout=600,
                          cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| fused k=1")
            or ln.startswith("| groups 2 k=1")]
    assert len(rows) == 2 and all(ln.rstrip().endswith("| identical |") for ln in rows), proc.stdout
