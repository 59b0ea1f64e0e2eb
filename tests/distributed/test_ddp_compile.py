"""``torch_compile`` under the DDP engine and with the fused steppers
(library/training/compile_unet.py, library/distributed/ddp.py, library/distributed/strategy.py).

Under DDP the compiled U-Net runs inside DistributedDataParallel's forward, where dynamo's
DDPOptimizer splits the compiled graph at DDP's bucket boundaries. The fast checks use a small
module of the U-Net's shape (blocks of 256-wide linear layers, each block under non-reentrant
gradient checkpointing as diffusers does it, a "text encoder" whose last layer gets no gradient,
as with clip_skip) driven through the real DDP strategy (its ``prepare``, ``micro_step`` with
``no_sync``, ``forward`` and the rebuild when a part freezes), compiled with ``aot_eager`` (AOT
autograd's joint graph: what changes the backward and so the gradient hooks DDP reduces in).
A whole tiny U-Net takes about a minute to trace on this CPU: the end-to-end runs on tiny-sd15
are ``slow``.

The reference is independent of DDP and of compiling: the same steps in one process, eager,
without DDP (the plain SingleProcess strategy). Tolerance: SGD, per tensor
||a-b|| / max(||b||, 1e-4) within 1e-5 (DESIGN.md, "Step accounting"); measured 2e-8 in one
process (AOT autograd's decompositions change float rounding), and the order of the float sum
across processes.
"""
from __future__ import annotations

import logging
import types

import pytest
import torch
from torch.utils.checkpoint import checkpoint


W = 256      # each Linear(W, W) holds 257 KiB of float32 parameters
TOL = 1e-5   # SGD, per tensor (module docstring)
STEPS, ACCUM = 3, 2


class _Block(torch.nn.Module):
    def __init__(self, ckpt=True):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(W, W), torch.nn.Linear(W, W)
        self.ckpt = ckpt

    def _f(self, x, c):
        return x + self.l2(torch.tanh(self.l1(x) + c))

    def forward(self, x, c):
        if self.ckpt and torch.is_grad_enabled():
            return checkpoint(self._f, x, c, use_reentrant=False)
        return self._f(x, c)


class _UNet(torch.nn.Module):
    """The attributes compile_unet's block-by-block compile walks; ``breaks``: a side effect in
    the top-level forward that dynamo cannot put in a graph (the per-block fallback)."""

    def __init__(self, breaks=False, ckpt=True):
        super().__init__()
        self.down_blocks = torch.nn.ModuleList([_Block(ckpt), _Block(ckpt)])
        self.mid_block = _Block(ckpt)
        self.up_blocks = torch.nn.ModuleList([_Block(ckpt), _Block(ckpt)])
        self.dead = torch.nn.Linear(W, W)  # computed, its output discarded: gets no gradient
        self.breaks = breaks

    def forward(self, x, c):
        self.dead(x)
        for m in [*self.down_blocks, self.mid_block, *self.up_blocks]:
            x = m(x, c)
        if self.breaks:
            print("", end="")
        return x


class _TextEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, W)
        self.last = torch.nn.Linear(W, W)  # never used: gets no gradient (as clip_skip's layer)

    def forward(self, t):
        return self.a(t)


def _batches(n: int, batch: int = 4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, W, generator=g), torch.randn(batch, 8, generator=g))
            for _ in range(n)]


def _train(strategy_kind: str, backend: str | None = None, *, processes: int = 1, rank: int = 0,
           accum: int = ACCUM, freeze_at: int | None = None, breaks: bool = False,
           **ddp_options) -> dict:
    """STEPS SGD steps (momentum, weight decay: a zero gradient would move a weight, no gradient
    leaves it) of global batches of 4 x ``accum``; this process takes samples rank, rank + P, ...
    of each micro-batch, its loss weighted by 1 / global batch (the trainer's weighting). Returns
    the final weights, the DDP wrappers used (one per step) and the compile wrapper."""
    from library.distributed import strategy
    from library.training.compile_unet import compile_unet
    from tests.helpers import make_opts

    torch.manual_seed(0)
    unet, te = _UNet(breaks), _TextEncoder()
    compiled = compile_unet(unet, backend, logging.getLogger("sdtk")) if backend else None
    opts = make_opts("train_dreambooth", torch_compile=backend is not None,
                     dynamo_backend=backend or "inductor", **ddp_options)
    acc = types.SimpleNamespace(device=torch.device("cpu"), num_processes=processes)
    parts = types.SimpleNamespace(bundle=types.SimpleNamespace(unet=unet, text_encoders=[te]),
                                  method=types.SimpleNamespace(network=None))
    s = strategy.DDP(acc, opts) if strategy_kind == "ddp" else strategy.SingleProcess(acc)
    s.prepare(parts.bundle, parts.method, [])
    params = [*unet.parameters(), *te.parameters()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    data, wrappers = _batches(STEPS * accum), []
    for step in range(STEPS):
        if freeze_at == step:
            te.requires_grad_(False)  # as stop_text_encoder_training
        for k in range(accum):
            x, t = (v[rank::processes] for v in data[step * accum + k])
            with s.micro_step(k == accum - 1):
                out = s.forward(lambda: unet(x, te(t)))
                (out.square().mean(dim=1).sum() / (4 * accum)).backward()
        wrappers.append(getattr(s, "ddp", None))
        opt.step()
        opt.zero_grad(set_to_none=True)
    named = [*unet.named_parameters(), *(("te." + n, p) for n, p in te.named_parameters())]
    return {"weights": {n: p.detach().clone() for n, p in named}, "ddp": wrappers,
            "compiled": compiled}


def _worst(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys()
    return max((float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-4)), k) for k in b)


class _Counts:
    """The comm hook's calls (parameters per bucket) and the graphs compiled: dynamo's frames
    and AOT autograd's compilations (one per piece DDPOptimizer split a frame into)."""

    def __init__(self, monkeypatch):
        from library.distributed import ddp

        self.buckets = []
        real = ddp.comm_hook

        def comm_hook(name):
            inner = real(name)

            def hook(process_group, bucket):
                self.buckets.append(len(bucket.parameters()))
                return inner(process_group, bucket)

            hook.__name__ = hook.__qualname__ = inner.__qualname__
            return hook

        monkeypatch.setattr(ddp, "comm_hook", comm_hook)
        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
        self.counters = counters

    @property
    def frames(self) -> int:
        return self.counters["stats"]["unique_graphs"]

    @property
    def pieces(self) -> int:
        return self.counters["aot_autograd"]["total"]


@pytest.fixture
def one_process_group(tmp_path):
    """A one-process gloo group for one test (the two-process test makes its own)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reference():
    """One process, eager, no DDP: the default run and the run that freezes the text encoder."""
    return {"plain": _train("single")["weights"], "freeze": _train("single", freeze_at=1)["weights"],
            "accum1": _train("single", accum=1)["weights"]}


# The U-Net's 10 trained Linear(256, 256) hold 257 KiB each. DDPOptimizer walks the graph from
# the output and closes a bucket once it holds at least the cap: the first at 1 MiB (DDP's first
# bucket), 4 layers; then ddp_bucket_cap_mb 1: 4 layers, the last 2 -> 3 pieces; 25: the 6 -> 2.
PIECES = {1: 3, 25: 2}
# DDP's parameters: the blocks' 20, the U-Net's dead layer (2: dynamo drops the discarded layer
# from the graph, so DDP finds it unused), the text encoder's used layer (2) and its last (2), which
# gets no gradient; every bucket is reduced once per step, all 26 in sum
TRAINED = 26


@pytest.mark.parametrize("backend,tol", [
    ("aot_eager", TOL),
    # inductor's generated kernels fuse and reorder float operations; its CPU compile takes
    # minutes here
    pytest.param("inductor", 1e-4, marks=pytest.mark.slow)])
def test_compiled_unet_under_ddp_reduces_and_splits_at_buckets(backend, tol, one_process_group,
                                                               reference, monkeypatch, caplog):
    """Gradient accumulation 2 (no_sync in the first micro-step), bucket cap 1 MB, gradient
    checkpointing in every block: the compiled run equals the eager one-process run within TOL;
    DDP reduced (its SUM comm hook was called, only in the step's last micro-step: each step's
    buckets add up to the trained parameters once); DDPOptimizer split the one dynamo graph into
    the pieces of DDP's buckets; no_sync did not recompile; the layers without a gradient (the
    text encoder's last, the U-Net's discarded one inside the graph) keep grad None: weight
    decay did not move them, as in the reference. aot_eager within TOL, inductor within 1e-4."""
    n = _Counts(monkeypatch)
    with caplog.at_level(logging.INFO, logger="sdtk"):
        res = _train("ddp", backend, ddp_bucket_cap_mb=1)
    assert "the compiled U-Net cut at the buckets by dynamo's DDPOptimizer" in caplog.text
    worst, key = _worst(res["weights"], reference["plain"])
    assert worst < tol, (key, worst)
    assert res["compiled"].state == "compiled" and res["compiled"].blocks is None
    assert n.frames == 1 and n.pieces == PIECES[1]
    assert sum(n.buckets) == STEPS * TRAINED and len(n.buckets) % STEPS == 0
    torch.manual_seed(0)
    start = dict(_UNet().named_parameters())
    for name in ("te.last.weight", "dead.weight"):  # no gradient, no weight decay
        assert torch.equal(res["weights"][name], reference["plain"][name])
    assert torch.equal(res["weights"]["dead.weight"], start["dead.weight"])


@pytest.mark.parametrize("case", ["static_graph_bucket_view", "rebuild", "per_block_fallback",
                                  pytest.param("default_bucket", marks=pytest.mark.slow)])
def test_ddp_options_with_a_compiled_unet(case, one_process_group, reference, monkeypatch):
    """ddp_static_graph with ddp_gradient_as_bucket_view (without accumulation: a static graph
    under no_sync is rejected, pytorch/pytorch#143580); the default 25 MB bucket; the rebuild
    when the text encoder freezes after step 1 (stop_text_encoder_training: a new wrapper, and
    one recompile, since the U-Net's input no longer requires a gradient); a U-Net that cannot
    be one graph (compiled block by block inside DDP's forward, each block its own DDPOptimizer
    frame). Each equals the eager one-process run within TOL."""
    n = _Counts(monkeypatch)
    if case == "static_graph_bucket_view":
        res = _train("ddp", "aot_eager", accum=1, ddp_static_graph=True,
                     ddp_gradient_as_bucket_view=True, ddp_bucket_cap_mb=1)
        ref = reference["accum1"]
        d = res["ddp"][-1]
        assert d.static_graph and d.gradient_as_bucket_view and not d.find_unused_parameters
        assert n.frames == 1 and n.pieces == PIECES[1]
    elif case == "default_bucket":
        res = _train("ddp", "aot_eager")
        ref = reference["plain"]
        assert n.frames == 1 and n.pieces == PIECES[25]
    elif case == "rebuild":
        res = _train("ddp", "aot_eager", freeze_at=1, ddp_bucket_cap_mb=1)
        ref = reference["freeze"]
        assert res["ddp"][0] is not res["ddp"][1] and res["ddp"][1] is res["ddp"][2]
        assert n.frames == 2 and n.pieces == 2 * PIECES[1]
        # after the freeze only the U-Net's 22 parameters are reduced
        assert sum(n.buckets) == TRAINED + 2 * 22
    else:
        res = _train("ddp", "aot_eager", breaks=True, ddp_bucket_cap_mb=1)
        ref = reference["plain"]
        assert res["compiled"].state == "eager"
        assert [b.state for b in res["compiled"].blocks] == ["compiled"] * 5
    worst, key = _worst(res["weights"], ref)
    assert worst < TOL, (key, worst)
    assert sum(n.buckets) >= STEPS * 20  # DDP reduced every step


def _gradients_per_backward_node(loss) -> int:
    """The most parameters whose gradients one node of ``loss``'s autograd graph produces: the
    gradients that exist together before their post-accumulate-grad hooks (the fused step) run."""
    seen, todo, most = set(), [loss.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nexts = [f for f, _ in node.next_functions if f is not None]
        most = max(most, sum(type(f).__name__ == "AccumulateGrad" for f in nexts))
        todo.extend(nexts)
    return most


def _fused_train(backend: str | None, per_block: bool = False, processes: int = 1,
                 rank: int = 0) -> tuple[dict, list]:
    """STEPS fused_backward_pass steps (SGD with momentum, each parameter stepped in its
    post-accumulate-grad hook; on several processes each gradient's sum launched there, async)
    of global batches of 4, this process's share weighted by 1 / 4. Returns the weights and,
    per step, the most gradients one backward node produced (_gradients_per_backward_node)."""
    from library.training.compile_unet import compile_unet
    from library.training.stepper import make_stepper
    from tests.conftest import FakeAccelerator
    from tests.helpers import make_opts

    opts = make_opts(optimizer_type="torch.optim.SGD", optimizer_args={"momentum": 0.9},
                     learning_rate=0.1, lr_scheduler="constant", max_grad_norm=0.0,
                     fused_backward_pass=True)
    torch.manual_seed(0)
    unet = _UNet(ckpt=False)
    if backend:
        compile_unet(unet, backend, logging.getLogger("sdtk"), per_block=per_block)
    params = list(unet.parameters())
    stepper = make_stepper(FakeAccelerator(), opts, [{"params": params}], params,
                           warmup_steps=0, total_steps=STEPS)
    together = []
    for x, c in _batches(STEPS):
        x, c = x[rank::processes], c[rank::processes, :1].expand(-1, W).contiguous()
        loss = unet(x, c).square().mean(dim=1).sum() / 4
        together.append(_gradients_per_backward_node(loss))
        stepper.backward(loss)
        stepper.step()
    return {n: p.detach().clone() for n, p in unet.named_parameters()}, together


# -- two processes ---------------------------------------------------------------------------
def _two_process_worker(rank: int, port: int, queue) -> None:
    """One of two gloo processes: the compiled (aot_eager) U-Net under the DDP strategy, this
    process's half of every micro-batch; reports its weights (as lists: see test_ddp) and how
    many pieces its graph was compiled in."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    torch._dynamo.reset()
    counters.clear()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    res = _train("ddp", "aot_eager", processes=2, rank=rank, ddp_bucket_cap_mb=1)
    pieces = counters["aot_autograd"]["total"]
    fused, _ = _fused_train("aot_eager", per_block=True, processes=2, rank=rank)
    queue.put((rank, {k: v.tolist() for k, v in res["weights"].items()}, pieces,
               {k: v.tolist() for k, v in fused.items()}))
    dist.destroy_process_group()


def test_two_compiled_processes_give_the_one_process_result(reference):
    """Two real gloo processes (this one and a spawned one), each with its half of every
    micro-batch: under DDP the weights equal the one-process eager run within TOL, and equal
    each other bit for bit (the same reduced gradients); each process's graph was split at the
    buckets. The same for fused_backward_pass with the U-Net compiled block by block (its hooks
    launch the sums asynchronously) against the eager fused step in one process."""
    from tests.helpers import run_with_one_spawned_process

    out = {rank: rest for rank, *rest in
           run_with_one_spawned_process(_two_process_worker, timeout=240)}
    w0, w1 = ({k: torch.tensor(v) for k, v in out[r][0].items()} for r in (0, 1))
    assert out[0][1] == out[1][1] == PIECES[1]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    worst, key = _worst(w0, reference["plain"])
    assert worst < TOL, (key, worst)
    # the fused step, compiled block by block: the hooks' async sums of 2 processes against
    # the eager fused step of one process over the whole batch
    f0, f1 = ({k: torch.tensor(v) for k, v in out[r][2].items()} for r in (0, 1))
    assert all(torch.equal(f0[k], f1[k]) for k in f0)
    worst, key = _worst(f0, _fused_train(None)[0])
    assert worst < TOL, (key, worst)


# -- the fused steppers ----------------------------------------------------------------------
@pytest.mark.parametrize("per_block", [False, True])
def test_fused_step_with_a_compiled_unet(per_block):
    """fused_backward_pass (each parameter stepped in its post-accumulate-grad hook) on the
    compiled U-Net: the weights equal the eager fused run within TOL. One compiled graph's
    backward is one autograd node that produces the gradients of all the U-Net's parameters
    together (the fused step's memory saving gone: measured 40 of 40 MiB of gradients alive at
    the first hook with 1024-wide layers); compiled block by block (what the trainer does with a
    fused stepper) one node produces one block's 4."""
    torch._dynamo.reset()
    want, eager_together = _fused_train(None)
    got, together = _fused_train("aot_eager", per_block)
    assert eager_together == [1] * STEPS  # eager: each parameter's gradient on its own
    # one graph: every U-Net parameter it reads (the blocks' 20 and the discarded layer's 2,
    # whose gradient is None); block by block: one block's 4
    assert together == [4 if per_block else 22] * STEPS
    worst, key = _worst(got, want)
    assert worst < TOL, (key, worst)


# -- end to end on tiny-sd15 (slow: a minute or two of tracing per compiled run) --------------
def _dreambooth_args(data: str, out: str) -> list[str]:
    """test_ddp's DreamBooth run (U-Net and text encoder, gradient checkpointing, the text
    encoder frozen after step 1: the DDP wrapper rebuilt over the U-Net), at 128 px: the graph
    cut at the buckets makes the autograd engine, not the graph, add up the gradients of the
    tensors two pieces share, another float summation order, which at 64 px the tiny U-Net's
    1x1 lowest level turns into 7e-3 on a GroupNorm bias (measured; compiled without DDP, one
    piece, equals eager bit for bit), as tests/training/test_equivalence.py describes; at
    128 px 6.2e-6."""
    from tests.distributed.test_ddp import dreambooth_stop_args

    return dreambooth_stop_args(data, out, 128)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_lora", "train_dreambooth"])
def test_compiled_training_under_ddp_matches_eager(script, one_process_group, tmp_path,
                                                   monkeypatch):
    """The DDP engine (1-process gloo group) with torch_compile / aot_eager against the eager
    run without DDP. LoRA: test_ddp's run (U-Net and text-encoder LoRA, clip_skip 2: the last
    text-encoder layer's LoRA gets no gradient, accumulation 2 under no_sync, gradient
    checkpointing, weight decay). DreamBooth: the rebuild at stop_text_encoder_training (and a
    recompile: the U-Net's text input stops requiring a gradient). Every saved tensor within
    TOL (SGD); DDP reduced (its SUM comm hook, never sum_gradients); the U-Net compiled as one
    graph (no fallback), which DDPOptimizer split into pieces at DDP's buckets."""
    from library.distributed import strategy
    from tests.distributed.test_ddp import Spy, lora_args
    from tests.training.test_equivalence import max_rel_diff, train_in_process
    from tools.make_sample_dataset import make_sample_dataset

    data = str(tmp_path / "data")
    make_sample_dataset(data, n_images=2, size=64 if script == "train_lora" else 128, repeats=2)
    args = lora_args if script == "train_lora" else _dreambooth_args
    with monkeypatch.context() as m:
        m.setattr(strategy, "for_run", lambda opts, acc: strategy.SingleProcess(acc))
        ref = train_in_process(args(data, str(tmp_path / "ref")), script=script)
    monkeypatch.setattr(strategy, "for_run", lambda opts, acc: strategy.DDP(acc, opts))
    n = _Counts(monkeypatch)
    spy = Spy(monkeypatch)
    with spy.hooks():
        res = train_in_process(args(data, str(tmp_path / "c")) + [
            "--torch_compile", "--dynamo_backend", "aot_eager"], script=script)
    run = res["run"]
    assert type(run.parts.strategy).__name__ == "DDP" and run.parts.strategy.engine
    assert spy.sums == [] and spy.hook_calls
    assert all(log["comm_hook"] == "sum_hook" for log in spy.logging)
    compiled = run.parts.bundle.unet.forward  # compile_unet's wrapper (after a fallback: eager)
    assert compiled.state == "compiled" and compiled.blocks is None
    assert n.pieces >= n.frames >= 1
    worst, key = max_rel_diff(res["tensors"], ref["tensors"], floor=1e-4)
    print(f"{script}: worst {worst:.2e} ({key}); dynamo frames {n.frames}, pieces {n.pieces}")
    assert worst < TOL, (key, worst)
    if script == "train_dreambooth":
        assert spy.ddp[0] is not spy.ddp[1]  # rebuilt over the U-Net after step 1
