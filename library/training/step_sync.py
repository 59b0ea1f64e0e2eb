"""A step's one host read and its one small collective (docs/PERFORMANCE.md, "Host syncs").

On a GPU every read of a device value by the host (``.item()``, ``float()``, ``.tolist()``,
``.cpu()``) waits until the device has finished everything queued before it, so the host stops
queueing work. A training step needs one such read: the non-finite guard
(library/training/nonfinite.py) must know, before the update, whether the global batch's loss and
gradient norm are finite. Everything else the host uses of the step (the loss for ``loss_log``, the
progress bar, the trackers and the hooks; which signal, if any, every process stops for) comes
from that same read, and everything the processes must agree on goes through one small
all-reduce just before it:

    loss_sum = add_loss(loss_sum, loss)      per micro-step, on the device (float64)
    pending = gather(signals, device, loss_sum)
                                             once per step, before the last backward: the collective
    stepper.backward(loss, last_micro_step=True, loss_finite=pending.loss_finite)
    read = stepper.step(pending.read)        the stepper makes the read, once, before it decides

``gather`` sums ``loss_sum`` across processes together with one counter per stop signal
(stop_signals.StopSignals) in one all-reduce (no read: ``loss_finite`` is the summed loss's
finiteness as a device flag, which steppers that update inside the backward gate their updates
on); ``read`` appends what the stepper still needs to know on the host (the already summed,
identical, gradient norm; the hook steppers' device flags) and reads the result to the host
once. ``agree`` is both at once.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from library import accelerator
from library.training.stop_signals import COMMANDS, StopSignals


class StepRead(NamedTuple):
    loss: float           # the global batch's loss (sum over micro-steps and processes)
    norm: float | None    # the gradient norm the stepper checks, or None
    stop: int             # the signal every process stops for after this step (0: none)
    commands: tuple = ()  # control_file commands every process runs after this step, in order
    flags: tuple = ()     # the stepper's own device values, read with the rest (floats)

    @property
    def finite(self) -> bool:
        """The loss is finite: the step may update (library/training/nonfinite.py)."""
        return math.isfinite(self.loss)


def value_dtype(device):
    """float64 (the loss is summed as the host used to sum Python floats) where the device
    has it."""
    return torch.float32 if getattr(device, "type", device) == "mps" else torch.float64


def add_loss(total, loss):
    """``total + loss`` on the device, in float64 (``total`` None: the first micro-step)."""
    v = loss.detach().reshape(()).to(value_dtype(loss.device))
    return v if total is None else total + v


def zero_loss(device):
    """The loss sum of a process with no micro-step in this step (an empty share)."""
    return torch.zeros((), dtype=value_dtype(device), device=device)


class Pending:
    """The step's collective, made (``gather``); its one read, to come (``read``)."""

    def __init__(self, device, n: int, parts: list, multi: bool, signum: int, signals: tuple,
                 requested: tuple, names: tuple):
        self.device, self.n, self.parts, self.multi = device, n, parts, multi
        self.signum, self.signals, self.requested, self.names = signum, signals, requested, names

    @property
    def loss_finite(self):
        """Whether the summed loss is finite, as a 0-d bool device tensor (no read); None
        without a loss."""
        return torch.isfinite(self.parts[0][0]) if self.n else None

    def read(self, norm=None, flags=None) -> StepRead:
        """The read: the summed loss, the agreed signal and commands, ``norm`` (a 0-d device
        tensor, or None) and ``flags`` (a device vector, or None: ``StepRead.flags``)."""
        sums, rest, stop, commands = self.values(along=norm, extra=flags)
        n_flags = 0 if flags is None else flags.numel()
        norm_v = rest[0] if norm is not None else None
        return StepRead(sums[0], norm_v, stop, commands,
                        tuple(rest[len(rest) - n_flags:]) if n_flags else ())

    def values(self, along=None, extra=None):
        """(the summed values, ``along`` and ``extra`` as given, the agreed signal, the agreed
        requests) as host lists, an int and a tuple: the one read."""
        signals, names, n = self.signals, self.names, self.n
        if not self.parts and along is None and extra is None:
            return [], [], self.signum, _in_order(self.requested, names)
        dtype = value_dtype(self.device)
        parts = list(self.parts)
        for t in (along, extra):
            if t is not None:
                parts.append(t.detach().reshape(-1).to(
                    device=parts[0].device if parts else t.device, dtype=dtype))
        host = torch.cat(parts).tolist()  # the read
        sums = host[:n]
        if self.multi:
            counts = host[n:n + len(signals)]
            agreed = max((s for s, c in zip(signals, counts) if c > 0), default=0)
            asked = host[n + len(signals):n + len(signals) + len(names)]
            commands = tuple(name for name, c in zip(names, asked) if c > 0)
            rest = host[n + len(signals) + len(names):]
        else:
            agreed, rest, commands = self.signum, host[n:], _in_order(self.requested, names)
        return sums, rest, agreed, commands


def collect(device, signum: int, signals: tuple, summed=None, requested: tuple = (),
            names: tuple = ()) -> Pending:
    """The one collective: ``summed`` summed over processes, with the stop signals and the
    requests. ``signals``: the stop signals in a fixed order; each process contributes 1 to the
    counter of its pending one, and the agreed signal is the largest with a non-zero count (what
    an all-reduce MAX of the signal numbers gave). ``names``: the possible requests (control_file
    commands) in a fixed order, ``requested`` those this process asks for (the main process
    reads the control file): a request any process made is agreed by all, in ``names`` order.
    With one process, no device work at all."""
    multi = accelerator._is_multi_process()
    parts = [] if summed is None else [summed.reshape(-1).to(value_dtype(device))]
    n = sum(p.numel() for p in parts)
    if multi:
        flags = torch.zeros(len(signals) + len(names), dtype=value_dtype(device), device=device)
        if signum in signals:
            flags[signals.index(signum)].fill_(1)  # a kernel argument: no host-to-device copy
        for r in set(requested):
            flags[len(signals) + names.index(r)].fill_(1)
        parts.append(flags)
        reduced = torch.cat(parts)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        parts = [reduced]
    return Pending(device, n, parts, multi, signum, signals, tuple(requested), tuple(names))


def _in_order(requested, names) -> tuple:
    return tuple(name for name in names if name in requested)


def gather(signals, device, loss_sum, requested: tuple = ()) -> Pending:
    """The step's collective (see the module docstring), every process once per step: with the
    signal pending in ``signals`` (stop_signals.StopSignals; None: no signal) and the
    control_file commands this process read (``requested``: the main process's)."""
    signum = 0 if signals is None else signals.signum
    return collect(device, signum, StopSignals.SIGNALS, loss_sum, tuple(requested), COMMANDS)


def agree(signals, device, loss_sum, norm=None, requested: tuple = ()) -> StepRead:
    """``gather`` and its read at once."""
    return gather(signals, device, loss_sum, requested).read(norm)
