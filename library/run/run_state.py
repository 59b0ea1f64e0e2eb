"""The declared state of one training run: what it is made of, and how far it has got.

``Components`` are made by the trainer's stages (load, set-up, cache: each returns its parts,
made once) and each module is passed the parts it uses, never the record; ``Progress``
(library/training/progress.py) is written by the loop after each step and by a resume
(``train_state.load_state`` returns the saved one). Both are slotted records: no module
can add an attribute to them, and no module keeps a cache in them (each module's own state lives
in its own object: the Reporter's trackers, the Validation's held-out latents, the Strategy's
sharded modules).

``Hooks`` is the declared observation point of the loop (tests, tools): ``before_micro_step``
before a micro-step's loss is computed, ``after_micro_step`` with its loss (it returns the loss to
use, so a fault test can make it non-finite), ``after_step`` with the step's loss and learning
rate. A hook is given a ``LoopView`` (the run's progress record and parts), not the run: it
cannot reach the options, the saver or the training set.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # annotations only: the parts' modules import torch, which loads after the plan
    # is printed (library/run/trainer.py prints it first; library/run/stages.py imports this module at its top)
    import torch
    from accelerate import Accelerator

    from library.distributed.strategy import Strategy
    from library.models.family import FamilyModel
    from library.models.loading import ModelBundle
    from library.models.placement import Placement
    from library.outputs.tracking import Reporter
    from library.training.batch_loss import BatchLoss
    from library.training.ema import EMA
    from library.training.losses import Losses
    from library.training.methods import Method
    from library.training.offload import Frozen
    from library.training.progress import Progress
    from library.training.stepper import Stepper
    from library.training.validation import Validation


@dataclass(slots=True)
class Caches:
    """The cache stage's results (None: not cached)."""

    latents: dict | None = None      # latent-cache key -> entry
    latent_key: dict | None = None   # latent slot of (item, flip) -> latent-cache key
    text: dict | None = None         # caption -> cached text-encoder output
    text_partial: bool = False       # text holds the frozen encoders' part (text_cache.batch)


@dataclass(slots=True)
class Components:
    """What one run is made of: each part made once by the trainer's stage that returns it (load:
    accelerator, bundle, losses; set-up: method, family model, placement, strategy, stepper,
    params, EMA, validation; cache: caches, frozen parts; then the reporter and the batch loss
    over them), the record built when all are made. A module is passed the parts it uses, never
    this record."""

    accelerator: Accelerator
    bundle: ModelBundle
    family_model: FamilyModel  # tokenize / encode / U-Net forward of the model's family
    losses: Losses             # noise schedule, draws, loss
    placement: Placement       # the dtype of every part
    method: Method             # NetworkMethod / FullMethod / TextualInversionMethod
    strategy: Strategy         # single process, DDP, FSDP or DeepSpeed
    stepper: Stepper           # built by the strategy
    params: list[torch.nn.Parameter]  # the trainable parameters (method order)
    ema: EMA | None            # ema_decay's moving average (None: off)
    caches: Caches
    validation: Validation     # the held-out images and their latents
    frozen: Frozen             # parts released after caching
    reporter: Reporter         # validation, samples, scalars, the progress stream
    batch_loss: BatchLoss      # the one per-sample loss


@dataclass(frozen=True, slots=True)
class LoopView:
    """What a hook sees of the run the loop trains: how far it has got and what it is made of."""

    progress: Progress
    parts: Components


class Hooks:
    """Callbacks the loop calls (every process); empty in a normal run. Register with
    ``with hooks.add(before_micro_step=f): ...`` (module-level ``HOOKS``)."""

    def __init__(self):
        self._before: list[Callable] = []
        self._after: list[Callable] = []
        self._step: list[Callable] = []

    @contextlib.contextmanager
    def add(self, *, before_micro_step=None, after_micro_step=None, after_step=None):
        """``before_micro_step(view, epoch, idx)``, ``after_micro_step(view, epoch, idx, loss) ->
        loss``, ``after_step(view, loss, lr)`` (``view``: a ``LoopView``); removed again on
        leaving the block."""
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

    def before_micro_step(self, view: LoopView, epoch: int, idx: list[int]) -> None:
        for f in self._before:
            f(view, epoch, idx)

    def after_micro_step(self, view: LoopView, epoch: int, idx: list[int], loss):
        for f in self._after:
            loss = f(view, epoch, idx, loss)
        return loss

    def after_step(self, view: LoopView, loss: float, lr: float) -> None:
        for f in self._step:
            f(view, loss, lr)


HOOKS = Hooks()
