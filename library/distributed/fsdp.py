"""``fsdp``: full fine-tuning with the weights, gradients and optimizer state sharded across the
processes (PyTorch FSDP2, ``torch.distributed.fsdp.fully_shard``), applied by the toolkit itself.

Accelerate's own FSDP path is not used: on a machine without CUDA Accelerate falls back to plain
data parallelism, and the toolkit never hands its model to ``accelerator.prepare``. Here:

- ``shard(accelerator, modules, groups)`` (set-up, by the FSDP strategy of library/distributed/strategy.py,
  before the optimizer exists): ``fully_shard`` on each
  U-Net block (down, mid, up; FLUX.1's double/single-stream blocks; SD3's joint blocks), then on
  the U-Net (transformer) itself; for each trained text encoder on each
  transformer layer, then on the encoder. The mesh is one dimension over the run's process group
  (gloo on CPU, NCCL on CUDA). Every parameter becomes a ``DTensor`` sharded on dim 0 (each
  process holds ~1/P of it); the optimizer is built over those, so its state is sharded too.
  The param groups are re-pointed at the sharded parameters (same names, same order).
- Gradients: the loss of each process is already divided by the global batch, so the gradients
  must be summed across processes, not averaged: the reduce-scatter runs with divide factor 1
  and plain SUM (gloo has no PREMUL_SUM). The FSDP strategy therefore gives the stepper no
  gradient sum of its own (``grad_sum`` None); global-norm clipping runs on the sharded gradients
  (``clip_grad_norm_`` computes the norm of the whole DTensor gradient).
- Every process must run every forward (each one all-gathers the block's weights): a process
  with an empty share of a micro-step runs a zero-weight forward and backward
  (``forward_in_every_process``); validation and sample images run every image/prompt on every
  process (each process keeps or writes only its own share).
- Saves: ``full_weights(bundle, roots, accelerator)`` gathers the full state dict on every process (a collective) and,
  on the main process, puts unsharded copies of the sharded modules into the bundle for the
  method's save. The training state keeps the weights, optimizer state and EMA sharded:
  ``save_sharded`` / ``load_sharded`` write and read them with ``torch.distributed.checkpoint``
  (one file per process plus its metadata; it reshards on load, so a resume may change the
  process count). With ``fsdp`` on one process nothing is sharded (there is nothing to shard
  across), but the state has the same format.

Rejected with ``fsdp``: ``fused_backward_pass`` / ``fused_optimizer_groups`` (they step whole
parameters inside backward hooks; FSDP reduce-scatters per block), ``full_bf16`` / ``full_fp16``
(their stochastic rounding and loss scaling are per whole tensor), ``ema_device cpu`` (the EMA is
sharded beside the weights), and LoRA (``train_lora.py`` does not take the option: the network
is small and trains with plain data parallelism).
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import TYPE_CHECKING

from library.accelerator import DistributedError, _is_multi_process, is_main_process
from library.errors import UserError

if TYPE_CHECKING:  # annotations only: torch is imported when a function runs
    from library.config.parse import Options
    from torch.nn import Module

logger = logging.getLogger("sdtk")


class FSDPError(UserError, ValueError):
    pass


def enabled(opts: Options) -> bool:
    return opts.fsdp


def check_options(opts: Options) -> None:
    """Combinations that cannot work with fsdp, and launcher configs the toolkit does not use;
    before any weight is loaded."""
    check_launch_environment()
    if not enabled(opts):
        return
    if opts.fused_backward_pass:
        raise FSDPError("fsdp cannot be combined with fused_backward_pass: the fused step needs each "
                        "parameter's whole gradient inside its backward hook, FSDP reduce-scatters "
                        "per block into shards; drop one of them")
    if opts.fused_optimizer_groups:
        raise FSDPError("fsdp cannot be combined with fused_optimizer_groups (groups are stepped "
                        "inside backward hooks on whole gradients); drop one of them")
    for name in ("full_bf16", "full_fp16"):
        if getattr(opts, name):
            raise FSDPError(f"fsdp cannot be combined with {name} yet (its float32 step with "
                            "stochastic rounding / loss scaling is not implemented for sharded "
                            "weights); use mixed_precision alone")
    if opts.ema_device == "cpu":
        raise FSDPError("fsdp cannot be combined with ema_device cpu: with fsdp the EMA is sharded "
                        "like the weights (each process keeps its shard beside its weights)")


def check_launch_environment() -> None:
    """``accelerate launch`` with an FSDP config: the toolkit's loop never hands the model to
    Accelerate, so it would not engage; say so instead of training unsharded. (A DeepSpeed config
    is read into the deepspeed options: library/distributed/deepspeed_zero.py.)"""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        raise FSDPError("Accelerate's FSDP config is not used by this toolkit (the model is never "
                        "passed to accelerator.prepare); launch without it and set the fsdp option "
                        "(train_dreambooth.py / finetune.py), which shards with FSDP2 itself")


# -- sharding -------------------------------------------------------------------------------------
# the FSDP units of a flow-matching transformer: FLUX.1's double- and single-stream blocks, SD3's
# joint blocks (library/models/families/flux/flux.py, library/models/families/sd3/sd3.py); the embedders and final layer stay in the root unit
TRANSFORMER_BLOCKS = ("double_blocks", "single_blocks", "joint_blocks")
def _blocks(root, kind: str) -> list:
    """The submodules that become FSDP units of one root (U-Net or text encoder), in order."""
    if kind == "unet" and not hasattr(root, "down_blocks"):  # FLUX.1's / SD3's transformer
        return [m for name in TRANSFORMER_BLOCKS for m in getattr(root, name, ())]
    if kind == "unet":
        units = list(root.down_blocks)
        if getattr(root, "mid_block", None) is not None:
            units.append(root.mid_block)
        return units + list(root.up_blocks)
    encoder = root.text_model.encoder if hasattr(root, "text_model") else root.encoder
    return list(encoder.layers)


def trained_roots(b, method) -> list[tuple[str, Module]]:
    """(name, module) of the modules a full fine-tune trains (named as in the training state)."""
    out = []
    if method.train_unet:
        out.append(("unet", b.unet))
    if method.train_text_encoder:
        lrs = method.text_encoder_lrs()
        for i, te in enumerate(b.text_encoders):
            if lrs[i]:
                out.append(("text_encoder" if i == 0 else f"text_encoder_{i + 1}", te))
    return out


def shard(acc, roots: list[tuple[str, Module]], groups: list[dict]) -> list[tuple[str, Module]]:
    """Shard the trained modules ``roots`` across the processes and re-point ``groups`` (the
    optimizer's param groups, also the method's) at the sharded parameters; returns the sharded
    roots (none on one process)."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when shard() runs
    import torch.distributed as dist

    if acc.num_processes == 1:
        logger.info("fsdp: one process, nothing to shard: the model trains unsharded (the training "
                    "state is written in the sharded format all the same)")
        return []
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != acc.num_processes:
        raise DistributedError(f"fsdp: {acc.num_processes} processes but no process group of that "
                               "size; launch with accelerate launch --num_processes N or torchrun")
    # lazy: the dry run's plan loads this module before torch; torch is imported when shard() runs
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    before = {}
    for name, root in roots:
        for n, p in root.named_parameters():
            before[id(p)] = (name, n)
    mesh = init_device_mesh(acc.device.type, (acc.num_processes,))
    for kind, root in roots:
        unit_kind = "unet" if kind == "unet" else "text_encoder"
        units = _blocks(root, unit_kind) + [root]
        for unit in units:
            fully_shard(unit, mesh=mesh)  # resharded after forward: memory first
        for unit in units:
            # Summed, not averaged: each process's loss is already weighted by its share of the
            # global batch. SUM without a pre/post factor (gloo has no PREMUL_SUM).
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    after = {}
    for name, root in roots:
        for n, p in root.named_parameters():
            after[(name, n)] = p
    for g in groups:
        g["params"] = [after[before[id(p)]] if id(p) in before else p for p in g["params"]]
    n_units = sum(len(_blocks(r, "unet" if k == "unet" else "text_encoder")) + 1 for k, r in roots)
    logger.info(f"fsdp: {', '.join(k for k, _ in roots)} sharded across {acc.num_processes} "
                f"processes ({n_units} FSDP units; each process holds about 1/{acc.num_processes} "
                "of the weights, gradients and optimizer state)")
    return roots


# -- full weights for a model save ----------------------------------------------------------------
def _plain_copy(module, full: dict):
    """An unsharded module of ``module``'s class and config holding ``full`` (its full state dict);
    buffers (FSDP does not shard them) are taken over as they are."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when _plain_copy()
    # runs
    import torch

    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(module).__mro__[1:] if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        copy = cls.from_config(module.config) if hasattr(cls, "from_config") else cls(module.config)
    copy.load_state_dict(full, strict=True, assign=True)
    for name, buf in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        target = copy.get_submodule(owner) if owner else copy
        target._buffers[leaf] = buf.detach().clone()
    missing = [n for n, t in list(copy.named_parameters()) + list(copy.named_buffers())
               if t.device.type == "meta"]
    if missing:
        raise RuntimeError(f"fsdp: gathering the full weights left {missing[0]} unset")
    copy.train(module.training)
    copy.requires_grad_(False)
    return copy


@contextlib.contextmanager
def full_weights(b, roots: list[tuple[str, Module]], acc):
    """Inside: on the main process, the bundle ``b`` holds unsharded copies of the sharded
    modules ``roots`` (for a model save). Every process must enter it (the gather is a
    collective). A no-op when nothing is sharded."""
    if not roots:
        yield
        return
    # lazy: the dry run's plan loads this module before torch; torch is imported when full_weights()
    # runs
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    main = is_main_process()
    copies = {}
    for name, root in roots:
        full = get_model_state_dict(root, options=opts)  # every process; filled on rank 0 only
        if main:
            copies[name] = _plain_copy(root, full).to(acc.device)
        del full
    saved_unet, saved_tes = b.unet, list(b.text_encoders)
    try:
        if main:
            if "unet" in copies:
                b.unet = copies["unet"]
            tes = list(b.text_encoders)
            for i in range(len(tes)):
                key = "text_encoder" if i == 0 else f"text_encoder_{i + 1}"
                if key in copies:
                    tes[i] = copies[key]
            b.text_encoders = tes
        yield
    finally:
        b.unet, b.text_encoders = saved_unet, saved_tes
        copies.clear()


# -- sharded training state -----------------------------------------------------------------------
def _container(modules):
    # lazy: the dry run's plan loads this module before torch; torch is imported when _container()
    # runs
    import torch

    return torch.nn.ModuleDict({name: module for name, module in modules})


def _inner(optimizer):
    """The torch optimizer inside Accelerate's wrapper."""
    # lazy: the dry run's plan loads this module before torch; accelerate is imported when _inner()
    # runs
    from accelerate.optimizer import AcceleratedOptimizer

    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def _state(modules, optimizer, ema, named: list[tuple[str, object]]) -> dict:
    # lazy: the dry run's plan loads this module before torch; torch is imported when _state() runs
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"model": {n: p for n, p in named},
             "optimizer": get_optimizer_state_dict(_container(modules), _inner(optimizer))}
    if ema is not None:
        state["ema"] = {n: e for (n, _), e in zip(named, ema.shadow)}
    return state


def save_sharded(modules, optimizer, ema, folder: str, named: list[tuple[str, object]]) -> None:
    """Every process writes its shards of the weights, optimizer state and EMA to ``folder``
    (``torch.distributed.checkpoint``: one file per process and a metadata file)."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when save_sharded()
    # runs
    import torch.distributed.checkpoint as dcp

    with _quiet_single_process():
        dcp.save(_state(modules, optimizer, ema, named), checkpoint_id=folder, no_dist=not _is_multi_process())


def load_sharded(modules, optimizer, ema, folder: str, named: list[tuple[str, object]]) -> None:
    """Read ``folder`` into this run's (sharded or not) weights, optimizer and EMA, resharding to
    this run's process count."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when load_sharded()
    # runs
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    with _quiet_single_process():
        state = _state(modules, optimizer, ema, named)
        # in place into the parameters and EMA tensors
        dcp.load(state, checkpoint_id=folder, no_dist=not _is_multi_process())
    set_optimizer_state_dict(_container(modules), _inner(optimizer), state["optimizer"])


@contextlib.contextmanager
def _quiet_single_process():
    """torch.distributed.checkpoint warns on every call without a process group (one process),
    which is the intended use here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
