"""Processes: world size before torch is imported, the Accelerator, bucketed gradient sums.

Each process backpropagates its share of the global batch (loss already weighted by
1/len(global batch)); the gradients of all processes are then summed, so every process holds
the one-process gradient of the whole global batch and takes the same optimizer step. With the
plain stepper on several processes PyTorch's DistributedDataParallel sums them during the
backward pass (library/distributed/ddp.py). ``sum_gradients`` here is the synchronous sum after
the backward in flat buckets; ``BucketedSum`` (``BUCKETED_SUM``) is that sum as a stepper is given
it by its strategy (library/distributed/strategy.py): after the backward (the plain stepper, when
nothing summed during the backward) or one fused unit at a time, synchronously or launched
(``UnitReduction``). benchmarks/ddp_scaling.py's "sum" column gives it to the plain stepper as the
comparison. Every process joins the gradient sum and the loop's one small collective
(library/training/step_sync.py) once per step, whatever its share (an empty share contributes
zeros).

If one process fails, the launcher (``accelerate launch`` / ``torchrun``) terminates the others;
the process group's timeout bounds the wait of a process whose peer hangs without exiting.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from library.errors import UserError, first_line

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

# Seconds a collective may wait for a peer before it fails (torch's own default for gloo).
DEFAULT_TIMEOUT_S = 1800


class DistributedError(UserError, RuntimeError):
    pass


def launched_world_size() -> int:
    """Number of processes the launcher started (accelerate launch / torchrun set WORLD_SIZE)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def is_main_process() -> bool:
    """Whether this is the main process: the one answer every module asks (the process that prints
    the plan and progress, logs at INFO, takes the output lock and writes the files all processes
    agree on). Global rank 0 of the launcher (``accelerate launch`` / ``torchrun`` set RANK; a
    plain ``python`` run is rank 0): known before torch loads and before the Accelerator exists,
    and the same rank the Accelerator's process group is then built on."""
    return int(os.environ.get("RANK", "0")) == 0


def accelerator_precision(opts: Options) -> str:
    """The mixed precision the run's Accelerator gets; a UserError where it cannot work here
    (checked again by make_accelerator; Run.validate calls this before any folder or weight)."""
    # lazy: --help, the dry run's plan and the UI server's start load this module before torch;
    # torch is imported when accelerator_precision() runs
    import torch

    mixed = opts.mixed_precision
    if opts.full_fp16 and not torch.cuda.is_available():
        # full_fp16 on a CPU: every weight is fp16 and computes in fp16 without autocast (which
        # the CPU lacks for fp16); the stepper scales the loss itself
        mixed = "no"
    check_mixed_precision(mixed)
    return mixed


def check_mixed_precision(mixed_precision: str) -> None:
    # lazy: --help, the dry run's plan and the UI server's start load this module before torch;
    # torch is imported when check_mixed_precision() runs
    import torch

    if mixed_precision == "fp16" and not torch.cuda.is_available():
        # Accelerate accepts it on the CPU but applies neither fp16 autocast nor loss scaling.
        raise UserError("mixed_precision: fp16 needs a CUDA GPU (on CPU Accelerate applies neither "
                        "fp16 autocast nor loss scaling); use bf16 (CPU autocast) or no")


def accelerator_for(opts: Options):
    """The run's Accelerator from its options (used by the trainer and the caching tool alike)."""
    return make_accelerator(accelerator_precision(opts),
                            timeout_s=opts.ddp_timeout * 60 if opts.ddp_timeout else None)


def make_accelerator(mixed_precision: str, timeout_s: float | None = None):
    """An Accelerator that joins CPU processes into one gloo job when CUDA is absent.

    A plain ``Accelerator()`` on a machine without CUDA ignores the launcher and runs N
    independent single-process jobs; ``cpu=True`` makes Accelerate read the launcher's
    environment and initialise a gloo process group. A launch whose processes did not join
    into one job of the launched size is an error, never N silent copies of the run.
    """
    # lazy: --help, the dry run's plan and the UI server's start load this module before torch;
    # torch and accelerate are imported when make_accelerator() runs
    import torch
    from accelerate import Accelerator

    cpu = not torch.cuda.is_available()
    check_mixed_precision(mixed_precision)
    # An Accelerate DeepSpeed launch was read into the deepspeed options (library/distributed/deepspeed_zero.py): the
    # toolkit drives the engine itself, so Accelerate sets up a plain job.
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    launched = launched_world_size()
    handlers = []
    if launched > 1:

        # lazy: --help, the dry run's plan and the UI server's start load this module before torch;
        # accelerate is imported when make_accelerator() runs
        from accelerate.utils import InitProcessGroupKwargs

        kw: dict[str, object] = {"timeout": timedelta(seconds=float(timeout_s or DEFAULT_TIMEOUT_S))}
        if cpu:
            kw["backend"] = "gloo"  # not MPI, even where torch was built with it
        handlers.append(InitProcessGroupKwargs(**kw))
    acc = Accelerator(cpu=cpu, mixed_precision=mixed_precision, gradient_accumulation_steps=1,
                      kwargs_handlers=handlers)
    if launched > 1 and acc.num_processes != launched:
        raise DistributedError(
            f"the launcher started {launched} processes (WORLD_SIZE) but they did not join one "
            f"distributed job (Accelerate sees {acc.num_processes}); check the launch command")
    return acc


def free_port() -> int:
    """A TCP port free on this machine now (for a launcher's rendezvous: the UI's jobs, the
    benchmarks' and tests' launches)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_LEAVE_REGISTERED: list[bool] = []


def leave_process_group_at_exit(finished: bool) -> None:
    """Have this process leave its process group at interpreter exit (once per process).

    A gloo group left standing is torn down by C++ static destruction after Python has finished,
    where its threads (rank 0's TCP store among them) can abort the process ("terminate called
    without an active exception", exit -6) after every file was written. At exit, after whatever
    the caller still reads from the group (a test worker's rank), the processes of a finished run
    meet once more, then each destroys its group; a failed run's process only destroys its own
    (its peers may be gone)."""
    if _LEAVE_REGISTERED:
        return
    _LEAVE_REGISTERED.append(finished)
    atexit.register(_leave_process_group, finished)


def _leave_process_group(finished: bool) -> None:
    if "torch.distributed" not in sys.modules:  # no run got as far as a process group
        return
    # lazy: --help, the dry run's plan and the UI server's start load this module before torch;
    # torch is imported when _leave_process_group() runs
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if finished and dist.get_world_size() > 1:
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=60))
            else:
                dist.barrier()
        except RuntimeError:  # a peer already gone: leave anyway
            pass
    dist.destroy_process_group()


def _is_multi_process() -> bool:
    # lazy: --help, the dry run's plan and the UI server's start load this module before torch;
    # torch is imported when _is_multi_process() runs
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# What a collective raises on a surviving process when a peer has ended (gloo's TCP transport,
# NCCL's watchdog) or did not answer within the process group's timeout.
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "remote worker crashing", "nccl communicator was aborted", "ncclremoteerror")
_PEER_SILENT = ("timed out", "timeout")


def peer_failure(e: BaseException) -> str | None:
    """One line for a process of a multi-process run whose collective failed because another
    process ended (e.g. rank 0's one-line error on a save) or hung: that process's own line says
    what went wrong, this one says why it stops. None when ``e`` is something else."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world < 2 or not isinstance(e, RuntimeError):
        return None
    text = str(e).lower()
    who = f"process {os.environ.get('RANK', '?')} of {world}"
    if any(k in text for k in _PEER_GONE):
        return (f"{who}: stopped because another process of the job ended (its error, above or "
                "in its log, says why)")
    dist_error = type(e).__name__.startswith("Dist") or "gloo" in text or "nccl" in text
    if dist_error and any(k in text for k in _PEER_SILENT):
        return (f"{who}: stopped because another process did not answer within ddp_timeout "
                f"({first_line(e)[:200]})")
    return None


# The size of one flat all-reduce bucket, as DDP's default.
BUCKET_BYTES = 25 * 1024 * 1024


def gradient_buckets(params, bucket_bytes: int = BUCKET_BYTES) -> list[list]:
    """The flat buckets ``sum_gradients`` all-reduces: ``params`` (all with a gradient) grouped by
    gradient dtype and device in first-seen order, each group cut after the parameter that
    brings a bucket to ``bucket_bytes``. One rule for every caller (the fused steppers' overlapped
    sums use it too), so that the same gradients are always summed in the same layout."""
    by_dtype: dict = {}
    for p in params:
        by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    # Same order in every process: params come in the same order, dicts keep insertion order.
    buckets = []
    for group in by_dtype.values():
        bucket, size = [], 0
        for p in group:
            bucket.append(p)
            size += p.grad.numel() * p.grad.element_size()
            if size >= bucket_bytes:
                buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            buckets.append(bucket)
    return buckets


def sum_gradients(params, bucket_bytes: int = BUCKET_BYTES) -> None:
    """All-reduce (sum) the gradients of ``params`` across processes in flat buckets.

    One collective per ~25 MB bucket, as DDP does, instead of one per tensor, plus one small
    collective that says which parameters received a gradient in any process. A parameter that
    received no gradient in this process (an empty share of the global batch) counts as zeros,
    so every process takes part in every collective; a parameter that received none in any
    process keeps ``grad = None`` afterwards, exactly as in a one-process run (optimizers skip
    such parameters: no weight decay, no moment update).
    """
    # lazy: --help, the dry run's plan and the UI server's start load this module before torch;
    # torch is imported when sum_gradients() runs
    import torch
    import torch.distributed as dist

    if not _is_multi_process():
        return
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    device = params[0].device
    had_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                            device=device)
    dist.all_reduce(had_grad, op=dist.ReduceOp.SUM)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in gradient_buckets(params, bucket_bytes):
        flat = torch.cat([q.grad.reshape(-1) for q in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for q in bucket:
            n = q.grad.numel()
            q.grad.copy_(flat[offset:offset + n].view_as(q.grad))
            offset += n
    for p, n in zip(params, had_grad.tolist()):
        if n == 0:
            p.grad = None


class UnitReduction:
    """The sum across processes of one fused unit's gradients, launched (``async_op``) when the
    unit is complete; ``wait()`` puts the sums into ``p.grad``.

    The same collectives as the synchronous ``BucketedSum.unit``, so the same sums bit for bit:
    one parameter's gradient is all-reduced in place; a group's gradients in the flat buckets of
    ``gradient_buckets`` (the layout of ``sum_gradients``, which decides the order in which a ring
    all-reduce adds up each element). Each gradient is copied into its bucket and freed at once,
    so a sum in flight holds one copy of the unit's gradients, not two; ``wait()`` copies the sums
    back into tensors of the gradients' own shapes and strides, one bucket at a time, freeing each
    bucket after it. Every parameter of a complete unit has a gradient (its hook fired), so the
    synchronous sum's "who has a gradient" collective would find all of them everywhere and is
    not needed."""

    def __init__(self, params):
        # lazy: --help, the dry run's plan and the UI server's start load this module before torch;
        # torch is imported when __init__() runs
        import torch
        import torch.distributed as dist

        self.works, self.buckets = [], []
        if len(params) == 1:
            self.works.append(dist.all_reduce(params[0].grad, op=dist.ReduceOp.SUM,
                                              async_op=True))
            return
        for bucket in gradient_buckets(params):
            first = bucket[0].grad
            flat = torch.empty(sum(p.grad.numel() for p in bucket), dtype=first.dtype,
                               device=first.device)
            layout, offset = [], 0
            for p in bucket:
                g, n = p.grad, p.grad.numel()
                flat[offset:offset + n].copy_(g.reshape(-1))
                layout.append((p, offset, g.shape, g.stride()))
                p.grad = None
                offset += n
            self.works.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True))
            self.buckets.append((flat, layout))

    def wait(self) -> None:
        # lazy: --help, the dry run's plan and the UI server's start load this module before torch;
        # torch is imported when wait() runs
        import torch

        for w in self.works:
            w.wait()
        self.works = []
        while self.buckets:
            flat, layout = self.buckets.pop(0)
            for p, offset, shape, stride in layout:
                g = torch.empty_strided(shape, stride, dtype=flat.dtype, device=flat.device)
                g.copy_(flat[offset:offset + g.numel()].view(shape))
                p.grad = g
            del flat


class BucketedSum:
    """How a stepper sums its gradients across processes when nothing summed them during the
    backward: the strategy (library/distributed/strategy.py) hands it to the stepper it builds, or
    None where the gradients arrive summed (DDP's reducer, FSDP's reduce-scatter) or there is one
    process. In one process (no process group) every method sums nothing.

    - ``after_backward(params)``: the plain stepper's sum before its norm and update
      (``sum_gradients``: the "who has a gradient" collective, then flat ~25 MB buckets).
    - ``unit(params)``: one fused unit, synchronously inside its last hook: one parameter's
      gradient all-reduced in place, a group's as ``sum_gradients``.
    - ``launch(params)``: one fused unit launched (``UnitReduction``,
      ``fused_reductions_in_flight``).
    """

    @property
    def across_processes(self) -> bool:
        """Whether there is anything to sum (several processes in one process group)."""
        return _is_multi_process()

    def after_backward(self, params) -> None:
        sum_gradients(params)

    def unit(self, params) -> None:
        if len(params) == 1 and params[0].grad is not None:
            if _is_multi_process():
                # lazy: --help, the dry run's plan and the UI server's start load this module before
                # torch; torch is imported when unit() runs
                import torch.distributed as dist

                dist.all_reduce(params[0].grad, op=dist.ReduceOp.SUM)
        else:
            sum_gradients(params)

    def launch(self, params) -> UnitReduction:
        return UnitReduction(params)


# The one instance the strategies (and direct callers of make_stepper) pass.
BUCKETED_SUM = BucketedSum()
