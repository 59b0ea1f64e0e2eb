"""How one global batch's gradient becomes one optimizer update.

The training loop calls ``stepper.backward(loss, last_micro_step=..., loss_finite=...)`` for each
micro-step of this process and ``stepper.step(read)`` once per global batch (every process, every
step, even with an empty share), the same way for every stepper. ``loss_finite`` (last micro-step
only) is the global batch's summed loss's finiteness as a 0-d bool device tensor, and ``read``
the step's one host read (library/training/step_sync.py ``Pending.read``, after the step's
collective): step() calls it once, with what it still has to decide on the device (the plain
stepper's gradient norm, the hook steppers' flags), before any update that depends on it, and
returns the ``StepRead``; step() called with no read reads its own values here and returns None.
``make_stepper`` picks the stepper from the options:

- ``PlainStepper`` keeps every gradient until the end of the step: sum across processes (with
  the ``grad_sum`` its strategy gives it; none where DDP's reducer or FSDP's reduce-scatter summed
  them during the backward), clip the global norm, one optimizer and one scheduler step.
- ``FusedStepper`` (``fused_backward_pass``) steps each parameter inside its
  ``register_post_accumulate_grad_hook`` during the last micro-step's backward and frees its
  gradient at once, so all gradients never exist together. One optimizer (and one scheduler)
  per parameter, the same math as the unfused optimizer for optimizers without global state.
  The non-finite guard decides on the device: every unit's update is kept only where the summed
  loss and the summed gradient norms of this and every earlier unit are finite
  (``fused_optim.step_masked``), and step()'s one read says which units kept theirs.
- ``GroupedStepper`` (``fused_optimizer_groups = N``) does the same per group of parameters,
  contiguous in backward order: a group is stepped as soon as all its gradients are complete.

With ``full_bf16`` / ``full_fp16`` the trained weights are bf16 / fp16: every stepper steps them
through ``fused_optim.step_optimizer`` (float32 per-parameter update, float32 state, bf16 written
back with stochastic rounding); ``full_fp16`` (plain stepper only) scales the loss with
``LossScaler`` and skips a step whose summed gradients overflow.

Steppers that step inside the backward pass (``steps_in_backward``) need a backward in the last
micro-step of every process: a process with an empty share there runs a zero-weight backward
(the trainer does it), so that every process's hooks fire for the same parameters in the same
order (the autograd order of the same graph) and join the same gradient all-reduces. With
gradient accumulation the hooks step only in the last micro-step: the memory of the gradients
is saved only then (the earlier micro-steps accumulate them as usual).
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import math
from typing import TYPE_CHECKING, ContextManager, Protocol

import torch

from library.accelerator import BUCKETED_SUM
from library.config.parse import required
from library.models.placement import trained_precision
from library.training import fused_optim
from library.training.fused_optim import FusedOptionError, global_state_reason
from library.training.nonfinite import describe
from library.training.optim import build_optimizer, build_scheduler, check_optimizer, schedule_spec

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")


class Stepper(Protocol):
    """What the loop, the training state and the strategies use of a stepper."""

    steps_in_backward: bool      # it steps inside the last micro-step's backward (hooks)
    nonfinite: str | None        # why the last step() made no update (non-finite), or None
    partial_update: bool         # that step had already updated some parameters (hooks)
    optimizer: object            # the (first) optimizer, for reports and the sharded state
    scheduler: object            # the (first) scheduler

    @property
    def schedulers(self) -> list: ...  # every scheduler, each once

    def current_lr(self) -> float: ...

    def backward(self, loss, last_micro_step: bool = True, loss_finite=None) -> None: ...

    def step(self, read=None):  # read: (norm, flags) device tensors -> StepRead; returns it
        ...

    def skip(self) -> None: ...

    def eval_mode(self) -> ContextManager: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


def _is_schedule_free(optimizer) -> bool:
    return callable(getattr(optimizer, "eval", None)) and callable(getattr(optimizer, "train", None)) \
        and "train_mode" in optimizer.param_groups[0]


class LossScaler:
    """Dynamic loss scaling for ``full_fp16`` (torch's GradScaler rule, for fp16 gradients, which
    GradScaler refuses to unscale): the loss is multiplied by ``scale`` before backward; a step
    whose gradients hold an inf or NaN is skipped and the scale multiplied by ``backoff_factor``;
    after ``growth_interval`` steps in a row without overflow the scale is multiplied by
    ``growth_factor``. Every process sees the same summed gradients, so all decide alike."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0      # steps without overflow since the last change of scale
        self.skipped = 0         # steps skipped in this run

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])


def check_same_settings(optimizer, saved: dict) -> None:
    """Before ``optimizer.load_state_dict(saved)``, which would silently replace this run's
    constructor settings (e.g. Adafactor's relative_step, whose default changed) by the saved
    ones: the same options must have built the same optimizer. Dynamic group entries (the lr, the
    D-Adaptation / Prodigy / schedule-free estimates) are not constructor arguments and are left
    alone. ValueError: the resume code names the state directory around the message."""
    args = set(inspect.signature(type(optimizer).__init__).parameters) - {"self", "params", "lr"}
    for now, then in zip(optimizer.param_groups, saved.get("param_groups", [])):
        for key in sorted(args & set(now) & set(then)):
            if now[key] != then[key] and not (now[key] is None and then[key] is None):
                raise ValueError(f"{type(optimizer).__name__} {key} is {now[key]!r} in this run but "
                                 f"{then[key]!r} in the saved state (a default changed, or the "
                                 "optimizer_args); give optimizer_args "
                                 f"{key}={then[key]!r} to continue it")


def grad_norm_fp32_tensor(params):
    """The global L2 norm of the gradients, accumulated in float32 (inf or NaN when a gradient
    holds one), as a 0-d tensor on the device (no host read): fp16/bf16 norms of scaled
    gradients would overflow or lose digits. None: no gradient."""
    total = None
    for p in params:
        if p.grad is not None:
            sq = torch.linalg.vector_norm(p.grad, dtype=torch.float32) ** 2
            total = sq if total is None else total + sq.to(total.device)
    return None if total is None else total.sqrt()


def grad_norm_fp32(params) -> float:
    """``grad_norm_fp32_tensor`` read to the host (one device sync)."""
    norm = grad_norm_fp32_tensor(params)
    return 0.0 if norm is None else float(norm)


class PlainStepper:
    steps_in_backward = False
    partial_update = False

    def __init__(self, accelerator, optimizer, scheduler, params, max_grad_norm: float,
                 precision: str = "float32", loss_scaler: LossScaler | None = None,
                 grad_sum=None, optimizer_in_state: bool = True):
        self.accelerator = accelerator
        # grad_sum (library/accelerator.py BucketedSum, chosen by the strategy): what
        # step() sums the gradients across processes with; None: nothing to sum (one process, or
        # DDP's reducer / FSDP's reduce-scatter summed them during the backward)
        self.grad_sum = grad_sum
        # optimizer_in_state False (fsdp): the optimizer state is written sharded by the strategy's
        # part of the training state (library/distributed/fsdp.py), not by state_dict()
        self.optimizer_in_state = optimizer_in_state
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.params = params
        self.max_grad_norm = max_grad_norm
        inner = getattr(optimizer, "optimizer", optimizer)
        self._schedule_free = inner if _is_schedule_free(inner) else None
        if self._schedule_free is not None:
            self._schedule_free.train()  # schedule-free: train iterates while stepping
        # full_bf16 / full_fp16: the weights are bf16/fp16, stepped in float32 one parameter at a
        # time (fused_optim.step_optimizer), bf16 with stochastic rounding; fp16 with loss scaling.
        self.precision = precision
        self.loss_scaler = loss_scaler
        self.nonfinite: str | None = None  # why the last step() made no update (non-finite)
        self._generator: torch.Generator | None = None
        if precision != "float32":
            self._generator = fused_optim.stochastic_round_generator(params[0].device)

    @property
    def schedulers(self) -> list:
        return [self.scheduler]

    def current_lr(self) -> float:
        """The learning rate the next step uses (first param group)."""
        return self.scheduler.get_last_lr()[0]

    def close(self) -> None:
        pass

    def backward(self, loss, last_micro_step: bool = True, loss_finite=None) -> None:
        # loss_finite: unused (the step's read decides before step() updates anything)
        if self.loss_scaler is not None:
            # our scaler, not Accelerate's (whose GradScaler cannot unscale fp16 gradients)
            (loss * self.loss_scaler.scale).backward()
        else:
            self.accelerator.backward(loss)

    def state_dict(self) -> dict:
        """Everything a resume needs to continue the updates exactly (optimizer(s), scheduler;
        with full_bf16/full_fp16 the rounding generator and the loss scale)."""
        state = {"scheduler": self.scheduler.state_dict()}
        if self.optimizer_in_state:  # fsdp: library/distributed/fsdp.py save_sharded writes the optimizer state
            state["optimizer"] = self.optimizer.state_dict()
        if self._generator is not None:
            state["rounding_generator"] = self._generator.get_state()
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer_in_state:  # fsdp: library/distributed/fsdp.py load_sharded reads the optimizer state
            check_same_settings(self.optimizer, state["optimizer"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.precision != "float32":
            fused_optim.restore_float_state(getattr(self.optimizer, "optimizer", self.optimizer),
                                            state["optimizer"])
            if "rounding_generator" not in state:
                raise ValueError("the saved state was not trained with full_bf16/full_fp16")
            assert self._generator is not None  # made with the low precision
            self._generator.set_state(state["rounding_generator"].cpu())
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

    @contextlib.contextmanager
    def eval_mode(self):
        """Weights to save or sample from: schedule-free optimizers switch to their averaged
        (eval) iterate and back; other optimizers need nothing. Every process enters it, so all
        ranks keep identical weights."""
        if self._schedule_free is None:
            yield
            return
        self._schedule_free.eval()
        try:
            yield
        finally:
            self._schedule_free.train()

    def step(self, read=None):
        # Sum, then clip the global batch's gradient (after accumulation and summation, so any
        # split of the global batch clips alike), all enqueued on the device; then the step's
        # one host read (``read``, see the module docstring) decides. Under fsdp the gradients are already summed shards
        # (DTensors); the norm is taken over all shards.
        # A non-finite norm (library/training/nonfinite.py) leaves everything as it was before the step
        # (no update, no scheduler step, gradients kept) and says so in ``nonfinite``: every
        # process sees the same summed gradients, so all decide alike.
        self.nonfinite = None
        if self.grad_sum is not None:
            self.grad_sum.after_backward(self.params)
        if self.precision != "float32":
            norm_t = grad_norm_fp32_tensor(self.params)  # the non-finite guard needs it too
        else:
            norm_t = self._grad_norm()
        if read is None:  # outside the loop: the norm read here
            got, norm = None, (None if norm_t is None else float(norm_t))
        else:
            got = read(norm_t)
            if not got.finite:
                return got  # the loop's guard (a non-finite loss): nothing touched, the loop says why
            norm = got.norm
        if self.precision != "float32":
            if not self._step_low_precision(0.0 if norm is None else norm):
                return got
        else:
            if norm is not None and not math.isfinite(norm):
                self.nonfinite = f"gradient norm {_describe(norm)}"
                return got
            self.optimizer.step()
        self.scheduler.step()  # once per optimizer step, never per micro-step or process
        self.optimizer.zero_grad(set_to_none=True)
        return got

    def _grad_norm(self):
        """The global gradient norm (clipping to max_grad_norm when set) as a 0-d tensor, or
        None where a loss scaler owns overflow (mixed_precision fp16: Accelerate's GradScaler
        skips the step and lowers the scale, its documented behaviour) or no parameter has a
        gradient."""
        if getattr(self.accelerator, "scaler", None) is not None:
            if self.max_grad_norm and self.max_grad_norm > 0:
                self.accelerator.clip_grad_norm_(self.params, self.max_grad_norm)
            return None
        if self.max_grad_norm and self.max_grad_norm > 0:
            norm = self.accelerator.clip_grad_norm_(self.params, self.max_grad_norm)
        else:
            grads = [p.grad for p in self.params if p.grad is not None]
            if not grads:
                return None
            norm = torch.nn.utils.get_total_norm(grads)
        full = getattr(norm, "full_tensor", None)  # fsdp: a replicated DTensor
        return full() if callable(full) else norm

    def skip(self) -> None:
        """``on_nonfinite = "skip"``: drop this step's gradients without an update; the scheduler
        steps (the step counts, so the schedule stays aligned with the step count)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.nonfinite = None

    def _step_low_precision(self, norm: float) -> bool:
        """bf16/fp16 gradients: the norm (and fp16's overflow check) in float32; the loss scale
        and the clipping factor are applied to each float32 gradient copy, not to the
        low-precision gradients, so neither loses digits. False: a non-finite norm (bf16), no
        update (``nonfinite`` says why)."""
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        clip = bool(self.max_grad_norm and self.max_grad_norm > 0)
        if self.loss_scaler is not None:
            overflow = not math.isfinite(norm)
            self.loss_scaler.update(overflow)
            if overflow:
                logger.warning(f"full_fp16: gradient overflow at loss scale {scale:g}: step "
                               f"skipped, loss scale now {self.loss_scaler.scale:g}")
                return True  # the scaler's skip is a step (the scheduler steps, as before)
        elif not math.isfinite(norm):
            self.nonfinite = f"gradient norm {_describe(norm)}"
            return False
        factor = 1.0 / scale
        if clip:
            # torch.nn.utils.clip_grad_norm_'s coefficient, on the unscaled norm
            factor *= min(1.0, self.max_grad_norm / (norm / scale + 1e-6))
        fused_optim.step_optimizer(getattr(self.optimizer, "optimizer", self.optimizer),
                                   self._generator, factor)
        return True


def _describe(value: float) -> str:
    return describe(value)


class _HookStepper:
    """Steps units of parameters (one parameter, or one group) inside the backward pass.

    Each unit has its own optimizer over that unit's parameters, with the original param
    groups' hyperparameters, and its own scheduler; all schedulers are stepped once per
    ``step()``, so every unit follows the unfused run's learning-rate schedule.

    Several processes: a unit's gradient is the sum over the processes, made by the ``grad_sum``
    the strategy gives (library/accelerator.py ``BucketedSum``; None: one process,
    nothing summed). With
    ``reductions_in_flight`` k >= 1 (``fused_reductions_in_flight``) the unit's last hook only
    launches that sum (``grad_sum.launch``, ``async_op``) and the backward goes on; the unit is
    stepped when its sum is waited for, oldest first: when k sums are in flight and another unit
    is complete, and at the end of ``backward()``. So the communication overlaps the rest of
    the backward, at most k sums are in flight, and k + 1 units' gradients are alive (k summed
    or being summed, one being filled; one more where the backward's order crosses a unit
    boundary, as a layer's bias before its weight, which a synchronous sum meets too). The waits happen at the same hook in every
    process (counted, never polled), so all processes step alike. The sums, the order of the
    unit steps and the non-finite guard are those of k = 0, which sums each unit synchronously
    inside its hook (one process: no sums at all).

    The non-finite guard, with no host read inside the backward: a device flag starts as the
    summed loss's finiteness (``loss_finite``, the same in every process) and is and-ed with
    each unit's summed gradient norm's finiteness before the unit is stepped; the unit's update
    is kept only where the flag is true (``fused_optim.step_masked``: the weights and optimizer
    state written back with ``torch.where``, so a finite step is bit for bit the unmasked one).
    So no unit is updated from a non-finite gradient, nor after one, as when each unit was read.
    step() makes the step's one read (the loss, the number of units that kept their update and
    the first non-finite norm) and takes back on the host what the device could not (optimizer
    state the masked step created, Python values, the stochastic-rounding generator).
    """

    steps_in_backward = True

    def __init__(self, accelerator, units, optimizers, schedulers, max_grad_norm: float,
                 first_param=None, reductions_in_flight: int = 0, grad_sum=None):
        self.accelerator = accelerator
        self.units = units                  # list of parameter lists, in backward order
        self.optimizers = optimizers        # one per unit
        self.schedulers = schedulers        # one per unit
        self.max_grad_norm = max_grad_norm
        self.params = [p for u in units for p in u]
        self.unit_of = {id(p): i for i, u in enumerate(units) for p in u}
        # the learning rate current_lr() reports: the original first group's first parameter
        self._lr_unit = self.unit_of[id(first_param)] if first_param is not None else 0
        self._lr_group = 0
        if first_param is not None:
            for gi, g in enumerate(optimizers[self._lr_unit].param_groups):
                if any(q is first_param for q in g["params"]):
                    self._lr_group = gi
        self._generator = fused_optim.stochastic_round_generator(self.params[0].device)
        self._scratch = fused_optim.Scratch()  # step_masked's copies, reused
        # The non-finite guard: a unit whose summed gradient is non-finite keeps no update, nor
        # does any later unit of that step (``nonfinite`` says why); ``partial_update``: units
        # before it kept theirs.
        self.nonfinite: str | None = None
        self.partial_update = False
        self._final = False
        self._device = self.params[0].device
        self._low = self._low_precision()
        self._begin_step(None)
        self.reductions_in_flight = reductions_in_flight
        self.grad_sum = grad_sum               # BucketedSum, or None: nothing to sum
        self._overlap = False                # this backward launches sums asynchronously
        self._in_flight: collections.deque = collections.deque()  # (unit, UnitReduction), oldest first
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    # the trainer keeps these names
    @property
    def optimizer(self):
        return self.optimizers[self._lr_unit]

    @property
    def scheduler(self):
        return self.schedulers[self._lr_unit]

    def current_lr(self) -> float:
        return self.schedulers[self._lr_unit].get_last_lr()[self._lr_group]

    def _begin_step(self, loss_finite) -> None:
        """A step's bookkeeping: nothing stepped yet; the device flags (``loss_finite`` None:
        no loss to check, e.g. a direct caller)."""
        self._pending = [0] * len(self.units)     # hooks fired in the final backward, per unit
        self._stepped = [False] * len(self.units)
        # per unit stepped, in stepping order: its fused_optim.Undo records, the guard's flag
        # after it (device), its gradient norm (device), the rounding generator's state before it
        self._undo: list[list] = []
        self._oks: list = []
        self._norms: list = []
        self._rounding: list = []
        self._ok = torch.ones((), dtype=torch.bool, device=self._device) if loss_finite is None \
            else loss_finite.to(self._device)     # the guard's running device flag

    def backward(self, loss, last_micro_step: bool = True, loss_finite=None) -> None:
        if last_micro_step:
            self._begin_step(loss_finite)
        self._final = last_micro_step
        self._overlap = last_micro_step and self.reductions_in_flight > 0 \
            and self.grad_sum is not None and self.grad_sum.across_processes
        try:
            self.accelerator.backward(loss)
            # every sum launched in this backward is waited for and its unit stepped before
            # backward() returns: step() and skip() find the state of the synchronous sums
            while self._in_flight:
                self._finish_oldest()
        finally:
            # after a failure inside the backward the run ends: drop the sums in flight (the
            # process group keeps its own references to their buffers until they complete)
            self._in_flight.clear()
            self._final = self._overlap = False

    def _hook(self, p) -> None:
        if not self._final:
            return  # an earlier micro-step: accumulate as usual
        u = self.unit_of[id(p)]
        self._pending[u] += 1
        if self._pending[u] == len(self.units[u]):
            if self._overlap:
                self._launch(u)
            else:
                self._step_unit(u)

    def _launch(self, u: int) -> None:
        """Unit ``u`` is complete: launch its sum, after stepping the oldest units in flight
        while ``reductions_in_flight`` of them are (first in, first stepped)."""
        while len(self._in_flight) >= self.reductions_in_flight:
            self._finish_oldest()
        self._in_flight.append((u, self.grad_sum.launch(self.units[u])))

    def _finish_oldest(self) -> None:
        u, reduction = self._in_flight.popleft()
        reduction.wait()  # the summed gradients are in p.grad again
        self._step_summed(u)

    def _step_unit(self, u: int) -> None:
        """Sum unit ``u``'s gradients across processes now (synchronously), then step it."""
        if self.grad_sum is not None:
            self.grad_sum.unit(self.units[u])
        self._step_summed(u)

    def _step_summed(self, u: int) -> None:
        """Step unit ``u`` on its summed gradients, kept only where the guard's flag stays true
        (no host read), then free them."""
        params = self.units[u]
        grads = [p.grad for p in params if p.grad is not None]
        ok = self._ok
        if grads:
            # the summed gradient: every process gets the same norm and the same flag
            total = torch.nn.utils.get_total_norm(grads)
            ok = ok & torch.isfinite(total)  # a NaN/inf element, or an overflowing norm
            if self.max_grad_norm and self.max_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None],
                                                     self.max_grad_norm, total)
            norm = total.to(torch.float32)
        else:
            norm = torch.zeros((), dtype=torch.float32, device=self._device)
        if self._low:  # full_bf16: where the rounding stream stood, should this unit be taken back
            self._rounding.append(self._generator.get_state())
        self._undo.append(fused_optim.step_masked(self.optimizers[u], ok, self._generator,
                                                  self._scratch))
        self._oks.append(ok)
        self._norms.append(norm)
        self._ok = ok
        for p in params:
            p.grad = None
        self._stepped[u] = True

    def _flags(self):
        """(units that kept their update, the first non-finite unit norm) as one device vector."""
        if not self._oks:
            return torch.zeros(2, dtype=torch.float32, device=self._device)
        norms = torch.stack(self._norms)
        first_bad = torch.argmax((~torch.isfinite(norms)).to(torch.int32))
        return torch.stack([torch.stack(self._oks).sum().to(torch.float32), norms[first_bad]])

    def step(self, read=None):
        # Units whose hooks did not all fire (a parameter outside this step's graph) are stepped
        # now, in unit order; the same in every process, since all run the same graph.
        for u in range(len(self.units)):
            if not self._stepped[u]:
                self._step_unit(u)
        self.nonfinite, self.partial_update = None, False
        flags = self._flags()
        if read is None:  # outside the loop: the flags read here
            got, loss_ok = None, True
            kept_f, bad = flags.tolist()
        else:
            got = read(None, flags)  # the step's one read
            loss_ok = got.finite
            kept_f, bad = got.flags
        kept, undo, rounding = int(kept_f), self._undo, self._rounding
        self._begin_step(None)
        if kept < len(undo) or not loss_ok:
            # the first units (in step order) kept their updates, the rest were masked on the
            # device: take back what the device could not; no scheduler step (the trainer stops
            # or skip()s)
            for records in undo[kept:]:
                for r in records:
                    fused_optim.undo(r)
            if kept < len(rounding):
                self._generator.set_state(rounding[kept])
            self.partial_update = kept > 0
            if loss_ok:  # the loop reports a non-finite loss itself
                self.nonfinite = f"gradient norm {_describe(bad)}"
            return got
        for s in self.schedulers:
            s.step()
        return got

    def skip(self) -> None:
        """``on_nonfinite = "skip"``: the units not yet stepped get no update, their gradients
        are dropped; the schedulers step (the step counts)."""
        for p in self.params:
            p.grad = None
        for s in self.schedulers:
            s.step()
        self._begin_step(None)
        self.nonfinite = None
        self.partial_update = False

    def _low_precision(self) -> bool:
        return any(p.dtype in (torch.bfloat16, torch.float16) for p in self.params)

    def state_dict(self) -> dict:
        state = {"optimizers": [o.state_dict() for o in self.optimizers],
                 "schedulers": [s.state_dict() for s in self.schedulers]}
        if self._low_precision():  # full_bf16: stochastic rounding continues exactly
            state["rounding_generator"] = self._generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        opts, scheds = state["optimizers"], state["schedulers"]
        if len(opts) != len(self.optimizers) or len(scheds) != len(self.schedulers):
            # ValueError: the resume code names the state directory around this message
            raise ValueError(f"the saved state has {len(opts)} optimizers, this run "
                             f"{len(self.optimizers)} (other parameters or fused settings)")
        for o, s in zip(self.optimizers, opts):
            check_same_settings(o, s)
            o.load_state_dict(s)
        for sc, s in zip(self.schedulers, scheds):
            sc.load_state_dict(s)
        if self._low_precision():
            for o, s in zip(self.optimizers, opts):
                fused_optim.restore_float_state(o, s)
            if "rounding_generator" not in state:
                raise ValueError("the saved state was not trained with full_bf16")
            self._generator.set_state(state["rounding_generator"].cpu())

    @contextlib.contextmanager
    def eval_mode(self):
        yield  # optimizers with train/eval iterates (schedule-free) are rejected for fused runs

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class FusedStepper(_HookStepper):
    """``fused_backward_pass``: one unit per parameter."""


class GroupedStepper(_HookStepper):
    """``fused_optimizer_groups = N``: N contiguous units."""


# -- checks and construction ------------------------------------------------------------------
def fused_mode(opts: Options) -> str | None:
    """The option that makes the stepper step inside backward, or None."""
    fused = opts.fused_backward_pass
    groups = opts.fused_optimizer_groups or 0
    blockwise = opts.blockwise_fused_optimizers
    if fused + bool(groups) + blockwise > 1:
        return "both"
    if fused:
        return "fused_backward_pass"
    if groups:
        return "fused_optimizer_groups"
    if blockwise:  # FLUX.1 / SD3: one unit per parameter group, which the method makes per block
        return "blockwise_fused_optimizers"
    return None


def check_stepper_options(opts: Options) -> None:
    """Combinations that cannot be fused, rejected before any weight is loaded."""
    check_precision_options(opts)
    mode = fused_mode(opts)
    if mode is None:
        return
    if mode == "both":
        given = [n for n in ("fused_backward_pass", "fused_optimizer_groups",
                             "blockwise_fused_optimizers") if getattr(opts, n)]
        raise FusedOptionError(f"{' and '.join(given)} cannot be combined: use one "
                               "(fused_backward_pass steps every parameter separately)")
    if opts.mixed_precision == "fp16" or opts.full_fp16:
        raise FusedOptionError(f"{mode} cannot be used with fp16: loss scaling needs a global "
                               "overflow check of all gradients before any step; use bf16 or no")
    cls, _, _ = check_optimizer(opts.optimizer_type, opts.optimizer_args)
    reason = global_state_reason(cls)
    if reason:
        raise FusedOptionError(f"{mode} cannot be used with optimizer_type {opts.optimizer_type}: "
                               f"{reason}; use an optimizer without global state (AdamW, "
                               "Adafactor, Lion, SGDNesterov, 8-bit ones) or drop the option")


def check_precision_options(opts: Options) -> None:
    """full_bf16 / full_fp16 combinations, before any weight is loaded."""
    bf16, fp16 = opts.full_bf16, opts.full_fp16
    if bf16 and fp16:
        raise FusedOptionError("full_bf16 and full_fp16 cannot be combined: choose one weight dtype")
    if not (bf16 or fp16):
        return
    name, want = ("full_bf16", "bf16") if bf16 else ("full_fp16", "fp16")
    if opts.mixed_precision != want:
        raise FusedOptionError(f"{name} needs mixed_precision {want} (the frozen weights and the "
                               f"computation in {want}, as sd-scripts requires); got "
                               f"{opts.mixed_precision}")
    cls, _, _ = check_optimizer(opts.optimizer_type, opts.optimizer_args)
    reason = global_state_reason(cls)
    if reason:
        raise FusedOptionError(f"{name} cannot be used with optimizer_type {opts.optimizer_type}: "
                               f"{want} weights are stepped in float32 one parameter at a time, "
                               f"and {reason}; use AdamW, Adafactor, Lion, SGDNesterov or an "
                               "8-bit one, or drop the option")


def _split_contiguous(params, n: int) -> list[list]:
    """``params`` (backward order) in ``n`` contiguous chunks of about equal element counts."""
    n = max(1, min(n, len(params)))
    total = sum(p.numel() for p in params)
    chunks: list[list] = []
    cur: list = []
    acc = 0
    for i, p in enumerate(params):
        cur.append(p)
        acc += p.numel()
        left_params, left_chunks = len(params) - i - 1, n - len(chunks) - 1
        if left_chunks > 0 and (acc >= total * (len(chunks) + 1) / n or left_params == left_chunks):
            chunks.append(cur)
            cur = []
    chunks.append(cur)
    return [c for c in chunks if c]


def step_units(param_groups, params, mode: str | None, n_groups: int | None):
    """(trained parameters in group order, each one's group index, the units the stepper steps
    together): one unit of all of them for the plain step, one per parameter for
    fused_backward_pass, ``n_groups`` contiguous ones for fused_optimizer_groups, in backward
    order. The one rule for ``make_stepper`` and the memory estimate."""
    trainable = {id(p) for p in params if p.requires_grad}
    group_of, unique = {}, []
    for gi, g in enumerate(param_groups):
        for p in g["params"]:
            if id(p) in trainable and id(p) not in group_of:
                group_of[id(p)] = gi
                unique.append(p)
    if mode is None:
        return unique, group_of, [unique]
    # Backward order is about the reverse of creation (registration) order.
    backward_order = list(reversed(unique))
    if mode == "fused_backward_pass":
        return unique, group_of, [[p] for p in backward_order]
    if mode == "blockwise_fused_optimizers":  # the method's groups: one per block (FullMethod)
        units = [[p for p in reversed(g["params"]) if id(p) in trainable and group_of[id(p)] == gi]
                 for gi, g in reversed(list(enumerate(param_groups)))]
        return unique, group_of, [u for u in units if u]
    if n_groups is None:
        raise ValueError(f"{mode}: no group count (fused_optimizer_groups)")
    return unique, group_of, _split_contiguous(backward_order, n_groups)


def build_run_scheduler(opts: Options, optimizer, *, warmup_steps: int, total_steps: int):
    """The run's learning-rate scheduler (``lr_scheduler`` and its options) over ``optimizer``."""
    return build_scheduler(schedule_spec(opts, warmup_steps=warmup_steps, total_steps=total_steps),
                           optimizer)


def make_stepper(accelerator, opts: Options, param_groups, params, *, warmup_steps: int, total_steps: int,
                 grad_sum=BUCKETED_SUM, optimizer_in_state: bool = True):
    """The stepper for these options: plain, fused (per parameter) or grouped. ``grad_sum``: how
    it sums the gradients across processes (library/accelerator.py ``BucketedSum``;
    None: nothing to sum), chosen by the strategy (library/distributed/strategy.py
    ``make_stepper``); direct callers get the bucketed sum (nothing in one process).
    ``optimizer_in_state`` False: the strategy writes the optimizer state itself (FSDP's shards;
    plain stepper only, checked before)."""
    def scheduler_for(optimizer):
        return build_run_scheduler(opts, optimizer, warmup_steps=warmup_steps,
                                   total_steps=total_steps)

    mode = fused_mode(opts)
    if mode is None:
        check_precision_options(opts)
        optimizer = build_optimizer(opts.optimizer_type, opts.optimizer_args, param_groups,
                                    opts.learning_rate)
        precision = trained_precision(opts)
        if precision == "float16":
            # Accelerate's wrapper would route the step through its GradScaler, which refuses fp16
            # gradients: full_fp16 steps the optimizer itself, with its own LossScaler.
            loss_scaler = LossScaler()
            logger.info(f"full_fp16: fp16 weights, float32 optimizer state, dynamic loss scale "
                        f"from {loss_scaler.scale:g} (a step whose gradients overflow is skipped)")
        else:
            loss_scaler = None
            optimizer = accelerator.prepare(optimizer)
            if precision == "bfloat16":
                logger.info("full_bf16: bf16 weights and gradients, float32 optimizer state, "
                            "updates written back with stochastic rounding")
        scheduler = scheduler_for(getattr(optimizer, "optimizer", optimizer))
        return PlainStepper(accelerator, optimizer, scheduler, params, opts.max_grad_norm,
                            precision=precision, loss_scaler=loss_scaler,
                            grad_sum=grad_sum, optimizer_in_state=optimizer_in_state)
    check_stepper_options(opts)
    unique, group_of, units = step_units(param_groups, params, mode, opts.fused_optimizer_groups)
    if mode == "fused_optimizer_groups":
        n = required(opts.fused_optimizer_groups, "fused_optimizer_groups")
        if len(units) < n:
            logger.warning(f"fused_optimizer_groups {n}: only {len(units)} trainable parameters, "
                           f"using {len(units)} groups")
    optimizers: list = []
    schedulers: list = []
    for unit in units:
        ids = {id(p) for p in unit}
        groups = []
        for gi, g in enumerate(param_groups):
            ps = [p for p in g["params"] if id(p) in ids and group_of[id(p)] == gi]
            if ps:
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ps})
        opt = build_optimizer(opts.optimizer_type, opts.optimizer_args, groups, opts.learning_rate,
                              warn=not optimizers)  # one warning, not one per optimizer
        optimizers.append(opt)
        schedulers.append(scheduler_for(opt))
    if opts.max_grad_norm and opts.max_grad_norm > 0:
        what = {"fused_backward_pass": "each parameter's gradient",
                "blockwise_fused_optimizers": "each block's gradients"}.get(mode, "each group's gradients")
        logger.info(f"{mode}: global-norm clipping cannot be fused; max_grad_norm "
                    f"{opts.max_grad_norm} clips {what} separately")
    if opts.gradient_accumulation_steps > 1:
        logger.info(f"{mode}: with gradient_accumulation_steps {opts.gradient_accumulation_steps} "
                    "parameters are stepped in the last micro-step only; gradient memory is saved "
                    "only in that micro-step")
    if trained_precision(opts) == "bfloat16":
        logger.info(f"full_bf16 with {mode}: bf16 weights and gradients, float32 optimizer state, "
                    "updates written back with stochastic rounding")
    cls = FusedStepper if mode == "fused_backward_pass" else GroupedStepper
    logger.info(f"{mode}: {len(units)} optimizer{'s' if len(units) != 1 else ''} stepped inside "
                "the backward pass")
    return cls(accelerator, units, optimizers, schedulers, opts.max_grad_norm,
               first_param=unique[0] if unique else None,
               reductions_in_flight=opts.fused_reductions_in_flight, grad_sum=grad_sum)
