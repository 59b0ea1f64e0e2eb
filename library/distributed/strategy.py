"""How a run is spread over its processes, chosen once at set-up (``for_run``):

    SingleProcess   one process
    DDP             several processes, every one with the whole model: PyTorch's
                    DistributedDataParallel sums the gradients during the backward pass
                    (library/distributed/ddp.py); with a fused stepper its hooks reduce them
    FSDP            ``fsdp``: the trained modules sharded (library/distributed/fsdp.py)
    DeepSpeed       ``deepspeed``: ZeRO stages 0-2 (library/distributed/deepspeed_zero.py)

A strategy owns everything that differs between them: wrapping or sharding the trained modules
(``prepare``), the stepper and how it sums the gradients across processes (``make_stepper``: the
``grad_sum`` it passes, library/accelerator.py ``BucketedSum`` or None), the full
weights for a model save (``full_weights``, ``ema_weights``), where its training state lives and
how it is written and read (``state_dir``, ``weights_sharded``, ``state_flags``,
``check_state``, ``save_process_state``, ``load_sharded_state`` before the stepper's state,
``load_process_state`` after it), which validation images and sample prompts each process runs
(``share``), the training forward (``forward``), the context of each micro-step (``micro_step``:
DDP's ``no_sync`` before the last) and whether a process takes part in a micro-step of an empty
share (``takes_part``). The loop, the saver and the training state ask it and contain no branch
on the kind of run.

How each stepper mode sums the gradients across processes (the one table):

    strategy        plain stepper                         fused / grouped steppers
    SingleProcess   nothing (one process)                 nothing
    DDP             DDP's reducer, in the last backward   BucketedSum per unit, in its hooks
    FSDP            FSDP's reduce-scatter, in backward    (rejected before)
    DeepSpeed       its engine (ZeRO's reduction)         (rejected before)

(benchmarks/ddp_scaling.py's "sum" column: a DDP subclass whose plain stepper sums with
``BucketedSum`` after the backward, the path before DDP's reducer.)
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, ContextManager, Protocol

from library.accelerator import BUCKETED_SUM
from library.distributed import ddp, deepspeed_zero, fsdp
from library.errors import ResumeError, first_line
from library.training.stepper import fused_mode, make_stepper

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")

# the strategy's part of a training state, a folder inside it
SHARDED_DIR = "sharded"  # fsdp: library/distributed/fsdp.py (torch.distributed.checkpoint)
DEEPSPEED_DIR = "deepspeed"  # deepspeed: library/distributed/deepspeed_zero.py (DeepSpeed's partitioned checkpoint)


# What ``takes_part`` answers for one micro-step of one process.
RUN, ZERO_WEIGHT, SKIP = "run", "zero_weight", "skip"


class Strategy(Protocol):
    name: str
    # the training state's weights, optimizer state and EMA are the shards every process writes
    # (the main process writes no weights file)
    weights_sharded: bool
    # a sub-folder of the training state every process writes into (None: the main process
    # writes the whole state)
    state_dir: str | None

    def takes_part(self, empty: bool, last: bool) -> str: ...

    def prepare(self, bundle, method, groups: list[dict]) -> None: ...

    def forward(self, fn): ...

    def micro_step(self, last: bool) -> ContextManager: ...

    def make_stepper(self, opts: Options, groups: list[dict], params: list, plan): ...

    def full_weights(self, bundle, params: list) -> ContextManager: ...

    def ema_weights(self, ema, bundle, params: list) -> ContextManager: ...

    def share(self, n: int) -> list[tuple[int, bool]]: ...

    def state_flags(self) -> dict: ...

    def state_note(self) -> str: ...

    def check_state(self, path: str, info: dict) -> None: ...

    def save_process_state(self, path: str, named: list, ema) -> None: ...

    def load_sharded_state(self, path: str, named: list, ema) -> None: ...

    def load_process_state(self, path: str, named: list, ema) -> None: ...

    def close(self) -> None: ...


class SingleProcess:
    """One process: nothing to wrap, share or gather."""

    name = "single process"
    # every process runs every micro-step's forward (a zero-weight one for an empty share)
    forward_in_every_process = False
    # every process runs the last micro-step's forward and backward (a zero-weight one for an
    # empty share): DDP's reducer all-reduces in that backward
    last_micro_step_in_every_process = False
    weights_sharded = False
    state_dir: str | None = None  # where its part of a training state lives (None: nowhere)

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.stepper = None

    def takes_part(self, empty: bool, last: bool) -> str:
        """Whether this process runs a micro-step (``last``: the step's last one) whose share
        here is ``empty`` (a partial global batch): ``RUN`` its share; ``SKIP`` it (no forward:
        this process contributes zeros to the gradient sum, which it still joins);
        ``ZERO_WEIGHT``: a zero-weight forward and backward of one sample of the global batch,
        where the other processes need this one in a collective of that micro-step: a stepper
        that steps inside backward hooks (which fire only in a backward, for the same parameters
        in the same order in every process) or DDP's reducer in the last micro-step; FSDP's
        all-gather in every forward; ZeRO's reduction in every backward."""
        if not empty:
            return RUN
        if self.forward_in_every_process or (last and (
                self.stepper.steps_in_backward or self.last_micro_step_in_every_process)):
            return ZERO_WEIGHT
        return SKIP

    def prepare(self, bundle, method, groups: list[dict]) -> None:
        """Wrap or shard the trained modules of ``bundle`` / ``method`` (nothing here)."""

    def forward(self, fn):
        """The training forward: ``fn()`` (the text encoding and the U-Net)."""
        return fn()

    def micro_step(self, last: bool) -> ContextManager:
        """The context of one micro-step's forward and backward."""
        return contextlib.nullcontext()

    def make_stepper(self, opts: Options, groups: list[dict], params: list, plan):
        """Plain, fused_backward_pass or fused_optimizer_groups: optimizer(s) and scheduler(s),
        summing nothing (one process)."""
        self.stepper = make_stepper(self.accelerator, opts, groups, params,
                                    warmup_steps=plan.warmup_steps, total_steps=plan.total_steps,
                                    grad_sum=None)
        return self.stepper

    def full_weights(self, bundle, params: list) -> ContextManager:
        """Inside: the full weights of ``bundle``'s trained modules / ``params`` (a model save)."""
        return contextlib.nullcontext()

    def ema_weights(self, ema, bundle, params: list) -> ContextManager:
        """Inside: the full weights with the EMA's values swapped in."""
        return ema.swapped()

    def share(self, n: int) -> list[tuple[int, bool]]:
        """Item i is run by process i mod P (and kept there)."""
        acc = self.accelerator
        return [(i, True) for i in range(acc.process_index, n, acc.num_processes)]

    def state_flags(self) -> dict:
        return {"sharded": False, "deepspeed": False}

    def state_note(self) -> str:
        """What the log line of a saved training state adds."""
        return ""

    def check_state(self, path: str, info: dict) -> None:
        """A ResumeError where the state at ``path`` (its state.json ``info``) was written in a
        layout this strategy cannot read (the config check names fsdp first; kept for direct
        callers)."""
        if info.get("sharded") and not self.weights_sharded:
            raise ResumeError(f"resume: {path} was written with fsdp (sharded); "
                              "resume it with fsdp")

    def save_process_state(self, path: str, named: list, ema) -> None:
        """This process's part of the state folder ``path`` (in its ``state_dir``; every process
        writes it where ``state_dir`` is set, nothing here)."""

    def load_sharded_state(self, path: str, named: list, ema) -> None:
        """For a sharded state (state.json ``sharded``), before the stepper's state: the weights,
        optimizer state and EMA from the shards in ``state_dir``."""

    def load_process_state(self, path: str, named: list, ema) -> None:
        """After the stepper's state: the rest of this process's part (DeepSpeed's partitions)."""

    def close(self) -> None:
        pass


class DDP(SingleProcess):
    """Several processes, each with the whole model (data parallel).

    With the plain stepper, PyTorch's ``DistributedDataParallel`` over one module, the denoiser
    (library/distributed/ddp.py), whose forward the loop calls (``forward``): its reducer sums
    each gradient bucket across processes as soon as the bucket's gradients are ready, during
    the backward pass of the last micro-step; the earlier micro-steps run under ``no_sync``
    (``micro_step``), so there is one all-reduce per optimizer step. The plain stepper then sums
    nothing itself. With fused_backward_pass / fused_optimizer_groups nothing is wrapped: their
    hooks reduce each gradient (library/training/stepper.py).

    benchmarks/ddp_scaling.py subclasses it (``uses_reducer`` False) for its comparison column:
    the path before DDP, the plain stepper's synchronous bucketed sum after the backward.
    """

    name = "data parallel"

    def __init__(self, accelerator, opts: Options):
        super().__init__(accelerator)
        self.opts = opts
        self.engine = self.uses_reducer(opts)
        # DDP's reducer all-reduces in the last micro-step's backward of every process
        self.last_micro_step_in_every_process = self.engine
        self.denoiser: ddp.Denoiser | None = None  # the wrapped module (None: not wrapped)
        self.ddp = None        # its DistributedDataParallel (None: nothing trains in it)
        self._trained: list | None = None  # the trained parameters it was built over

    def uses_reducer(self, opts: Options) -> bool:
        """Whether DistributedDataParallel's reducer sums the gradients: with the plain stepper;
        the fused steppers reduce each unit in their hooks."""
        return fused_mode(opts) is None

    def prepare(self, bundle, method, groups: list[dict]) -> None:
        if not self.engine:
            given = ddp.speed_options_given(self.opts)
            if given:
                logger.warning(f"{', '.join(given)}: no effect here (the fused step reduces each "
                               "gradient in its own backward hook, without DDP)")
            return
        self.denoiser = ddp.Denoiser(bundle, method)
        self._wrap()
        logger.info(ddp.describe(self.opts, self.accelerator.num_processes))

    def _wrap(self) -> None:
        first = self._trained is None
        self.ddp = None  # the old reducer (and its autograd hooks) go first
        self.ddp = ddp.wrap(self.denoiser, self.opts, self.accelerator, first=first)
        self._trained = ddp.trained(self.denoiser)

    def forward(self, fn):
        return fn() if self.ddp is None else self.ddp(fn)

    @contextlib.contextmanager
    def micro_step(self, last: bool):
        """Earlier micro-steps under ``no_sync`` (gradients accumulate locally); the last one
        reduces. A change of the trained parameters (stop_text_encoder_training,
        stop_pivotal_training: the same step in every process) rebuilds the wrapper first."""
        if self.denoiser is not None and self._trained is not None:  # wrapped
            if not all(p.requires_grad for p in self._trained):
                self._wrap()
                logger.info(f"DistributedDataParallel rebuilt over the {len(self._trained)} "
                            "parameters that still train")
        if self.ddp is None or last:
            yield
            return
        with self.ddp.no_sync():
            yield

    def make_stepper(self, opts: Options, groups: list[dict], params: list, plan):
        """The plain stepper summing nothing when DDP's reducer sums during the backward; else
        (the fused steppers' units, or no reducer) the bucketed sum (``BucketedSum``)."""
        self.stepper = make_stepper(self.accelerator, opts, groups, params,
                                    warmup_steps=plan.warmup_steps, total_steps=plan.total_steps,
                                    grad_sum=None if self.engine else BUCKETED_SUM)
        return self.stepper

    def close(self) -> None:
        self.ddp = None


class FSDP(SingleProcess):
    """``fsdp``: the trained U-Net / text encoders sharded with FSDP2 (library/distributed/fsdp.py)."""

    name = "fsdp"
    weights_sharded = True
    state_dir: str | None = SHARDED_DIR

    def __init__(self, accelerator):
        super().__init__(accelerator)
        # every forward all-gathers the block's weights from all processes
        self.forward_in_every_process = accelerator.num_processes > 1
        self.modules: list = []   # (name, module) trained, the training state's layout
        self.roots: list = []     # the sharded ones (none on one process)

    def prepare(self, bundle, method, groups: list[dict]) -> None:
        # fixed for the run (even after stop_text_encoder_training freezes the text encoders)
        self.modules = fsdp.trained_roots(bundle, method)
        self.roots = fsdp.shard(self.accelerator, self.modules, groups)

    def make_stepper(self, opts: Options, groups: list[dict], params: list, plan):
        """The plain stepper summing nothing (FSDP's reduce-scatter sums the gradients during
        the backward) and without the optimizer in its state (written with the shards)."""
        self.stepper = make_stepper(self.accelerator, opts, groups, params,
                                    warmup_steps=plan.warmup_steps, total_steps=plan.total_steps,
                                    grad_sum=None, optimizer_in_state=False)
        return self.stepper

    def full_weights(self, bundle, params: list) -> ContextManager:
        return fsdp.full_weights(bundle, self.roots, self.accelerator)

    @contextlib.contextmanager
    def ema_weights(self, ema, bundle, params: list):
        # each process swaps its shard, then gathers
        with ema.swapped(), self.full_weights(bundle, params):
            yield

    def share(self, n: int) -> list[tuple[int, bool]]:
        """Sharded, every process runs every item (each forward all-gathers weights from all
        processes) and keeps only its own."""
        if not self.roots:
            return super().share(n)
        acc = self.accelerator
        return [(i, i % acc.num_processes == acc.process_index) for i in range(n)]

    def state_flags(self) -> dict:
        return {"sharded": True, "deepspeed": False}

    def state_note(self) -> str:
        return ", sharded"

    def save_process_state(self, path: str, named: list, ema) -> None:
        fsdp.save_sharded(self.modules, self.stepper.optimizer, ema,
                          os.path.join(path, SHARDED_DIR), named)

    def load_sharded_state(self, path: str, named: list, ema) -> None:
        try:
            fsdp.load_sharded(self.modules, self.stepper.optimizer, ema,
                              os.path.join(path, SHARDED_DIR), named)
        except (KeyError, ValueError, RuntimeError) as e:
            raise ResumeError(f"resume: {path}: the sharded weights or optimizer "
                              "state do not fit this run "
                              f"({first_line(e)})") from None


class DeepSpeed(SingleProcess):
    """``deepspeed``: the DeepSpeed engine over the trained modules (library/distributed/deepspeed_zero.py)."""

    name = "deepspeed"
    # stage 2 reduces in every micro-step's backward, stage 0/1 in the last one, and ZeRO builds
    # the partitioned gradient in the last one: every process runs every micro-step (a
    # zero-weight one for an empty share), even alone (a partial global batch)
    forward_in_every_process = True
    state_dir: str | None = DEEPSPEED_DIR

    def __init__(self, accelerator):
        super().__init__(accelerator)
        self.modules: list = []  # (name, module) the engine wraps (prepare)

    def prepare(self, bundle, method, groups: list[dict]) -> None:
        self.modules = deepspeed_zero.trained_modules(bundle, method)  # what the engine wraps

    def make_stepper(self, opts: Options, groups: list[dict], params: list, plan):
        self.stepper = deepspeed_zero.make_stepper(opts, self.accelerator, plan, self.modules, groups)
        return self.stepper

    def full_weights(self, bundle, params: list) -> ContextManager:
        """In bf16 / fp16 the float32 master weights are saved (a collective)."""
        return deepspeed_zero.master_weights(params)

    @contextlib.contextmanager
    def ema_weights(self, ema, bundle, params: list):
        # the EMA into the float32 master copies
        with self.full_weights(bundle, params), ema.swapped():
            yield

    def state_flags(self) -> dict:
        return {"sharded": False, "deepspeed": True}

    def state_note(self) -> str:
        return (f", with DeepSpeed's partitioned optimizer state of "
                f"{self.accelerator.num_processes} process(es)")

    def save_process_state(self, path: str, named: list, ema) -> None:
        self.stepper.save_partitions(os.path.join(path, DEEPSPEED_DIR))  # ZeRO's optimizer state

    def load_process_state(self, path: str, named: list, ema) -> None:
        self.stepper.load_partitions(os.path.join(path, DEEPSPEED_DIR))

    def close(self) -> None:
        if self.stepper is not None:
            self.stepper.close()  # the engine (and the process group made for it)


def for_run(opts: Options, accelerator) -> Strategy:
    if (opts.deepspeed or opts.fsdp) and accelerator.num_processes > 1:
        given = ddp.speed_options_given(opts)
        if given:
            engine = "deepspeed" if opts.deepspeed else "fsdp"
            logger.warning(f"{', '.join(given)}: no effect with {engine} (it reduces the "
                           "gradients itself, without DDP)")
    if opts.deepspeed:
        return DeepSpeed(accelerator)
    if opts.fsdp:
        return FSDP(accelerator)
    if accelerator.num_processes > 1:
        return DDP(accelerator, opts)
    return SingleProcess(accelerator)
