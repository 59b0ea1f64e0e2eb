"""How one global batch's gradient becomes one optimizer update.

The training loop calls ``stepper.backward(loss, last_micro_step=...)`` for each micro-step of
this process and ``stepper.step()`` once per global batch (every process, every step, even with
an empty share). ``make_stepper`` picks the stepper from the options:

- ``PlainStepper`` keeps every gradient until the end of the step: sum across processes, clip the
  global norm, one optimizer and one scheduler step.
- ``FusedStepper`` (``fused_backward_pass``) steps each parameter inside its
  ``register_post_accumulate_grad_hook`` during the last micro-step's backward and frees its
  gradient at once, so all gradients never exist together. One optimizer (and one scheduler)
  per parameter, the same math as the unfused optimizer for optimizers without global state.
- ``GroupedStepper`` (``fused_optimizer_groups = N``) does the same per group of parameters,
  contiguous in backward order: a group is stepped as soon as all its gradients are complete.

Steppers that step inside the backward pass (``steps_in_backward``) need a backward in the last
micro-step of every process: a process with an empty share there runs a zero-weight backward
(the trainer does it), so that every process's hooks fire for the same parameters in the same
order (the autograd order of the same graph) and join the same gradient all-reduces. With
gradient accumulation the hooks step only in the last micro-step: the memory of the gradients
is saved only then (the earlier micro-steps accumulate them as usual).
"""
from __future__ import annotations

import contextlib
import logging

from library import distributed

logger = logging.getLogger("sdtk")


def _is_schedule_free(optimizer) -> bool:
    return callable(getattr(optimizer, "eval", None)) and callable(getattr(optimizer, "train", None)) \
        and "train_mode" in optimizer.param_groups[0]


class PlainStepper:
    steps_in_backward = False

    def __init__(self, accelerator, optimizer, scheduler, params, max_grad_norm: float):
        self.accelerator = accelerator
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.params = params
        self.max_grad_norm = max_grad_norm
        inner = getattr(optimizer, "optimizer", optimizer)
        self._schedule_free = inner if _is_schedule_free(inner) else None
        if self._schedule_free is not None:
            self._schedule_free.train()  # schedule-free: train iterates while stepping

    def current_lr(self) -> float:
        """The learning rate the next step uses (first param group)."""
        return self.scheduler.get_last_lr()[0]

    def backward(self, loss, last_micro_step: bool = True) -> None:
        self.accelerator.backward(loss)

    def state_dict(self) -> dict:
        """Everything a resume needs to continue the updates exactly (optimizer(s), scheduler)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

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

    def step(self) -> None:
        # Sum, then clip the global batch's gradient (after accumulation and summation, so any
        # split of the global batch clips alike).
        distributed.sum_gradients(self.params)
        if self.max_grad_norm and self.max_grad_norm > 0:
            self.accelerator.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()  # once per optimizer step, never per micro-step or process
        self.optimizer.zero_grad(set_to_none=True)


class _HookStepper:
    """Steps units of parameters (one parameter, or one group) inside the backward pass.

    Each unit has its own optimizer over that unit's parameters, with the original param
    groups' hyperparameters, and its own scheduler; all schedulers are stepped once per
    ``step()``, so every unit follows the unfused run's learning-rate schedule.
    """

    steps_in_backward = True

    def __init__(self, accelerator, units, optimizers, schedulers, max_grad_norm: float,
                 first_param=None):
        from library import fused_optim

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
        self._final = False
        self._pending = [0] * len(units)     # hooks fired in the final backward, per unit
        self._stepped = [False] * len(units)
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

    def backward(self, loss, last_micro_step: bool = True) -> None:
        self._final = last_micro_step
        try:
            self.accelerator.backward(loss)
        finally:
            self._final = False

    def _hook(self, p) -> None:
        if not self._final:
            return  # an earlier micro-step: accumulate as usual
        u = self.unit_of[id(p)]
        self._pending[u] += 1
        if self._pending[u] == len(self.units[u]):
            self._step_unit(u)

    def _step_unit(self, u: int) -> None:
        from library import fused_optim

        params = self.units[u]
        if len(params) == 1 and params[0].grad is not None:
            p = params[0]
            if distributed._is_multi_process():
                import torch.distributed as dist

                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        else:
            distributed.sum_gradients(params)
        if self.max_grad_norm and self.max_grad_norm > 0:
            import torch

            grads = [p for p in params if p.grad is not None]
            if grads:
                torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)
        fused_optim.step_optimizer(self.optimizers[u], self._generator)
        for p in params:
            p.grad = None
        self._stepped[u] = True

    def step(self) -> None:
        # Units whose hooks did not all fire (a parameter outside this step's graph) are stepped
        # now, in unit order; the same in every process, since all run the same graph.
        for u in range(len(self.units)):
            if not self._stepped[u]:
                self._step_unit(u)
        for s in self.schedulers:
            s.step()
        self._pending = [0] * len(self.units)
        self._stepped = [False] * len(self.units)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers],
                "schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        opts, scheds = state["optimizers"], state["schedulers"]
        if len(opts) != len(self.optimizers) or len(scheds) != len(self.schedulers):
            # ValueError: the resume code names the state directory around this message
            raise ValueError(f"the saved state has {len(opts)} optimizers, this run "
                             f"{len(self.optimizers)} (other parameters or fused settings)")
        for o, s in zip(self.optimizers, opts):
            o.load_state_dict(s)
        for sc, s in zip(self.schedulers, scheds):
            sc.load_state_dict(s)

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
def fused_mode(opts) -> str | None:
    """The option that makes the stepper step inside backward, or None."""
    fused = bool(getattr(opts, "fused_backward_pass", False))
    groups = getattr(opts, "fused_optimizer_groups", None) or 0
    if fused and groups:
        return "both"
    if fused:
        return "fused_backward_pass"
    if groups:
        return "fused_optimizer_groups"
    return None


def check_stepper_options(opts) -> None:
    """Combinations that cannot be fused, rejected before any weight is loaded."""
    from library.fused_optim import FusedOptionError, global_state_reason
    from library.optim import check_optimizer

    mode = fused_mode(opts)
    if mode is None:
        return
    if mode == "both":
        raise FusedOptionError("fused_backward_pass and fused_optimizer_groups cannot be combined: "
                               "use one (fused_backward_pass steps every parameter separately)")
    if opts.mixed_precision == "fp16" or getattr(opts, "full_fp16", False):
        raise FusedOptionError(f"{mode} cannot be used with fp16: loss scaling needs a global "
                               "overflow check of all gradients before any step; use bf16 or no")
    cls, _, _ = check_optimizer(opts.optimizer_type, opts.optimizer_args)
    reason = global_state_reason(cls)
    if reason:
        raise FusedOptionError(f"{mode} cannot be used with optimizer_type {opts.optimizer_type}: "
                               f"{reason}; use an optimizer without global state (AdamW, "
                               "Adafactor, Lion, SGDNesterov, 8-bit ones) or drop the option")


def _split_contiguous(params, n: int) -> list[list]:
    """``params`` (backward order) in ``n`` contiguous chunks of about equal element counts."""
    n = max(1, min(n, len(params)))
    total = sum(p.numel() for p in params)
    chunks, cur, acc = [], [], 0
    for i, p in enumerate(params):
        cur.append(p)
        acc += p.numel()
        left_params, left_chunks = len(params) - i - 1, n - len(chunks) - 1
        if left_chunks > 0 and (acc >= total * (len(chunks) + 1) / n or left_params == left_chunks):
            chunks.append(cur)
            cur = []
    chunks.append(cur)
    return [c for c in chunks if c]


def make_stepper(accelerator, opts, param_groups, params, *, warmup_steps: int, total_steps: int):
    """The stepper for these options: plain, fused (per parameter) or grouped."""
    from library.optim import build_optimizer, build_scheduler

    def scheduler_for(optimizer):
        return build_scheduler(opts.lr_scheduler, optimizer, warmup_steps=warmup_steps,
                               total_steps=total_steps, num_cycles=opts.lr_scheduler_num_cycles,
                               power=opts.lr_scheduler_power)

    mode = fused_mode(opts)
    if mode is None:
        optimizer = build_optimizer(opts.optimizer_type, opts.optimizer_args, param_groups,
                                    opts.learning_rate)
        optimizer = accelerator.prepare(optimizer)
        scheduler = scheduler_for(getattr(optimizer, "optimizer", optimizer))
        return PlainStepper(accelerator, optimizer, scheduler, params, opts.max_grad_norm)
    check_stepper_options(opts)
    trainable = {id(p) for p in params if p.requires_grad}
    group_of = {}
    for gi, g in enumerate(param_groups):
        for p in g["params"]:
            if id(p) in trainable and id(p) not in group_of:
                group_of[id(p)] = gi
    ordered = [p for g in param_groups for p in g["params"] if group_of.get(id(p)) is not None]
    seen, unique = set(), []
    for p in ordered:
        if id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    # Backward order is about the reverse of creation (registration) order.
    backward_order = list(reversed(unique))
    if mode == "fused_backward_pass":
        units = [[p] for p in backward_order]
    else:
        n = opts.fused_optimizer_groups
        units = _split_contiguous(backward_order, n)
        if len(units) < n:
            logger.warning(f"fused_optimizer_groups {n}: only {len(units)} trainable parameters, "
                           f"using {len(units)} groups")
    optimizers, schedulers = [], []
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
        what = "each parameter's gradient" if mode == "fused_backward_pass" else \
            "each group's gradients"
        logger.info(f"{mode}: global-norm clipping cannot be fused; max_grad_norm "
                    f"{opts.max_grad_norm} clips {what} separately")
    if opts.gradient_accumulation_steps > 1:
        logger.info(f"{mode}: with gradient_accumulation_steps {opts.gradient_accumulation_steps} "
                    "parameters are stepped in the last micro-step only; gradient memory is saved "
                    "only in that micro-step")
    cls = FusedStepper if mode == "fused_backward_pass" else GroupedStepper
    logger.info(f"{mode}: {len(units)} optimizer{'s' if len(units) != 1 else ''} stepped inside "
                "the backward pass")
    return cls(accelerator, units, optimizers, schedulers, opts.max_grad_norm,
               first_param=unique[0] if unique else None)
