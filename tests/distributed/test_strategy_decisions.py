"""The cross-process decisions each strategy owns (library/distributed/strategy.py), checked
against hand-written tables: which processes take part in a micro-step of an empty share
(``takes_part``), how the stepper it builds sums the gradients (``make_stepper``'s
``grad_sum``), and which state layouts it reads (``check_state``). One process, no process
group: the 2-process equivalence runs are tests/distributed/test_ddp.py, test_fsdp.py,
test_deepspeed.py and tests/training/test_fused.py / test_fused_async.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from library.accelerator import BUCKETED_SUM
from library.distributed import strategy
from library.errors import ResumeError
from tests.conftest import FakeAccelerator
from tests.helpers import make_opts

FUSED = {"fused_backward_pass": True}


class _Acc(FakeAccelerator):
    def __init__(self, processes: int):
        super().__init__()
        self.process_index, self.num_processes = 0, processes


def _opts(**extra):
    return make_opts("train_dreambooth", optimizer_type="torch.optim.SGD", learning_rate=0.1,
                     lr_scheduler="constant", **extra)


def _strategy(kind: str, processes: int, **extra):
    acc, opts = _Acc(processes), _opts(**extra)
    make = {"single": lambda: strategy.SingleProcess(acc), "ddp": lambda: strategy.DDP(acc, opts),
            "fsdp": lambda: strategy.FSDP(acc), "deepspeed": lambda: strategy.DeepSpeed(acc)}
    return make[kind]()


R, Z, S = strategy.RUN, strategy.ZERO_WEIGHT, strategy.SKIP


# (kind, processes, fused stepper?) -> what an empty share does in an earlier / the last
# micro-step: hooks of a fused stepper and DDP's reducer need the last backward of every
# process; FSDP's all-gather (several processes) every forward; ZeRO every backward.
TAKES_PART = [
    ("single", 1, False, S, S),
    ("single", 1, True, S, Z),
    ("ddp", 2, False, S, Z),
    ("ddp", 2, True, S, Z),
    ("fsdp", 1, False, S, S),
    ("fsdp", 2, False, Z, Z),
    ("deepspeed", 1, False, Z, Z),
    ("deepspeed", 2, False, Z, Z),
]


@pytest.mark.parametrize("kind,processes,fused,earlier,last", TAKES_PART)
def test_takes_part(kind, processes, fused, earlier, last):
    s = _strategy(kind, processes, **(FUSED if fused else {}))
    s.stepper = SimpleNamespace(steps_in_backward=fused)
    assert s.takes_part(empty=True, last=False) == earlier
    assert s.takes_part(empty=True, last=True) == last
    for at_last in (False, True):  # a share of its own: always run
        assert s.takes_part(empty=False, last=at_last) == R


def _stepper(s, opts_extra: dict):
    w = torch.nn.Parameter(torch.ones(3))
    plan = SimpleNamespace(warmup_steps=0, total_steps=1)
    stepper = s.make_stepper(_opts(**opts_extra), [{"params": [w]}], [w], plan)
    assert s.stepper is stepper
    return stepper


def _sum_after_backward_ddp():
    """benchmarks/ddp_scaling.py's DDP subclass (a script, loaded from its file)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "ddp_scaling.py")
    spec = importlib.util.spec_from_file_location("ddp_scaling", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.sum_after_backward_ddp()


# (strategy, stepper options) -> the stepper's gradient sum (None: nothing to sum).
@pytest.mark.parametrize("kind,processes,extra,summed", [
    ("single", 1, {}, None),
    ("single", 1, FUSED, None),
    ("ddp", 2, {}, None),                 # DDP's reducer sums during the backward
    ("ddp", 2, FUSED, BUCKETED_SUM),      # each fused unit in its hooks
    ("ddp", 2, {"fused_optimizer_groups": 2}, BUCKETED_SUM),
    ("fsdp", 2, {}, None),                # FSDP's reduce-scatter
    ("benchmark", 2, {}, BUCKETED_SUM),   # benchmarks/ddp_scaling.py's "sum" column
])
def test_each_strategy_chooses_the_gradient_sum(kind, processes, extra, summed):
    if kind == "benchmark":
        s = _sum_after_backward_ddp()(_Acc(processes), _opts(**extra))
        assert isinstance(s, strategy.DDP) and not s.engine
    else:
        s = _strategy(kind, processes, **extra)
    stepper = _stepper(s, extra)
    assert stepper.grad_sum is summed
    assert stepper.steps_in_backward == bool(extra)
    if kind == "fsdp":  # the optimizer state is written with the shards, not by the stepper
        assert not stepper.optimizer_in_state and "optimizer" not in stepper.state_dict()
    elif not extra:
        assert stepper.optimizer_in_state and "optimizer" in stepper.state_dict()


def test_ddp_uses_its_reducer_with_the_plain_stepper_only():
    assert strategy.DDP(_Acc(2), _opts()).engine
    assert strategy.DDP(_Acc(2), _opts()).last_micro_step_in_every_process
    assert not strategy.DDP(_Acc(2), _opts(**FUSED)).engine
    assert not hasattr(strategy.DDP, "use_reducer")  # no benchmark switch in the production class


@pytest.mark.parametrize("kind,sharded,fails", [
    ("single", True, True), ("ddp", True, True), ("deepspeed", True, True),
    ("fsdp", True, False), ("single", False, False), ("fsdp", False, False)])
def test_state_layout_check(kind, sharded, fails, tmp_path):
    s = _strategy(kind, 2)
    info = {"sharded": sharded, "deepspeed": False}
    if fails:
        with pytest.raises(ResumeError, match="written with fsdp"):
            s.check_state(str(tmp_path), info)
    else:
        s.check_state(str(tmp_path), info)
