"""The declared state of one training run: what it is made of, and how far it has got.

``Components`` are built by the trainer's stages (load, set-up, cache) and read by the modules
that need them, passed as a parameter; ``Progress`` (library/training/progress.py) is written by
the loop after each step and by a resume (``train_state.load_state`` returns the saved one). Both
are slotted records: no module can add an attribute to them, and no module keeps a cache in them
(each module's own state lives in its own object: the Reporter's trackers, the Validation's held-out latents, the Strategy's
sharded modules).

``Hooks`` is the declared observation point of the loop (tests, tools): ``before_micro_step``
before a micro-step's loss is computed, ``after_micro_step`` with its loss (it returns the loss to
use, so a fault test can make it non-finite), ``after_step`` with the step's loss and learning
rate.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable



@dataclass(slots=True)
class Caches:
    """The cache stage's results (None: not cached)."""

    latents: dict | None = None      # latent-cache key -> entry
    latent_key: dict | None = None   # latent slot of (item, flip) -> latent-cache key
    text: dict | None = None         # caption -> cached text-encoder output


@dataclass(slots=True)
class Components:
    """What one run is made of, set by the trainer's stages in this order (None until then)."""

    accelerator: Any = None
    bundle: Any = None       # library/models/loading.py ModelBundle
    adapter: Any = None      # library/models/family.py: tokenize / encode / U-Net forward of the family
    losses: Any = None       # library/training/losses.py Losses: noise schedule, draws, loss
    placement: Any = None    # library/models/placement.py Placement: the dtype of every part
    method: Any = None       # library/training/methods.py NetworkMethod / FullMethod
    strategy: Any = None     # library/distributed/strategy.py: single process, DDP, FSDP or DeepSpeed
    stepper: Any = None      # library/training/stepper.py Stepper, built by the strategy
    params: list = field(default_factory=list)  # the trainable parameters (method order)
    ema: Any = None          # library/training/ema.py EMA, or None
    caches: Caches = field(default_factory=Caches)
    validation: Any = None   # library/training/validation.py Validation (held-out latents), or None
    frozen: Any = None       # library/training/offload.py Frozen: parts released after caching
    reporter: Any = None     # library/outputs/tracking.py Reporter
    batch_loss: Any = None   # library/training/batch_loss.py BatchLoss: the one per-sample loss


class Hooks:
    """Callbacks the loop calls (every process); empty in a normal run. Register with
    ``with hooks.add(before_micro_step=f): ...`` (module-level ``HOOKS``)."""

    def __init__(self):
        self._before: list[Callable] = []
        self._after: list[Callable] = []
        self._step: list[Callable] = []

    @contextlib.contextmanager
    def add(self, *, before_micro_step=None, after_micro_step=None, after_step=None):
        """``before_micro_step(run, epoch, idx)``, ``after_micro_step(run, epoch, idx, loss) ->
        loss``, ``after_step(run, loss, lr)``; removed again on leaving the block."""
        added = [(lst, f) for lst, f in ((self._before, before_micro_step),
                                         (self._after, after_micro_step),
                                         (self._step, after_step)) if f is not None]
        for lst, f in added:
            lst.append(f)
        try:
            yield self
        finally:
            for lst, f in added:
                lst.remove(f)

    def before_micro_step(self, run, epoch: int, idx: list[int]) -> None:
        for f in self._before:
            f(run, epoch, idx)

    def after_micro_step(self, run, epoch: int, idx: list[int], loss):
        for f in self._after:
            loss = f(run, epoch, idx, loss)
        return loss

    def after_step(self, run, loss: float, lr: float) -> None:
        for f in self._step:
            f(run, loss, lr)


HOOKS = Hooks()
