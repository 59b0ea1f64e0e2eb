"""Per-parameter optimizer steps for the fused backward pass and optimizer groups.

``fused_backward_pass`` steps every trainable parameter inside its
``Tensor.register_post_accumulate_grad_hook``, so one parameter's update must not depend on any
other parameter: the optimizer may keep only per-parameter state. Such an optimizer stepped on a
one-parameter instance does exactly what it does on that parameter inside a many-parameter
instance, so the fused run is the unfused run. Optimizers that adapt from global statistics
(Prodigy's and D-Adaptation's step-size estimates over all parameters, schedule-free's averaged
iterates that need train/eval switching of all parameters at once) are rejected instead.

Adafactor (transformers) is stepped by ``adafactor_step_param``, the same math as
``transformers.optimization.Adafactor.step`` for one parameter, except that a bf16 weight is
written back with stochastic rounding (unbiased: the expected stored value is the float32
result), as sd-scripts' fused Adafactor does, instead of round-to-nearest, which drops updates
smaller than half a bf16 ulp.

``step_masked`` steps an optimizer and keeps the update only where a device flag says so (the
non-finite guard of the fused steps, with no host read per unit).

``full_bf16`` / ``full_fp16`` weights are stepped by ``step_low_precision`` (any optimizer without
global state, one parameter at a time in float32, float32 state, written back with stochastic
rounding for bf16), from the plain stepper as from the fused ones; ``grad_factor`` carries the
loss-scale removal and the clipping factor onto the float32 gradient.
"""
from __future__ import annotations

import contextlib
import copy
import math
from typing import NamedTuple

import torch

from library.errors import UserError


class FusedOptionError(UserError, ValueError):
    """A combination that the fused backward pass / optimizer groups cannot run."""


# Optimizer families whose update depends on state shared by all parameters.
_GLOBAL_STATE = {
    "prodigyopt": "Prodigy estimates one step size from all parameters together",
    "dadaptation": "D-Adaptation estimates one step size from all parameters together",
    "schedulefree": "schedule-free optimizers switch all parameters between train and eval "
                    "iterates together",
}


def global_state_reason(cls) -> str | None:
    """Why optimizer class ``cls`` cannot be stepped one parameter (or group) at a time, or None."""
    module = (getattr(cls, "__module__", "") or "").split(".")[0].lower()
    name = cls.__name__.lower()
    if module in _GLOBAL_STATE:
        return _GLOBAL_STATE[module]
    if "prodigy" in name:
        return _GLOBAL_STATE["prodigyopt"]
    if name.startswith("dadapt"):
        return _GLOBAL_STATE["dadaptation"]
    if "schedulefree" in name:
        return _GLOBAL_STATE["schedulefree"]
    return None


def stochastic_round_generator(device):
    """The generator of the rounding noise: its own stream, so that rounding does not shift the
    run's other random draws (noise, dropout)."""
    g = torch.Generator(device=device)
    g.manual_seed(0x5EED)
    return g


def copy_stochastic_(target, source, generator=None) -> None:
    """``target`` (bf16) := ``source`` (float32) rounded stochastically: up with probability equal
    to the distance from the lower bf16 neighbour, in units of the bf16 spacing. bf16 is the upper
    16 bits of float32, so adding uniform 16-bit noise to the low bits and truncating does it."""
    source = source.to(torch.float32).contiguous()
    noise = torch.randint(0, 1 << 16, source.shape, dtype=torch.int32, device=source.device,
                          generator=generator)
    bits = noise.add_(source.view(torch.int32)).bitwise_and_(-65536)
    target.copy_(bits.view(torch.float32))


def adafactor_step_param(optimizer, p, group, generator=None, grad_factor: float = 1.0) -> None:
    """One Adafactor update of parameter ``p`` (in ``group`` of transformers' ``optimizer``),
    with stochastic rounding when ``p`` is bf16. The float32 path is transformers' ``step``.
    ``grad_factor`` multiplies the gradient first, in float32 (loss-scale removal and clipping of
    low-precision gradients)."""
    if p.grad is None:
        return
    with torch.no_grad():
        grad = p.grad
        if grad.dtype in {torch.float16, torch.bfloat16}:
            grad = grad.float()
        if grad_factor != 1.0:
            grad = grad * grad_factor
        state = optimizer.state[p]
        grad_shape = grad.shape
        factored, use_first_moment = optimizer._get_options(group, grad_shape)
        if len(state) == 0:
            state["step"] = 0
            if use_first_moment:
                state["exp_avg"] = torch.zeros_like(grad)
            if factored:
                state["exp_avg_sq_row"] = torch.zeros(grad_shape[:-1]).to(grad)
                state["exp_avg_sq_col"] = torch.zeros(grad_shape[:-2] + grad_shape[-1:]).to(grad)
            else:
                state["exp_avg_sq"] = torch.zeros_like(grad)
            state["RMS"] = 0
        else:
            if use_first_moment:
                state["exp_avg"] = state["exp_avg"].to(grad)
            if factored:
                state["exp_avg_sq_row"] = state["exp_avg_sq_row"].to(grad)
                state["exp_avg_sq_col"] = state["exp_avg_sq_col"].to(grad)
            else:
                state["exp_avg_sq"] = state["exp_avg_sq"].to(grad)

        p_data_fp32 = p
        if p.dtype in {torch.float16, torch.bfloat16}:
            p_data_fp32 = p_data_fp32.float()

        state["step"] += 1
        state["RMS"] = optimizer._rms(p_data_fp32)
        lr = optimizer._get_lr(group, state)

        beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
        # transformers' (grad**2) + eps, in one buffer: with the gradient, at most two
        # parameter-sized tensors exist at once (three in transformers' step)
        update = grad.square().add_(group["eps"][0])
        if factored:
            exp_avg_sq_row = state["exp_avg_sq_row"]
            exp_avg_sq_col = state["exp_avg_sq_col"]
            exp_avg_sq_row.mul_(beta2t).add_(update.mean(dim=-1), alpha=(1.0 - beta2t))
            exp_avg_sq_col.mul_(beta2t).add_(update.mean(dim=-2), alpha=(1.0 - beta2t))
            del update  # before the outer product allocates the next one
            update = optimizer._approx_sq_grad(exp_avg_sq_row, exp_avg_sq_col)
            update.mul_(grad)
        else:
            exp_avg_sq = state["exp_avg_sq"]
            exp_avg_sq.mul_(beta2t).add_(update, alpha=(1.0 - beta2t))
            del update
            update = exp_avg_sq.rsqrt().mul_(grad)

        update.div_((optimizer._rms(update) / group["clip_threshold"]).clamp_(min=1.0))
        update.mul_(lr)

        if use_first_moment:
            exp_avg = state["exp_avg"]
            exp_avg.mul_(group["beta1"]).add_(update, alpha=(1 - group["beta1"]))
            update = exp_avg

        if group["weight_decay"] != 0:
            p_data_fp32.add_(p_data_fp32, alpha=(-group["weight_decay"] * lr))

        p_data_fp32.add_(-update)

        if p.dtype == torch.bfloat16:
            copy_stochastic_(p, p_data_fp32, generator)
        elif p.dtype == torch.float16:
            p.copy_(p_data_fp32)


def is_transformers_adafactor(optimizer) -> bool:
    cls = type(optimizer)
    return cls.__name__ == "Adafactor" and cls.__module__.startswith("transformers")


def _is_low_precision(p) -> bool:
    return p.dtype in (torch.bfloat16, torch.float16)


def step_optimizer(optimizer, generator=None, grad_factor: float = 1.0) -> None:
    """Step ``optimizer`` (the whole run's, one parameter's or one group's): Adafactor through
    ``adafactor_step_param`` (stochastic rounding of bf16 weights), an optimizer with bf16/fp16
    weights (``full_bf16``/``full_fp16``) through ``step_low_precision``, any other through its
    own ``step``. ``grad_factor`` (loss-scale removal, clipping) is applied in float32."""
    if is_transformers_adafactor(optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                adafactor_step_param(optimizer, p, group, generator, grad_factor)
        # what torch's LR scheduler wrapper of optimizer.step() records: without it the first
        # scheduler step warns that it ran before optimizer.step(), which here it did not
        optimizer._opt_called = True
    elif any(_is_low_precision(p) for g in optimizer.param_groups for p in g["params"]):
        step_low_precision(optimizer, generator, grad_factor)
    else:
        if grad_factor != 1.0:
            with torch.no_grad():
                for g in optimizer.param_groups:
                    for p in g["params"]:
                        if p.grad is not None:
                            p.grad.mul_(grad_factor)
        optimizer.step()


def step_low_precision(optimizer, generator=None, grad_factor: float = 1.0) -> None:
    """Step any optimizer without global state over bf16/fp16 weights, one parameter at a time,
    in float32: the parameter and its gradient are copied to float32, the optimizer steps that
    copy (its state, created on the copy, stays float32: no bf16 moments, no fp16 underflow of
    Adam's second moment), and the result is written back to the weight, stochastically rounded
    for bf16 (unbiased: the expected stored value is the float32 result) and rounded to nearest
    for fp16. Only one parameter's float32 copy exists at a time, so the weights never exist
    twice in full. The update of each parameter is exactly the float32 optimizer's update of the
    stored value (with ``grad_factor`` applied to the float32 gradient).

    The optimizer keeps its own param groups and state keys (``state_dict`` is the usual one): for
    each step the group's parameter list holds the float32 copy alone and its state moves to it.
    That is why optimizers whose update of one parameter depends on the others (Prodigy,
    D-Adaptation, schedule-free) are rejected with full_bf16/full_fp16 (``global_state_reason``).
    """
    with torch.no_grad(), _groups_emptied(optimizer) as pairs:
        for group, params in pairs:
            for p in params:
                if p.grad is None:
                    continue
                q = p.detach().to(torch.float32, copy=True)
                q.grad = p.grad.to(torch.float32, copy=True)
                if grad_factor != 1.0:
                    q.grad.mul_(grad_factor)
                if p in optimizer.state:
                    optimizer.state[q] = optimizer.state.pop(p)
                group["params"] = [q]
                try:
                    optimizer.step()
                finally:
                    group["params"] = []
                    if q in optimizer.state:
                        optimizer.state[p] = optimizer.state.pop(q)
                if p.dtype == torch.bfloat16:
                    copy_stochastic_(p, q, generator)
                else:
                    p.copy_(q)
                del q


@contextlib.contextmanager
def _groups_emptied(optimizer):
    """The optimizer with every param group's parameter list empty (the caller puts one
    parameter at a time back in its group): yields (group, its parameters) pairs; the lists are
    restored afterwards, also after an error."""
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    for g in groups:
        g["params"] = []
    try:
        yield list(zip(groups, saved))
    finally:
        for g, params in zip(groups, saved):
            g["params"] = params


class Undo(NamedTuple):
    """What ``step_masked`` could not take back on the device, for ``undo`` after the read."""
    optimizer: torch.optim.Optimizer
    param: torch.Tensor
    fresh: bool      # the parameter had no optimizer state before the step (made by it)
    host: dict       # state entries as they were, which the device flag cannot restore


class Scratch:
    """Buffers ``step_masked`` copies into, kept from one parameter (and step) to the next: a
    fresh allocation per copy costs more than the copy (page faults on the CPU), measured."""

    def __init__(self):
        self._buffers: dict = {}

    def copy(self, slot: int, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` in buffer ``slot`` (valid until that slot is used again)."""
        key = (slot, t.dtype, t.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < t.numel():
            buf = self._buffers[key] = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
        return buf[:t.numel()].view(t.shape).copy_(t)


def step_masked(optimizer, ok, generator=None, scratch: Scratch | None = None) -> list[Undo]:
    """Step ``optimizer`` (through ``step_optimizer``) one parameter at a time, and keep each
    parameter's update only where ``ok`` (a 0-d bool device tensor) is true: before a parameter
    is stepped, it and its optimizer state's tensors on the same device are copied, and after
    the step ``torch.where(ok, new, old)`` is written back in place, so with ``ok`` true the
    weights and the state are exactly the step's (bit for bit) and with ``ok`` false exactly
    what they were, with no host read. The copies go to ``scratch`` (one parameter's at a time,
    reused; a new one when None). What the device
    flag cannot restore (a state made by this step, Python values such as Adafactor's step
    count, tensors on another device such as torch's CPU step counters) is returned, for
    ``undo`` once the flag has been read. Each parameter stepped alone is the same update as in
    the group: only optimizers with per-parameter state are stepped this way
    (``global_state_reason``)."""
    undo: list[Undo] = []
    scratch = Scratch() if scratch is None else scratch
    with torch.no_grad(), _groups_emptied(optimizer) as pairs:
        for group, params in pairs:
            for p in params:
                if p.grad is None:
                    continue  # no update (torch's optimizers skip it too)
                group["params"] = [p]
                try:
                    undo.append(_step_one_masked(optimizer, p, ok, generator, scratch))
                finally:
                    group["params"] = []
    # what torch's LR scheduler wrapper of optimizer.step() records (as step_optimizer does for
    # Adafactor), also where no parameter had a gradient and nothing was stepped
    optimizer._opt_called = True
    return undo


def _same_kind(a, b) -> bool:
    return torch.is_tensor(a) and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def _step_one_masked(optimizer, p, ok, generator, scratch: Scratch) -> Undo:
    if ok.device != p.device:  # (not in the fused steps: they step parameters on the device)
        ok = ok.to(p.device)
    state = optimizer.state.get(p)
    fresh = not state
    old_p = scratch.copy(0, p.detach())
    on_device: dict = {}
    host: dict = {}
    for k, v in (state or {}).items():
        if torch.is_tensor(v) and v.device == p.device:
            on_device[k] = scratch.copy(1 + len(on_device), v.detach())
        else:
            host[k] = v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)
    step_optimizer(optimizer, generator)
    w = p.detach()
    torch.where(ok, w, old_p, out=w)
    now = optimizer.state.get(p) or {}
    for k, old in on_device.items():
        cur = now.get(k)
        if _same_kind(cur, old):
            torch.where(ok, cur, old, out=cur)
        else:  # replaced by another kind of value: restored after the read
            host[k] = old.clone()  # (out of the scratch buffer, which the next parameter reuses)
    return Undo(optimizer, p, fresh, host)


def undo(record: Undo) -> None:
    """Take back, on the host, what ``step_masked`` left of a parameter's masked update."""
    if record.fresh:
        record.optimizer.state.pop(record.param, None)
        return
    record.optimizer.state[record.param].update(record.host)


def restore_float_state(optimizer, saved: dict) -> None:
    """After ``optimizer.load_state_dict(saved)``: torch (and bitsandbytes) cast floating state to
    the parameter's dtype on load, which would round the float32 state of bf16/fp16 weights (see
    ``step_low_precision``) to their precision. Put the saved float32 tensors back."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        entry = saved.get("state", {}).get(i)
        if not entry or p not in optimizer.state:
            continue
        st = optimizer.state[p]
        for k, v in entry.items():
            if torch.is_tensor(v) and v.is_floating_point() and k in st and torch.is_tensor(st[k]) \
                    and st[k].dtype != v.dtype:
                st[k] = v.to(st[k].device)
