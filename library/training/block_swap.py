"""``blocks_to_swap``: transformer blocks kept in host memory and copied to the compute device
just ahead of their use (sd-scripts' and OneTrainer's block swap, for FLUX.1 and SD3).

Which blocks: sd-scripts' counts. FLUX.1: ``n // 2`` double blocks and ``(n - n // 2) * 2``
single blocks (a single block holds about half a double block's weights), the last ones of each
list; SD3: the last ``n`` joint blocks. Every other part of the transformer stays on the device.

How (``BlockSwap``): a swapped block's tensors live in host memory (pinned on CUDA), their
"home". The model calls ``BlockSwap.run(block, fn, *args)`` for every block (``Flux._run``,
``MMDiT._run``):

- forward: the block's tensors are copied in (or the prefetch started one block earlier is
  waited for), the next swapped block's copy is started on a side stream (CUDA: overlapped with
  this block's compute), the block runs, and its parameters point at their host copies again:
  the device copy is freed (autograd saved the parameter, not its data, so nothing keeps it);
- backward: an identity node on the block's outputs runs before the block's gradient is
  computed: the blocks after it (whose backward is complete) go home, gradients with them (with
  ``write_back`` the weights too, which a fused step has just updated on the device), the block
  comes in and the previous swapped block's copy starts. The last ones go home at the end of
  the backward.

Between blocks, every swapped parameter and its gradient are on the host: a plain optimizer
step updates them there (their optimizer state is created there), a fused step updates them on
the device inside the block's backward and ``write_back`` copies them home. The computation is
the same on the same values, so a run with swap trains the same weights as one without, bit for
bit on one CPU thread (tests/training/test_block_swap.py).

On the CPU the "device" and the host are both the CPU: the swap still copies in and out, and the
bytes resident on the compute device are the parameters not pointing at a host copy
(``device_bytes``), which is what the tests measure.

    check_options(opts, processes)           before any weight loads: one line per conflict (also
                                             blockwise_fused_optimizers: FLUX.1 / SD3 only)
    blocks_for(model, n)                     the swapped blocks of a FLUX.1 / SD3 transformer
    install(model, n, device, ...)           places the swapped blocks home, returns the BlockSwap
    device_bytes(model, swap)                the model's bytes resident on the compute device
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from library.errors import UserError
from library.models import flow_family, fp8, placement
from library.models.families.flux import flux
from library.models.families.sd3 import sd3
from library.models.families import registry

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")


class BlockSwapError(UserError, ValueError):
    """A blocks_to_swap value the model cannot take; one line."""


def check_options(opts: Options, processes: int) -> None:
    """blocks_to_swap / cpu_offload_checkpointing / blockwise_fused_optimizers: FLUX.1 and SD3
    only, and the combinations the swap cannot run (before any weight loads)."""
    n = opts.blocks_to_swap or 0
    if not (n or opts.cpu_offload_checkpointing or opts.blockwise_fused_optimizers):
        return
    src = opts.pretrained_model_name_or_path
    name = "blocks_to_swap" if n else ("cpu_offload_checkpointing" if opts.cpu_offload_checkpointing
                                       else "blockwise_fused_optimizers")
    if flow_family.family_before_loading(src) is None:
        raise BlockSwapError(f"{name}: an option of {registry.titles(flow=True, option=name)} transformers; {src} is "
                             "not one")
    if n and opts.cpu_offload_checkpointing:
        raise BlockSwapError("blocks_to_swap and cpu_offload_checkpointing cannot be combined "
                             "(as in sd-scripts)")
    if opts.cpu_offload_checkpointing and not opts.gradient_checkpointing:
        logger.warning("cpu_offload_checkpointing turns gradient_checkpointing on (as sd-scripts)")
    if not n:
        return
    # each of these keeps or steps parameters where the swap moves them away (a block's
    # optimizer, blockwise_fused_optimizers, steps it while it is on the device: allowed)
    for other, why in (("fused_optimizer_groups", "a group's step would meet parameters on the host "
                        "and on the device"),
                       ("ema_decay", "the average would read parameters on the host"),
                       ("torch_compile", "the swap's copies happen between the blocks' graphs"),
                       ("fsdp", "FSDP shards the parameters itself"),
                       ("deepspeed", "DeepSpeed owns the parameters' placement")):
        if getattr(opts, other):
            raise BlockSwapError(f"blocks_to_swap with {other}: not supported ({why})")
    if processes > 1:
        raise BlockSwapError(f"blocks_to_swap: one process only here ({processes} processes: DDP's "
                             "gradient buckets would meet parameters on the host)")


def _lists(model: nn.Module) -> list:
    """The model's block lists in forward order."""
    if isinstance(model, flux.Flux):
        return [model.double_blocks, model.single_blocks]
    if isinstance(model, sd3.MMDiT):
        return [model.joint_blocks]
    own = getattr(model, "swap_block_lists", None)  # a family's transformer that names its own lists
    if own is not None:
        return own()
    raise BlockSwapError(f"blocks_to_swap: an option of {registry.titles(flow=True)} transformers, "
                         f"not for {type(model).__name__}")


def counts(model: nn.Module, n: int) -> list[int]:
    """How many blocks of each list (forward order) ``blocks_to_swap = n`` keeps on the host."""
    lists = _lists(model)
    if len(lists) == 2:  # FLUX.1: n in units of double blocks (sd-scripts' Flux.enable_block_swap)
        want = [n // 2, (n - n // 2) * 2]
    else:
        want = [n]
    for lst, k, name in zip(lists, want, ("double", "single") if len(lists) == 2 else ("joint",)):
        if k > len(lst):
            most = len(lst) if len(lists) == 1 else _flux_max(len(lists[0]), len(lists[1]))
            raise BlockSwapError(f"blocks_to_swap {n}: asks for {k} of the model's {len(lst)} {name} "
                                 f"blocks (at most {most} here)")
    return want


def _flux_max(n_double: int, n_single: int) -> int:
    n = 0
    while (n + 1) // 2 <= n_double and (n + 1 - (n + 1) // 2) * 2 <= n_single:
        n += 1
    return n


def blocks_for(model: nn.Module, n: int) -> list[nn.Module]:
    """The blocks ``blocks_to_swap = n`` keeps on the host: the last ones of each list."""
    out = []
    for lst, k in zip(_lists(model), counts(model, n)):
        out.extend(list(lst)[len(lst) - k:] if k else [])
    return out


def _tensors(block: nn.Module) -> list:
    """(owner module, "_parameters" / "_buffers", name) of every tensor of the block, each once."""
    out, seen = [], set()
    for m in block.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(m, kind).items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append((m, kind, name))
    return out


class _BringIn(torch.autograd.Function):
    """Identity on a block's outputs; its backward runs before the block's own (sends the later
    blocks home, brings this one in). A marker on the inputs instead would change the order in
    which a shared input's (FLUX's vec) gradient contributions are summed: not bit-identical."""

    @staticmethod
    def forward(ctx, swap, index, *xs):
        ctx.swap, ctx.index = swap, index
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.swap._backward_enter(ctx.index)
        return (None, None, *grads)


class BlockSwap:
    """Streams the ``swapped`` blocks (all ``blocks`` in forward order, of which ``swapped`` live
    on ``host``) to ``device`` around their use. ``write_back``: copy the weights home after the
    block's backward (a fused step updated them on the device)."""

    def __init__(self, blocks: list, swapped: list, device, host, write_back: bool):
        self.device, self.host = torch.device(device), torch.device(host)
        self.write_back = write_back
        self.order = list(blocks)  # forward order
        self.index = {id(b): i for i, b in enumerate(self.order)}
        self.swapped = [self.index[id(b)] for b in swapped]
        self.is_swapped = set(self.swapped)
        # (owner, kind, name, the host tensor): a parameter's data (not the Parameter, whose
        # data the swap re-points), a buffer as it is
        self.home = {i: [(m, kind, name, getattr(m, kind)[name].data if kind == "_parameters"
                          else getattr(m, kind)[name]) for m, kind, name in _tensors(self.order[i])]
                     for i in self.swapped}
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.pending: dict[int, tuple] = {}  # index -> (device copies, event): copies started ahead of use
        self.inside: set[int] = set()  # swapped blocks whose tensors are on the device now

    def swapped_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for i in self.swapped for *_, t in self.home[i])

    def in_flight_bytes(self) -> int:
        """Bytes of the device copies started ahead of use and not yet taken by their block."""
        return sum(t.numel() * t.element_size() for data, grads, _ in self.pending.values()
                   for t in data + [g for g in grads if g is not None])

    def describe(self) -> str:
        n = len(self.swapped)
        return (f"{n} of the transformer's {len(self.order)} blocks "
                f"({self.swapped_bytes() / 1024 ** 2:.1f} MiB) kept in host memory, streamed to "
                f"{self.device} around their use")

    def host_pointers(self) -> set:
        return {t.data_ptr() for i in self.swapped for *_, t in self.home[i]}

    # --- copies ---------------------------------------------------------------------------
    def _start_copy(self, i: int, with_grads: bool) -> None:
        if i in self.inside or i in self.pending:
            return
        tensors = self.home[i]
        if self.stream is not None:  # CUDA
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # a write-back before
            with torch.cuda.stream(self.stream):
                data = [t.to(self.device, non_blocking=True) for *_, t in tensors]
                grads = [self._grad_to_device(m, kind, name, non_blocking=True) if with_grads else None
                         for m, kind, name, _ in tensors]
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            data = [t.to(self.device, copy=True) for *_, t in tensors]
            grads = [self._grad_to_device(m, kind, name) if with_grads else None for m, kind, name, _ in tensors]
            event = None
        self.pending[i] = (data, grads, event)

    def _grad_to_device(self, m, kind, name, non_blocking=False):
        p = getattr(m, kind)[name]
        if kind != "_parameters" or p.grad is None:
            return None
        return p.grad.to(self.device, non_blocking=non_blocking, copy=True)

    def _bring_in(self, i: int, with_grads: bool) -> None:
        if i not in self.is_swapped or i in self.inside:
            return
        self._start_copy(i, with_grads)
        data, grads, event = self.pending.pop(i)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in data + [g for g in grads if g is not None]:
                t.record_stream(current)
        for (m, kind, name, _), d, g in zip(self.home[i], data, grads):
            t = getattr(m, kind)[name]
            if kind == "_parameters":
                t.data = d
                if g is not None:
                    t.grad = g
            else:
                m._buffers[name] = d
        self.inside.add(i)

    def _send_out(self, i: int, backward: bool) -> None:
        if i not in self.inside:
            return
        with torch.no_grad():
            for m, kind, name, h in self.home[i]:
                t = getattr(m, kind)[name]
                if kind != "_parameters":
                    m._buffers[name] = h
                    continue
                if backward and self.write_back and t.requires_grad:
                    h.copy_(t.data, non_blocking=self.cuda)
                grad = t.grad
                t.data = h
                if grad is not None and backward:
                    t.grad = grad.to(self.host, non_blocking=self.cuda)
        if self.cuda and backward:  # the host copies must be complete before anyone reads them
            torch.cuda.current_stream(self.device).synchronize()
        self.inside.discard(i)

    def _next_swapped(self, i: int, step: int):
        j = i + step
        while 0 <= j < len(self.order):
            if j in self.is_swapped:
                return j
            j += step
        return None

    # --- the model's calls ----------------------------------------------------------------
    def run(self, block: nn.Module, fn, *args):
        """Block ``block``'s forward ``fn(*args)`` with its tensors on the device."""
        i = self.index[id(block)]
        if i == 0:
            self._end_of_pass()  # a forward that stopped half-way (an error, a skipped backward)
        self._bring_in(i, with_grads=False)
        nxt = self._next_swapped(i, 1)
        if nxt is not None:
            self._start_copy(nxt, with_grads=False)
        out = fn(*args)
        single = isinstance(out, torch.Tensor)
        outs = [out] if single else list(out)
        marked = [k for k, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        if torch.is_grad_enabled() and marked:
            # every block's outputs (swapped or not) mark where its backward begins
            for k, o in zip(marked, _BringIn.apply(self, i, *[outs[k] for k in marked])):
                outs[k] = o
        self._send_out(i, backward=False)
        return outs[0] if single else tuple(outs)

    def _backward_enter(self, i: int) -> None:
        """Block i's backward begins: every later block's backward is complete (the engine runs
        the nodes of later blocks first, its parameters' accumulation and fused steps before
        any other node), so those go home; block i comes in, the previous swapped one starts."""
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_pass)
        for j in [j for j in self.inside if j > i]:
            self._send_out(j, backward=True)
        self._bring_in(i, with_grads=True)
        prev = self._next_swapped(i, -1)
        if prev is not None:
            self._start_copy(prev, with_grads=True)

    def _end_of_pass(self) -> None:
        """Every block home, no copy in flight (end of a backward, start of a forward)."""
        for i in list(self.inside):
            self._send_out(i, backward=True)
        self.pending.clear()

    def restore(self) -> None:
        """Parameters back to ordinary tensors on the device (the swap ends)."""
        self._end_of_pass()
        for i in self.swapped:
            self._bring_in(i, with_grads=True)
        self.inside.clear()


def install(model: nn.Module, n: int, device, *, storage: torch.dtype, compute: torch.dtype,
            host="cpu", write_back: bool = False) -> BlockSwap:
    """Keep ``blocks_to_swap = n`` blocks of ``model`` on ``host`` (pinned on CUDA) in their
    stored dtypes (placement.tensor_dtypes: ``storage``, fp8 weights as fp8), place every other
    part on ``device`` (placement.place), and make the model stream them (``model.block_swap``)."""
    swapped = blocks_for(model, n)
    host = torch.device(host)
    pin = torch.device(device).type == "cuda"
    with torch.no_grad():
        for block in swapped:
            for m, kind, name, dtype in list(placement.tensor_dtypes(block, storage, compute)):
                t = getattr(m, kind)[name]
                h = t.data.to(host, dtype)
                if pin:
                    h = h.pin_memory()
                if kind == "_parameters":
                    t.data = h
                else:
                    m._buffers[name] = h
            if storage == fp8.FP8:
                fp8.install_forward(block, compute)
    holders = []
    for lst in _lists(model):  # the rest goes to the device; the swapped blocks stay home
        for k, b in enumerate(lst):
            if any(b is s for s in swapped):
                holders.append((lst, k, b))
                lst[k] = nn.Identity()
    try:
        placement.place(model, storage, compute, device)
    finally:
        for lst, k, b in holders:
            lst[k] = b
    order = [b for lst in _lists(model) for b in lst]
    swap = BlockSwap(order, swapped, device, host, write_back)
    model.block_swap = swap
    return swap


def device_bytes(model: nn.Module, swap: BlockSwap | None) -> int:
    """Bytes of ``model``'s parameters and buffers resident on the compute device: those not
    pointing at a host copy of the swap (on CUDA: those on the device)."""
    home = swap.host_pointers() if swap is not None else set()
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        ptr = t.data_ptr()
        if ptr in home or ptr in seen or t.device.type == "meta":
            continue
        seen.add(ptr)
        total += t.numel() * t.element_size()
    return total
