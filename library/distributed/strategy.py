"""How a run is spread over its processes, chosen once at set-up (``for_run``):

    SingleProcess   one process
    DDP             several processes, every one with the whole model; the gradients summed by
                    the stepper's bucketed all-reduce (library/distributed/accelerator.py)
    FSDP            ``fsdp``: the trained modules sharded (library/distributed/fsdp.py)
    DeepSpeed       ``deepspeed``: ZeRO stages 0-2 (library/distributed/deepspeed_zero.py)

A strategy owns everything that differs between them: wrapping or sharding the trained modules
(``prepare``), the stepper (``make_stepper``), the full weights for a model save
(``full_weights``, ``ema_weights``), its part of the training state (``state_dir``,
``save_process_state`` / ``load_process_state``), which validation images and sample prompts
each process runs (``share``), and the flags the loop reads (``steps_in_backward``,
``forward_in_every_process``). The loop, the saver and the training state ask it and contain no
branch on the kind of run.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import ContextManager, Protocol

from library.outputs.train_state import DEEPSPEED_DIR, SHARDED_DIR

logger = logging.getLogger("sdtk")


class Strategy(Protocol):
    name: str
    # every process runs every micro-step's forward (a zero-weight one for an empty share)
    forward_in_every_process: bool
    # the training state's weights, optimizer state and EMA are the shards every process writes
    weights_sharded: bool
    # a sub-folder of the training state every process writes into (None: the main process
    # writes the whole state)
    state_dir: str | None

    @property
    def steps_in_backward(self) -> bool: ...

    def prepare(self, c, groups: list[dict]) -> None: ...

    def make_stepper(self, opts, c, groups: list[dict], plan): ...

    def full_weights(self, c) -> ContextManager: ...

    def ema_weights(self, c) -> ContextManager: ...

    def share(self, n: int) -> list[tuple[int, bool]]: ...

    def state_flags(self) -> dict: ...

    def state_note(self) -> str: ...

    def save_process_state(self, folder: str, named: list, c) -> None: ...

    def load_process_state(self, folder: str, named: list, c) -> None: ...

    def close(self) -> None: ...


class SingleProcess:
    """One process: nothing to wrap, share or gather."""

    name = "single process"
    forward_in_every_process = False
    weights_sharded = False
    state_dir = None

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.stepper = None

    @property
    def steps_in_backward(self) -> bool:
        return self.stepper.steps_in_backward

    def prepare(self, c, groups: list[dict]) -> None:
        pass

    def make_stepper(self, opts, c, groups: list[dict], plan):
        """Plain, fused_backward_pass or fused_optimizer_groups: optimizer(s) and scheduler(s);
        the plain stepper sums the gradients across processes (a no-op for one)."""
        from library.training.stepper import make_stepper

        self.stepper = make_stepper(self.accelerator, opts, groups, c.params,
                                    warmup_steps=plan.warmup_steps, total_steps=plan.total_steps)
        return self.stepper

    def full_weights(self, c) -> ContextManager:
        return contextlib.nullcontext()

    def ema_weights(self, c) -> ContextManager:
        return c.ema.swapped()

    def share(self, n: int) -> list[tuple[int, bool]]:
        """Item i is run by process i mod P (and kept there)."""
        acc = self.accelerator
        return [(i, True) for i in range(acc.process_index, n, acc.num_processes)]

    def state_flags(self) -> dict:
        return {"sharded": False, "deepspeed": False}

    def state_note(self) -> str:
        """What the log line of a saved training state adds."""
        return ""

    def save_process_state(self, folder: str, named: list, c) -> None:
        pass

    def load_process_state(self, folder: str, named: list, c) -> None:
        pass

    def close(self) -> None:
        pass


class DDP(SingleProcess):
    """Several processes, each with the whole model (data parallel): the stepper's bucketed
    all-reduce sums the gradients after the last micro-step. (PyTorch DDP with communication
    overlapped with the backward pass would wrap the trained modules in ``prepare`` and skip
    the gradient sync of the earlier micro-steps.)"""

    name = "data parallel"


class FSDP(SingleProcess):
    """``fsdp``: the trained U-Net / text encoders sharded with FSDP2 (library/distributed/fsdp.py)."""

    name = "fsdp"
    weights_sharded = True
    state_dir = SHARDED_DIR

    def __init__(self, accelerator):
        super().__init__(accelerator)
        # every forward all-gathers the block's weights from all processes
        self.forward_in_every_process = accelerator.num_processes > 1
        self.modules: list = []   # (name, module) trained, the training state's layout
        self.roots: list = []     # the sharded ones (none on one process)

    def prepare(self, c, groups: list[dict]) -> None:
        from library.distributed import fsdp

        # fixed for the run (even after stop_text_encoder_training freezes the text encoders)
        self.modules = fsdp.trained_roots(c.bundle, c.method)
        self.roots = fsdp.shard(self.accelerator, self.modules, groups)

    def make_stepper(self, opts, c, groups: list[dict], plan):
        """The plain stepper without its all-reduce (FSDP's reduce-scatter sums the gradients)
        and without the optimizer in its state (written with the shards)."""
        from library.training.stepper import make_stepper

        self.stepper = make_stepper(self.accelerator, opts, groups, c.params,
                                    warmup_steps=plan.warmup_steps, total_steps=plan.total_steps,
                                    sharded=True)
        return self.stepper

    def full_weights(self, c) -> ContextManager:
        from library.distributed import fsdp

        return fsdp.full_weights(c.bundle, self.roots, self.accelerator)

    @contextlib.contextmanager
    def ema_weights(self, c):
        with c.ema.swapped(), self.full_weights(c):  # each process swaps its shard, then gathers
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

    def save_process_state(self, folder: str, named: list, c) -> None:
        from library.distributed import fsdp

        fsdp.save_sharded(self.modules, self.stepper.optimizer, c.ema, folder, named)

    def load_process_state(self, folder: str, named: list, c) -> None:
        from library.distributed import fsdp
        from library.outputs.train_state import ResumeError

        try:
            fsdp.load_sharded(self.modules, self.stepper.optimizer, c.ema, folder, named)
        except (KeyError, ValueError, RuntimeError) as e:
            raise ResumeError(f"resume: {os.path.dirname(folder)}: the sharded weights or optimizer "
                              "state do not fit this run "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


class DeepSpeed(SingleProcess):
    """``deepspeed``: the DeepSpeed engine over the trained modules (library/distributed/deepspeed_zero.py)."""

    name = "deepspeed"
    # stage 2 reduces in every micro-step's backward, stage 0/1 in the last one, and ZeRO builds
    # the partitioned gradient in the last one: every process runs every micro-step (a
    # zero-weight one for an empty share), even alone (a partial global batch)
    forward_in_every_process = True
    state_dir = DEEPSPEED_DIR

    def make_stepper(self, opts, c, groups: list[dict], plan):
        from library.distributed import deepspeed_zero as zero

        self.stepper = zero.make_stepper(opts, self.accelerator, plan,
                                         zero.trained_modules(c.bundle, c.method), groups)
        return self.stepper

    def full_weights(self, c) -> ContextManager:
        """In bf16 / fp16 the float32 master weights are saved (a collective)."""
        from library.distributed import deepspeed_zero as zero

        return zero.master_weights(c.params)

    @contextlib.contextmanager
    def ema_weights(self, c):
        with self.full_weights(c), c.ema.swapped():  # the EMA into the float32 master copies
            yield

    def state_flags(self) -> dict:
        return {"sharded": False, "deepspeed": True}

    def state_note(self) -> str:
        return (f", with DeepSpeed's partitioned optimizer state of "
                f"{self.accelerator.num_processes} process(es)")

    def save_process_state(self, folder: str, named: list, c) -> None:
        self.stepper.save_partitions(folder)  # ZeRO's partitioned optimizer state

    def load_process_state(self, folder: str, named: list, c) -> None:
        self.stepper.load_partitions(folder)

    def close(self) -> None:
        if self.stepper is not None:
            self.stepper.close()  # the engine (and the process group made for it)


def for_run(opts, accelerator) -> Strategy:
    if opts.deepspeed:
        return DeepSpeed(accelerator)
    if opts.fsdp:
        return FSDP(accelerator)
    if accelerator.num_processes > 1:
        return DDP(accelerator)
    return SingleProcess(accelerator)
