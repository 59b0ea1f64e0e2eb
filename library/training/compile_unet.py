"""``torch_compile`` / ``dynamo_backend``: the U-Net's training forward through torch.compile
(FLUX.1's and SD3's transformer likewise: their blocks are the double/single-stream and joint
blocks).

The U-Net is compiled in place (its ``forward`` replaced by the compiled one: the module, its
parameter names and its state dict stay what they were, so saves, resumes, EMA and the LoRA
file are unchanged), after the network has hooked its layers and gradient checkpointing is set,
so the compiled graph holds the LoRA forward and the checkpointed regions.

A graph break makes dynamo split a forward into pieces with eager Python in between; for a
training forward that also splits the compiled backward. So the U-Net is first tried as one
graph (``fullgraph=True``, which raises at trace time, before anything runs, instead of
breaking). If it cannot be one graph, each of its blocks (down, mid, up) is compiled as its own
graph the same way, and a block that cannot be one graph either runs eagerly; each fallback is
announced once, with dynamo's reason. The time of the first call (where tracing and compiling
happen; the backward graph compiles in the first backward) is logged.

Under several processes with the plain stepper the U-Net runs inside DistributedDataParallel's
forward (library/distributed/ddp.py): dynamo's DDPOptimizer (``torch._dynamo.config.optimize_ddp``,
on by default) then splits each compiled graph at DDP's bucket boundaries (``ddp_bucket_cap_mb``),
so each bucket's all-reduce starts when its piece of the compiled backward is done, while the
rest of the backward runs; DDP's reducer, its SUM comm hook, ``no_sync`` and the search for
unused parameters work on the compiled backward as on the eager one.

The fused steppers (``fused_backward_pass``, ``fused_optimizer_groups``) step each parameter in its
post-accumulate-grad hook, so that the gradients of the whole U-Net never exist at once. A
compiled graph's backward is one autograd node that returns every gradient of the graph
together (with AOT autograd: aot_eager, inductor, cudagraphs), so one graph would hold all the
U-Net's gradients before the first hook fires (measured: 40 of 40 MiB of gradients alive at the
first hook, 4 MiB eager). With a fused stepper the U-Net is therefore compiled block by block
(``per_block``): one block's gradients at a time, and under several processes the hooks' sums
of one block are in flight while the next block's backward runs.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from library.errors import UserError, first_line

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options



class CompileError(UserError, ValueError):
    pass


def check_options(opts: Options) -> None:
    """torch_compile's combinations, before any weight loads."""
    if not opts.torch_compile:
        return
    if opts.dynamo_backend == "no":
        raise CompileError("torch_compile with dynamo_backend = \"no\": choose a backend "
                           "(inductor, aot_eager, eager, cudagraphs) or drop torch_compile")
    for name in ("fsdp", "deepspeed"):
        if getattr(opts, name):
            raise CompileError(f"torch_compile cannot be combined with {name} yet (its sharded "
                               "modules are not compiled by this toolkit); drop one of them")


def _is_graph_break(e: Exception) -> bool:
    """What fullgraph=True raises for a graph break (dynamo cannot trace some Python), as opposed
    to an error of the model itself (a shape mismatch is a TorchRuntimeError at trace time),
    which must propagate."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when
    # _is_graph_break() runs
    import torch._dynamo.exc as exc

    return isinstance(e, (exc.Unsupported, exc.UserError))


class _Compiled:
    """The ``forward`` of one module: compiled as one graph, or eager after a failed trace."""

    def __init__(self, module, name: str, backend: str, log, on_break=None):
        self.module = module
        self.name = name
        self.eager = module.forward
        self.backend = backend
        self.compiled = None  # torch.compile's wrapper, made at the first call
        self.log = log
        self.on_break = on_break  # called with the error instead of running eagerly
        self.state = "new"  # -> "compiled" or "eager"
        self.blocks: list | None = None  # the U-Net's: its blocks' own _Compiled, once made

    def __call__(self, *args, **kwargs):
        if self.state == "eager":
            return self.eager(*args, **kwargs)
        # a later call can trace again (a new shape; the training forward after a no_grad sample
        # at the start; the recompile after the DDP wrapper's rebuild): a graph break found
        # there falls back too (fullgraph raises at trace time, before anything ran)
        first, t = self.state == "new", time.perf_counter()
        if self.compiled is None:
            # lazy: the dry run's plan loads this module before torch; torch is imported when
            # __call__() runs
            import torch

            self.compiled = torch.compile(self.eager, backend=self.backend, fullgraph=True)
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - only dynamo's own errors are caught (below)
            if not _is_graph_break(e):
                raise
            reason = first_line(e)
            if self.on_break is not None:
                self.state = "eager"  # the caller takes over (per-block fallback)
                return self.on_break(reason, args, kwargs)
            self.log.warning(f"torch_compile: {self.name} runs eagerly (graph break: {reason})")
            self.state = "eager"
            return self.eager(*args, **kwargs)
        if first:
            self.state = "compiled"
            self.log.info(f"torch_compile: {self.name} traced and compiled in "
                          f"{time.perf_counter() - t:.1f}s (first forward; its backward "
                          "compiles in the first backward)")
        return out


# the block lists compiled one by one: the U-Net's, FLUX.1's double- and single-stream blocks,
# SD3's joint blocks (library/models/families/flux/flux.py, library/models/families/sd3/sd3.py)
BLOCK_LISTS = ("down_blocks", "up_blocks", "double_blocks", "single_blocks", "joint_blocks")


def _blocks(unet) -> list:
    """(name, module) of the denoiser's blocks that are compiled one by one in the fallback."""
    out = []
    for kind in BLOCK_LISTS:
        for i, m in enumerate(getattr(unet, kind, None) or []):
            out.append((f"{kind}.{i}", m))
    if getattr(unet, "mid_block", None) is not None:
        out.append(("mid_block", unet.mid_block))
    return out


def _what(unet) -> str:
    return "U-Net" if hasattr(unet, "down_blocks") else "transformer"


def compile_unet(unet, backend: str, log=None, per_block: bool = False):
    """Compile ``unet``'s forward in place with ``backend``; returns the installed wrapper (its
    ``state`` and, after a fallback or with ``per_block``, ``blocks`` say what was compiled).
    ``per_block``: compile each block as its own graph from the start (the fused steppers: see
    the module docstring); the U-Net's own forward between the blocks runs eagerly."""
    log = log or logging.getLogger("sdtk")
    # lazy: the dry run's plan loads this module before torch; torch is imported when compile_unet()
    # runs
    import torch._dynamo

    # A bucketed run sees a few shapes (bucket sizes, a last partial batch): dynamo recompiles
    # per shape up to this limit (its default 8), then marks the size dynamic.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    t0 = time.perf_counter()
    what = _what(unet)

    def compile_blocks():
        whole.blocks = []
        for name, m in _blocks(unet):
            w = _Compiled(m, f"{what} {name}", backend, log)
            m.forward = w
            whole.blocks.append(w)
        unet.forward = whole.eager

    def fallback(reason, args, kwargs):
        log.warning(f"torch_compile: the {what} cannot be compiled as one graph ({reason}); "
                    "compiling its blocks one by one")
        compile_blocks()
        return whole.eager(*args, **kwargs)

    whole = _Compiled(unet, what, backend, log, on_break=fallback)
    if per_block:
        whole.state = "eager"  # the U-Net's own forward; its blocks are the graphs
        compile_blocks()
    else:
        unet.forward = whole
    how = "block by block" if per_block else "forward"
    log.info(f"torch_compile: {what} {how} with dynamo backend {backend} "
             f"(set up in {time.perf_counter() - t0:.2f}s; compiled at its first call)")
    return whole
