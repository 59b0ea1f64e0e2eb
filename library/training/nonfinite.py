"""Non-finite values: the training guard (``on_nonfinite``) and the finiteness checks of what is
read (``network_weights``, ``base_weights``, resumed weights) and of everything saved.

The guard looks at two things every step, both before any parameter is updated:

- the global batch's loss (summed over every process; the trainer all-reduces it anyway for the
  log, before the last micro-step's backward);
- the gradients: the plain stepper checks the global gradient norm it computes for clipping (an
  overflowing norm, inf, counts: clipping by an infinite norm would scale every update to zero);
  the hook steppers check each unit's summed gradient in its hook before stepping it.

Both come to the host in the step's one read (library/training/step_sync.py), which every stepper
makes in ``step()``. The plain stepper reads before it updates; the hook steppers update inside
the backward, so they decide on the device: each unit's update is kept only while the loss and
every unit's norm so far are finite (library/training/fused_optim.py ``step_masked``), and the
read says which units kept theirs.

Gradients and the loss are summed across processes before they are checked, so every process
decides alike with no extra collective. ``stop`` (default) ends the run with ``NonFiniteStop``
(exit code 3) after writing ``<output_name>-step<N>-state`` from before the bad update;
``skip`` drops the update (the scheduler still steps, so the schedule stays aligned with the
step count and the data) and warns.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from library.accelerator import _is_multi_process
from library.errors import NonFiniteStop, UserError
from networks.lora import LoRAError, load_state_dict_file

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

MODES = ("stop", "skip")


class NonFiniteInput(UserError, ValueError):
    """A weights file given to the run holds NaN or inf."""


def first_nonfinite(named) -> str | None:
    """The name of the first tensor of ``named`` ((name, tensor) pairs) holding NaN or inf, or
    None. One ``isfinite(...).all()`` per tensor and a single host synchronisation per device."""
    names: list[str] = []
    flags: dict[torch.device, list] = {}
    for n, t in named:
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            continue
        local = getattr(t, "to_local", None)  # a DTensor shard: this process's part
        t = local() if callable(local) else t
        names.append(n)
        flags.setdefault(t.device, []).append((len(names) - 1, torch.isfinite(t).all()))
    bad: list[int] = []
    for items in flags.values():
        ok = torch.stack([f for _, f in items]).cpu()  # one sync per device
        bad.extend(i for (i, _), good in zip(items, ok.tolist()) if not good)
    return names[min(bad)] if bad else None


def check_file(path: str, what: str) -> None:
    """``what`` (the option naming it): the file's first non-finite tensor is an error."""
    try:
        sd = load_state_dict_file(path)
    except LoRAError:
        return  # unreadable files are reported by the code that reads them, in its words
    key = first_nonfinite(sd.items())
    if key is not None:
        raise NonFiniteInput(f"{what}: {path}: tensor {key} holds NaN or inf values; use a "
                             "finite weights file (e.g. an earlier save)")


def check_options(opts: Options) -> None:
    """Before any weight loads: ``on_nonfinite`` combinations, and the weights files the run
    starts from (``network_weights``, ``base_weights``) must be finite."""
    if opts.on_nonfinite == "skip" and opts.deepspeed:
        # DeepSpeed's engine owns the gradients and its step: no way to drop one update cleanly
        raise UserError("on_nonfinite skip cannot be combined with deepspeed (its engine owns "
                             "the gradients); use on_nonfinite stop")
    if opts.script != "train_lora":
        return
    if opts.network_weights:
        check_file(opts.network_weights, "network_weights")
    for f in opts.base_weights or []:
        check_file(f, "base_weights")


def agree_flag(flag: bool, accelerator) -> bool:
    """True in every process when ``flag`` is true in any (one tiny all-reduce; the
    accelerator's device is read only then)."""
    if not _is_multi_process():
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=accelerator.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def check_before_save(named, path: str, accelerator) -> None:
    """Before writing ``path``: every process checks its tensors (its shards); if any holds NaN
    or inf in any process, nothing is written and the run stops (every process, alike)."""
    key = first_nonfinite(named)
    if agree_flag(key is not None, accelerator):
        where = f"tensor {key}" if key is not None else "a tensor of another process"
        raise NonFiniteStop(f"non-finite weights: {where} holds NaN or inf; {path} was not "
                            "written (an earlier file of that name is kept)")


def describe(value: float) -> str:
    return "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
