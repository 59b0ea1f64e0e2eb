"""PyTorch ``DistributedDataParallel`` for the plain step on several processes (the DDP strategy of
library/distributed/strategy.py).

    Denoiser(bundle, method)   the one module whose forward the loop calls (through DDP)
    wrap(denoiser, opts, acc)  DistributedDataParallel over its trained parameters
    check_options(opts)        ddp_* option combinations, before any weight loads

The loop calls ``strategy.forward(fn)``: ``fn`` runs the text encoding (when the text encoders
train) and the U-Net forward; under DDP it runs inside the wrapped denoiser's forward, so DDP's
reducer sees every training forward and all-reduces each gradient bucket as soon as its
gradients are ready, while the rest of the backward pass still runs.

- The denoiser holds the U-Net, the text encoders and the network (LoRA/LyCORIS) as submodules:
  whatever the method trains is in it (the new-token rows of pivotal tuning and textual inversion
  live inside the text encoders). Frozen parameters and every buffer are in DDP's ignore list, so
  DDP neither broadcasts a frozen SDXL U-Net at start-up nor syncs buffers in the forward; the
  trained parameters' shapes are checked across processes and their values broadcast from
  process 0 once (identical already: every process loads and seeds alike).
- Gradients stay the SUM over the global batch (the step-accounting contract: each process's
  loss is already divided by the global batch size): a comm hook all-reduces each bucket with
  SUM, without DDP's division by the world size. ``ddp_comm_hook`` bf16/fp16 use PyTorch's
  built-in compression hooks (which average) and multiply back by the world size: half the
  traffic, gradients rounded to 8 (bf16) or 11 (fp16) significant bits before the sum (lossy).
- Parameters that get no gradient in a step (clip_skip leaves the last text-encoder layer's LoRA
  unused, as SDXL's first text encoder, read at its penultimate layer; network module dropout;
  ...): DDP searches
  the autograd graph for them after each forward (``find_unused_parameters``), or with
  ``ddp_static_graph`` records them in the first step. A parameter that gets no gradient in any
  process keeps ``grad = None`` (DDP leaves a globally unused gradient untouched), as in one
  process: optimizers skip it. When the set of trained parameters changes mid-run
  (stop_text_encoder_training, stop_pivotal_training) the wrapper is built again over the new
  set, in every process at the same step.
"""
from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from library.errors import UserError

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")

class DDPOptionError(UserError, ValueError):
    pass


def _other_engine(opts: Options) -> str | None:
    """The option whose engine reduces the gradients instead of DDP, or None."""
    return ("fsdp" if opts.fsdp else "deepspeed" if opts.deepspeed else
            "fused_backward_pass" if opts.fused_backward_pass else
            "fused_optimizer_groups" if opts.fused_optimizer_groups else None)


def check_options(opts: Options, processes: int) -> None:
    """Before any weight loads: ddp_comm_hook only where DDP reduces the gradients, and
    ddp_static_graph not with gradient accumulation on several processes. The other ddp_*
    options are speed settings: where DDP does not run they have no effect (a warning at set-up
    on several processes)."""
    other = _other_engine(opts)
    if opts.ddp_comm_hook != "no" and other:
        raise DDPOptionError(f"ddp_comm_hook {opts.ddp_comm_hook} cannot be combined with {other}: "
                             f"DDP does not reduce the gradients there ({other} has its own "
                             "reduction); drop one of them")
    if opts.ddp_static_graph and opts.gradient_accumulation_steps > 1 and processes > 1 \
            and not other:
        # PyTorch's DDP with static_graph under no_sync() asserts in the first backward and,
        # past that, stops reducing (pytorch/pytorch#143580, a fix is pending as #187732)
        raise DDPOptionError("ddp_static_graph cannot be combined with gradient_accumulation_steps "
                             f"{opts.gradient_accumulation_steps} on several processes: PyTorch's "
                             "DDP does not reduce correctly with a static graph under no_sync "
                             "(pytorch/pytorch#143580); drop ddp_static_graph")


class Denoiser(torch.nn.Module):
    """What a training forward runs: ``forward(fn)`` returns ``fn()``. Its submodules are the
    models ``fn`` uses, so that DDP registers their trained parameters."""

    def __init__(self, bundle, method):
        super().__init__()
        self.unet = bundle.unet
        self.text_encoders = torch.nn.ModuleList(bundle.text_encoders)
        if isinstance(method.network, torch.nn.Module):
            self.network = method.network

    def forward(self, fn):
        return fn()


def ignored_names(module) -> list[str]:
    """The parameters that do not train and every buffer: DDP leaves them alone."""
    names = [n for n, p in module.named_parameters() if not p.requires_grad]
    return names + [n for n, _ in module.named_buffers()]


def trained(module) -> list:
    """The parameters that train now; a micro-step that finds one of them frozen (parameters
    only ever freeze mid-run) rebuilds the wrapper."""
    return [p for p in module.parameters() if p.requires_grad]


def sum_hook(process_group, bucket):
    """The bucket's SUM over the processes (DDP's own reduction divides by the world size)."""
    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def compressed_sum_hook(dtype_name: str):
    """PyTorch's bf16/fp16 compression hook (it all-reduces the bucket cast to bf16/fp16 and
    divided by the world size), multiplied back by the world size: the sum, at half the traffic."""
    inner = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}[dtype_name]

    def hook(process_group, bucket):
        n = (process_group if process_group is not None else dist.group.WORLD).size()
        return inner(process_group, bucket).then(lambda f: f.value().mul_(n))

    hook.__name__ = hook.__qualname__ = f"{dtype_name}_compressed_sum_hook"  # in DDP's logs
    return hook


def comm_hook(name: str):
    return sum_hook if name == "no" else compressed_sum_hook(name)


def _no_buffer_sync() -> dict:
    """DDP's argument for "no buffer sync in the forward" (every buffer is ignored anyway):
    ``forward_sync_buffers`` since torch 2.13, which deprecates ``broadcast_buffers``."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": False}


def wrap(module, opts: Options, accelerator, first: bool = True):
    """``module`` (a Denoiser) in DistributedDataParallel with the run's ddp_* options, or None
    when nothing in it trains (e.g. after stop_text_encoder_training froze the only trained
    part: nothing left to reduce). ``first``: DDP checks the trained parameters' shapes across
    the processes and broadcasts them from process 0 (identical already: every process loaded
    and seeded alike); a rebuild mid-run skips that."""
    if not any(p.requires_grad for p in module.parameters()):
        return None
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored_names(module))
    device = accelerator.device
    ddp = DistributedDataParallel(
        module,
        init_sync=first,
        device_ids=[device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda" else None,
        bucket_cap_mb=opts.ddp_bucket_cap_mb,
        gradient_as_bucket_view=opts.ddp_gradient_as_bucket_view,
        static_graph=opts.ddp_static_graph,
        # a graph search per forward for parameters without a gradient (clip_skip, frozen
        # parts): they then keep grad None; a static graph records them in its first step
        find_unused_parameters=not opts.ddp_static_graph,
        **_no_buffer_sync())
    ddp.register_comm_hook(None, comm_hook(opts.ddp_comm_hook))
    return ddp


def describe(opts: Options, processes: int) -> str:
    """The log line of the engine."""
    parts = [f"bucket {opts.ddp_bucket_cap_mb} MB"]
    if opts.ddp_gradient_as_bucket_view:
        parts.append("gradients as bucket views")
    parts.append("static graph" if opts.ddp_static_graph else "unused parameters searched per step")
    if opts.ddp_comm_hook != "no":
        parts.append(f"{opts.ddp_comm_hook}-compressed all-reduce (lossy)")
    if opts.torch_compile:
        # the compiled U-Net runs inside DDP's forward: dynamo's DDPOptimizer cuts its graph
        # there (library/training/compile_unet.py)
        parts.append("the compiled U-Net cut at the buckets by dynamo's DDPOptimizer")
    return (f"DistributedDataParallel over {processes} processes: gradients summed during the "
            f"backward pass ({', '.join(parts)})")


def speed_options_given(opts: Options) -> list[str]:
    """The ddp_* speed options this run sets (for the no-effect warning where DDP does not run)."""
    out = []
    if opts.ddp_gradient_as_bucket_view:
        out.append("ddp_gradient_as_bucket_view")
    if opts.ddp_static_graph:
        out.append("ddp_static_graph")
    if opts.ddp_bucket_cap_mb != 25:
        out.append("ddp_bucket_cap_mb")
    return out
