"""Every stepper makes the step's one host read the same way (library/training/stepper.py), and the
steppers that update inside the backward keep the non-finite guard's promise without a read per
unit (library/training/fused_optim.py ``step_masked``).

The loop's path, on a small model without the trainer: ``step_sync.gather`` before the last
backward, ``stepper.backward(..., loss_finite=...)``, ``stepper.step(pending.read)``. Reads are
counted with tests/training/test_host_syncs.py's counter (every ``item``, ``tolist``, ``bool()``,
...; the optimizer's host step counters excluded, as there). References: the plain stepper over
the whole model (the fused steps are the same math, so one thread gives the same bits), the
unmasked ``step_optimizer``, and copies of the weights and optimizer state taken before a step.
"""
from __future__ import annotations

import copy

import pytest
import torch

from library.training import fused_optim, step_sync
from library.training.stepper import PlainStepper, make_stepper
from tests.conftest import FakeAccelerator
from tests.helpers import make_opts
from tests.training.test_host_syncs import HostSyncCounter

KINDS = {"plain": {}, "fused_backward_pass": {"fused_backward_pass": True},
         "fused_optimizer_groups": {"fused_optimizer_groups": 2},
         "blockwise_fused_optimizers": {"blockwise_fused_optimizers": True}}
OPTIMIZERS = {"AdamW": {"weight_decay": 0.01},
              "Adafactor": {"relative_step": "False", "scale_parameter": "False",
                            "warmup_init": "False"},
              "SGDNesterov": {}}


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _setup(kind: str, optimizer: str = "AdamW"):
    torch.set_num_threads(1)
    net = _Net()
    params = list(net.parameters())
    # one group per layer (blockwise_fused_optimizers steps one unit per group)
    groups = [{"params": list(m.parameters())} for m in (net.a, net.b, net.c)]
    opts = make_opts("train_dreambooth", optimizer_type=optimizer, optimizer_args=OPTIMIZERS[optimizer],
                     learning_rate=1e-2, lr_scheduler="constant", max_grad_norm=0.0,
                     **KINDS[kind])
    stepper = make_stepper(FakeAccelerator(), opts, groups, params, warmup_steps=0, total_steps=8)
    return net, stepper


def _data(steps: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(steps)]


def _one_step(net, stepper, x, y, poison=None):
    """The loop's path for one step of one micro-step; ``poison``: a parameter whose gradient
    is made inf in this step."""
    loss = torch.nn.functional.mse_loss(net(x), y)
    handle = poison.register_hook(lambda g: g * float("inf")) if poison is not None else None
    pending = step_sync.gather(None, torch.device("cpu"), step_sync.add_loss(None, loss))
    stepper.backward(loss, last_micro_step=True, loss_finite=pending.loss_finite)
    if handle is not None:
        handle.remove()
    return stepper.step(pending.read)


def _optimizers(stepper):
    return getattr(stepper, "optimizers", [stepper.optimizer])


def _snapshot(net, stepper):
    return ({k: v.clone() for k, v in net.state_dict().items()},
            [copy.deepcopy(o.state_dict()) for o in _optimizers(stepper)])


def _assert_state_equal(a, b):
    assert a.keys() == b.keys() if isinstance(a, dict) else len(a) == len(b)
    for k in (a.keys() if isinstance(a, dict) else range(len(a))):
        x, y = a[k], b[k]
        if isinstance(x, (dict, list, tuple)):
            _assert_state_equal(x, y)
        elif torch.is_tensor(x):
            assert torch.equal(x, y), k
        else:
            assert x == y, k


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_host_read_per_step_for_every_stepper(kind):
    net, stepper = _setup(kind)
    assert stepper.steps_in_backward == (kind != "plain")
    with HostSyncCounter() as counter:
        for s, (x, y) in enumerate(_data(3), start=1):
            counter.step = s
            # the optimizers' host step counters (torch's AdamW reads them; no device sync)
            counter._host_steps = {id(st["step"]) for o in _optimizers(stepper)
                                   for st in o.state.values() if torch.is_tensor(st.get("step"))}
            read = _one_step(net, stepper, x, y)
            assert read is not None and read.finite
    for s in (2, 3):  # (step 1 makes the optimizer state: its step counters are not known before)
        reads = counter.reads.get(s, [])
        assert len(reads) == 1, f"{kind}, step {s}: {len(reads)} reads:\n" + "\n".join(reads)
        assert "step_sync.py" in reads[0] and "stepper.py" in reads[0], reads


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "plain"])
def test_finite_steps_equal_the_plain_step_bit_for_bit(kind, optimizer):
    ref_net, ref = _setup("plain", optimizer)
    net, stepper = _setup(kind, optimizer)
    assert isinstance(ref, PlainStepper) and stepper.steps_in_backward
    for x, y in _data(4):
        _one_step(ref_net, ref, x, y)
        _one_step(net, stepper, x, y)
    for (k, a), b in zip(net.state_dict().items(), ref_net.state_dict().values()):
        assert torch.equal(a, b), (kind, optimizer, k, float((a - b).abs().max()))


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_step_masked_keeps_the_update_or_the_state_before_exactly(optimizer):
    """``ok`` true: the unmasked ``step_optimizer``'s weights and state, bit for bit; false:
    the weights and state from before the step (the first step's state made by the step is
    removed by ``undo``, Python values such as Adafactor's step count restored)."""
    torch.set_num_threads(1)
    for steps_before in (0, 2):
        nets, opts = [], []
        for _ in range(3):
            net = _Net()
            opt = make_stepper(FakeAccelerator(), make_opts(
                "train_dreambooth", optimizer_type=optimizer, optimizer_args=OPTIMIZERS[optimizer], learning_rate=1e-2,
                lr_scheduler="constant", fused_optimizer_groups=1), [{"params": list(net.parameters())}],
                list(net.parameters()), warmup_steps=0, total_steps=8).optimizers[0]
            nets.append(net)
            opts.append(opt)
        for i, (x, y) in enumerate(_data(steps_before + 1)):
            for net, opt in zip(nets, opts):
                torch.nn.functional.mse_loss(net(x), y).backward()
                if i == steps_before:
                    continue  # the step under test, below
                fused_optim.step_optimizer(opt)
                opt.zero_grad(set_to_none=True)
        plain, kept, masked = zip(nets, opts)
        before = ({k: v.clone() for k, v in masked[0].state_dict().items()},
                  copy.deepcopy(masked[1].state_dict()))
        fused_optim.step_optimizer(plain[1])
        undo_kept = fused_optim.step_masked(kept[1], torch.tensor(True))
        undo_masked = fused_optim.step_masked(masked[1], torch.tensor(False))
        assert len(undo_masked) == len(list(masked[0].parameters()))
        for r in undo_masked:
            fused_optim.undo(r)
        for (k, a), b in zip(kept[0].state_dict().items(), plain[0].state_dict().values()):
            assert torch.equal(a, b), (optimizer, steps_before, k)
        _assert_state_equal(kept[1].state_dict(), plain[1].state_dict())
        for k, v in masked[0].state_dict().items():
            assert torch.equal(v, before[0][k]), (optimizer, steps_before, k)
        _assert_state_equal(masked[1].state_dict(), before[1])
        del undo_kept


@pytest.mark.parametrize("kind", ["fused_backward_pass", "fused_optimizer_groups",
                                  "blockwise_fused_optimizers"])
def test_a_nonfinite_unit_keeps_no_update_nor_do_later_units(kind):
    """An inf gradient in the first layer's weight (among the last in the backward): the units
    stepped before it keep their update; it and every later unit keep the weights and optimizer
    state of the step before, bit for bit; one read, which says so."""
    net, stepper = _setup(kind)
    data = _data(3)
    _one_step(net, stepper, *data[0])
    weights, states = _snapshot(net, stepper)
    with HostSyncCounter() as counter:
        counter.step = 2
        counter._host_steps = {id(st["step"]) for o in _optimizers(stepper)
                               for st in o.state.values() if torch.is_tensor(st.get("step"))}
        read = _one_step(net, stepper, *data[1], poison=net.a.weight)
    assert len(counter.reads.get(2, [])) == 1, counter.reads
    assert read.finite and stepper.nonfinite == "gradient norm inf"
    assert stepper.partial_update  # the later layers came first in the backward
    after = net.state_dict()
    changed = {k for k in after if not torch.equal(after[k], weights[k])}
    assert "a.weight" not in changed and {"c.weight", "c.bias", "b.weight", "b.bias"} <= changed \
        <= {"c.weight", "c.bias", "b.weight", "b.bias", "a.bias"}, changed
    names = {id(p): n for n, p in net.named_parameters()}
    for o, st in zip(_optimizers(stepper), states):
        mine = {names[id(q)] for g in o.param_groups for q in g["params"]}
        if not mine & changed:  # a unit that kept no update: its state is the one before
            _assert_state_equal(o.state_dict(), st)
    stepper.skip()  # on_nonfinite skip: the schedulers step, the next step runs normally
    assert _one_step(net, stepper, *data[2]).finite and stepper.nonfinite is None
    assert all(bool(torch.isfinite(p).all()) for p in net.parameters())


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_nonfinite_loss_updates_nothing(kind):
    net, stepper = _setup(kind)
    data = _data(2)
    _one_step(net, stepper, *data[0])
    weights, states = _snapshot(net, stepper)
    x, y = data[1]
    x = x.clone()
    x[0, 0] = float("nan")
    read = _one_step(net, stepper, x, y)
    assert not read.finite and not stepper.partial_update
    if kind != "plain":  # (the plain stepper has not summed a norm when the loss decides)
        assert stepper.nonfinite is None  # the loop reports the loss
    for k, v in net.state_dict().items():
        assert torch.equal(v, weights[k]), (kind, k)
    for o, st in zip(_optimizers(stepper), states):
        _assert_state_equal(o.state_dict(), st)


def test_memory_estimate_counts_the_masked_steps_copies():
    """--dry_run's estimate: a fused step copies the parameter it steps and its optimizer state
    (fused_optim.step_masked, one parameter at a time): AdamW's two float32 moments and float32
    step, so 4 + 8 bytes per element and 4 bytes for the largest parameter, beside AdamW's two
    float32 temporaries of it (by hand)."""
    from library.config.parse import parse_args
    from library.models import loading
    from library.training import memory_estimate as me

    def est(*extra):
        return me.estimate(parse_args("train_dreambooth", [
            "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", "unused",
            "--resolution", "64", "--max_train_steps", "1", "--dry_run", "--optimizer_type",
            "AdamW", *extra]), "dreambooth")

    unet = loading.load_model_bundle("tiny-sd15").unet
    largest = max(p.numel() for p in unet.parameters())
    assert est("--fused_backward_pass").step_temporaries == 2 * 4 * largest + 12 * largest + 4
