"""The DDP engine (library/distributed/ddp.py, the DDP strategy of library/distributed/strategy.py).

Most checks need no second process: the DDP strategy is built in this process over a one-process
gloo group (``init_process_group`` with a FileStore, world size 1), where DDP's reducer, its
buckets, ``no_sync`` and the comm hook run as on N processes (the all-reduce adds one operand).
Against the one-process run of the same options without DDP (an independent path: the plain
stepper, no reducer), every run here is bit for bit the same. The sum over several processes and
the compression hooks' sum are checked with two bare gloo processes; the 2-process training runs
are in tests/distributed/test_multiprocess.py (which also runs two "machines").
"""
from __future__ import annotations

import pytest
import torch

from tests.training.test_equivalence import train_in_process


def lora_args(data: str, out: str, *extra) -> list[str]:
    """LoRA on the U-Net and the text encoder with clip_skip 2 (the last text-encoder layer's
    LoRA gets no gradient), gradient checkpointing (diffusers U-Net, transformers CLIP), weight
    decay (a zero gradient would decay a weight, no gradient leaves it), batch 1 x accumulation 2."""
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", data,
            "--output_dir", out, "--resolution", "64", "--network_dim", "4", "--network_alpha", "2",
            "--cache_latents", "--optimizer_type", "SGDNesterov", "--optimizer_args",
            "momentum=0.9", "weight_decay=0.1", "--learning_rate", "1.0", "--seed", "7",
            "--max_train_steps", "2", "--train_batch_size", "1", "--gradient_accumulation_steps",
            "2", "--clip_skip", "2", "--gradient_checkpointing", *extra]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tools.make_sample_dataset import make_sample_dataset

    root = str(tmp_path_factory.mktemp("ddp_data") / "data")
    make_sample_dataset(root, n_images=2, size=64, repeats=2)
    return root


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory):
    """A one-process gloo group (DDP needs a process group; world size 1 needs no launch)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def ddp_strategy(one_process_group, monkeypatch):
    """The DDP strategy for the runs of this test (for_run picks it for several processes)."""
    from library.distributed import strategy

    monkeypatch.setattr(strategy, "for_run", lambda opts, acc: strategy.DDP(acc, opts))


class Spy:
    """While a run trains: each comm-hook call (the micro-step it came in, its bucket's
    parameters), each sum_gradients call, and DDP's own logging data after every step."""

    def __init__(self, monkeypatch):
        from library import accelerator as distributed
        from library.distributed import ddp

        self.hook_calls, self.sums, self.logging, self.ddp = [], [], [], []
        self.micro = None
        real_comm_hook, real_sum = ddp.comm_hook, distributed.sum_gradients

        def comm_hook(name):
            inner = real_comm_hook(name)

            def hook(group, bucket):
                self.hook_calls.append((self.micro, len(bucket.parameters())))
                return inner(group, bucket)

            hook.__name__ = hook.__qualname__ = inner.__qualname__  # DDP logs the name
            return hook

        def sum_gradients(*a, **k):
            self.sums.append(1)
            return real_sum(*a, **k)

        monkeypatch.setattr(ddp, "comm_hook", comm_hook)
        monkeypatch.setattr(distributed, "sum_gradients", sum_gradients)

    def hooks(self):
        from library.run.run_state import HOOKS

        def before_micro_step(run, epoch, idx):
            step = run.progress.global_step
            k = self.micro[1] + 1 if self.micro is not None and self.micro[0] == step else 0
            self.micro = (step, k)  # (optimizer step, micro-step in it)

        def after_step(run, loss, lr):
            d = run.parts.strategy.ddp
            self.ddp.append(d)
            self.logging.append(d._get_ddp_logging_data() if d is not None else None)

        return HOOKS.add(before_micro_step=before_micro_step, after_step=after_step)


def _trained(monkeypatch, args, script="train_lora"):
    spy = Spy(monkeypatch)
    with spy.hooks():
        res = train_in_process(args, script=script)
    res["spy"] = spy
    return res


def _unused_lora(run) -> list[str]:
    """Names of the LoRA parameters the optimizer holds no state for (they never had a gradient)."""
    opt = run.parts.stepper.optimizer
    opt = getattr(opt, "optimizer", opt)
    names = {id(p): n for n, p in run.parts.method.network.named_parameters()}
    return sorted(names[id(p)] for g in opt.param_groups for p in g["params"]
                  if id(p) in names and not opt.state.get(p))


@pytest.fixture(scope="module")
def lora_reference(data, tmp_path_factory):
    """The one-process run without DDP (a plain SingleProcess strategy)."""
    res = train_in_process(lora_args(data, str(tmp_path_factory.mktemp("ref"))))
    assert type(res["run"].parts.strategy).__name__ == "SingleProcess"
    return res


def _same(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_ddp_reduces_the_gradients(lora_reference, ddp_strategy, data, tmp_path, monkeypatch):
    """The DDP strategy wraps the denoiser in DistributedDataParallel: its comm hook (the SUM
    all-reduce) is called for every bucket once per optimizer step, in the last micro-step only
    (the first runs under no_sync), and the plain stepper's old sum_gradients is never called.
    Unused parameters are searched per step (find_unused_parameters): the last text-encoder
    layer's LoRA (clip_skip 2) keeps grad None, as in one process (no optimizer state, no
    weight decay), and the weights equal the run without DDP bit for bit."""
    res = _trained(monkeypatch, lora_args(data, str(tmp_path / "out")))
    run, spy = res["run"], res["spy"]
    assert type(run.parts.strategy).__name__ == "DDP" and run.parts.strategy.engine
    assert run.parts.stepper.grad_sum is None
    assert spy.sums == []
    logs = spy.logging[-1]
    assert logs["module_name"] == "Denoiser" and logs["comm_hook"] == "sum_hook"
    assert logs["find_unused_parameters"] == 1 and logs["gradient_as_bucket_view"] == 0
    assert logs["bucket_cap_bytes"] == 25 * 1024 * 1024 and logs["broadcast_buffers"] == 0
    # only the trained LoRA parameters are DDP's (the frozen U-Net and text encoder ignored)
    trained = [p for p in run.parts.method.network.parameters() if p.requires_grad]
    assert logs["num_parameter_tensors"] == len(trained)
    assert logs["total_parameter_size_bytes"] == sum(p.numel() * 4 for p in trained)
    # every bucket once per optimizer step, all in the step's second (last) micro-step
    assert len(res["capture"].micro_steps) == 4
    assert {m for m, _ in spy.hook_calls} == {(0, 1), (1, 1)}
    for step in (0, 1):
        assert sum(n for m, n in spy.hook_calls if m[0] == step) == len(trained)
    unused = _unused_lora(run)
    last = run.parts.bundle.text_encoders[0].config.num_hidden_layers - 1
    assert unused and all(f"text_model_encoder_layers_{last}_" in n for n in unused), unused
    assert unused == _unused_lora(lora_reference["run"])
    assert _same(res["tensors"], lora_reference["tensors"]) == []


def test_static_graph_bucket_view_and_bucket_size_reach_ddp(ddp_strategy, data, tmp_path,
                                                           monkeypatch):
    """ddp_static_graph, ddp_gradient_as_bucket_view and ddp_bucket_cap_mb reach DDP (its
    attributes and logging data): with a static graph no per-step search for unused parameters
    (the clip_skip layer's LoRA, recorded in the first step, still keeps grad None), the
    gradients are views into DDP's buckets, the bucket cap is 1 MB. Without accumulation (a
    static graph under no_sync is rejected on several processes: pytorch/pytorch#143580).
    Bit-identical to the run without DDP."""
    from library.distributed import strategy

    args = lora_args(data, str(tmp_path / "ref"), "--gradient_accumulation_steps", "1")
    with monkeypatch.context() as m:
        m.setattr(strategy, "for_run", lambda opts, acc: strategy.SingleProcess(acc))
        ref = train_in_process(args)
    args = lora_args(data, str(tmp_path / "out"), "--gradient_accumulation_steps", "1",
                     "--ddp_static_graph", "--ddp_gradient_as_bucket_view",
                     "--ddp_bucket_cap_mb", "1")
    res = _trained(monkeypatch, args)
    run, spy = res["run"], res["spy"]
    d, logs = spy.ddp[-1], spy.logging[-1]
    assert d.static_graph and not d.find_unused_parameters
    assert d.gradient_as_bucket_view and logs["gradient_as_bucket_view"] == 1
    assert logs["bucket_cap_bytes"] == 1024 * 1024
    assert spy.sums == [] and len(spy.hook_calls) >= 2
    assert _unused_lora(run) == _unused_lora(ref["run"]) != []
    assert _same(res["tensors"], ref["tensors"]) == []


def test_bf16_compression_trains_within_tolerance(lora_reference, ddp_strategy, data, tmp_path,
                                                  monkeypatch):
    """ddp_comm_hook bf16 (PyTorch's bf16_compress_hook, multiplied back to the sum) is lossy:
    every gradient is rounded to bf16 before the all-reduce (on one process too, which is what
    makes it measurable here), so the weights differ from the uncompressed run. The LoRA
    up-weights start at zero (they are the whole update): all of them together within
    COMPRESSION_TOL_ALL of the uncompressed run (measured 1.7e-3), each within COMPRESSION_TOL
    of its norm (floored at 1e-4: two attention up-weights get a near-zero gradient, norm 1e-10;
    measured worst 9.6e-3); 2 steps of SGD, lr 1, momentum 0.9."""
    from tests.training.test_equivalence import max_rel_diff

    res = _trained(monkeypatch, lora_args(data, str(tmp_path / "out"), "--ddp_comm_hook", "bf16"))
    assert res["spy"].logging[-1]["comm_hook"] == "bf16_compressed_sum_hook"
    assert res["spy"].sums == []
    ups = [k for k in res["tensors"] if k.endswith("lora_up.weight")]
    got = {k: res["tensors"][k] for k in ups}
    ref = {k: lora_reference["tensors"][k] for k in ups}
    worst, key = max_rel_diff(got, ref, floor=1e-4)
    assert 0 < worst <= COMPRESSION_TOL, f"{key}: {worst:.2e}"
    together = float(torch.cat([(got[k] - ref[k]).flatten() for k in ups]).norm()
                     / torch.cat([ref[k].flatten() for k in ups]).norm())
    assert 0 < together <= COMPRESSION_TOL_ALL, together


COMPRESSION_TOL = 2e-2
COMPRESSION_TOL_ALL = 5e-3


def dreambooth_stop_args(data: str, out: str, resolution: int) -> list[str]:
    """A 3-step DreamBooth run of the U-Net and the text encoder, gradient checkpointing, the text
    encoder frozen after step 1 (so the DDP wrapper is rebuilt over the U-Net)."""
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", data,
            "--output_dir", out, "--resolution", str(resolution), "--train_text_encoder",
            "--stop_text_encoder_training", "1", "--gradient_checkpointing",
            "--cache_latents", "--optimizer_type", "SGDNesterov", "--optimizer_args",
            "momentum=0.9", "--learning_rate", "0.1", "--seed", "7", "--max_train_steps", "3",
            "--train_batch_size", "2"]


@pytest.mark.slow
def test_dreambooth_text_encoder_stop_rebuilds_ddp(ddp_strategy, data, tmp_path, monkeypatch):
    """Full fine-tune of the U-Net and the text encoder with gradient checkpointing (diffusers'
    and transformers' checkpointing under DDP's graph search) and stop_text_encoder_training 1:
    after step 1 the text encoder freezes, so the wrapper is rebuilt over the U-Net alone (the
    text encoder then keeps its weights, as without DDP); 3 steps bit-identical to the run
    without DDP. (slow: two runs; gradient checkpointing under DDP is also in the default
    suite, through the LoRA runs above.)"""
    def args(out):
        return dreambooth_stop_args(data, out, 64)

    from library.distributed import strategy

    with monkeypatch.context() as m:
        m.setattr(strategy, "for_run", lambda opts, acc: strategy.SingleProcess(acc))
        ref = train_in_process(args(str(tmp_path / "ref")), script="train_dreambooth")
    res = _trained(monkeypatch, args(str(tmp_path / "out")), script="train_dreambooth")
    spy = res["spy"]
    # step 1 over U-Net and text encoder, steps 2-3 over the U-Net alone (a new wrapper)
    n = [log["num_parameter_tensors"] for log in spy.logging]
    unet = len(list(res["run"].parts.bundle.unet.parameters()))
    te = len(list(res["run"].parts.bundle.text_encoders[0].parameters()))
    assert n == [unet + te, unet, unet]
    assert spy.ddp[0] is not spy.ddp[1] and spy.ddp[1] is spy.ddp[2]
    assert spy.sums == []
    assert _same(res["tensors"], ref["tensors"]) == []


class _Two(torch.nn.Module):
    """A module whose forward runs a callable (as the denoiser): ``a`` used by every process,
    ``b`` only by process 0, ``c`` by none; ``frozen`` does not train."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(6, 5) for _ in range(3))
        self.frozen = torch.nn.Linear(6, 5).requires_grad_(False)

    def forward(self, fn):
        return fn()


def _comm_hook_worker(rank: int, port: int, queue) -> None:
    """One of two gloo processes: for the sum and the bf16 hook, DDP (library/distributed/ddp.py
    wrap) over a fresh _Two, each process its own input; reports its local gradients (without
    DDP) and the reduced ones, as lists (a tensor in the queue would be shared memory that
    this process takes with it when it ends)."""
    import types
    from datetime import timedelta

    import torch.distributed as dist

    from library.distributed import ddp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank + 1))
    out = {}
    for hook in ("no", "bf16"):
        m = _Two()

        def loss_of():
            y = m.a(x).square().sum() + m.frozen(x).sum()
            return y + m.b(x).sum() * 3 if rank == 0 else y

        local = torch.autograd.grad(loss_of(), [m.a.weight, m.a.bias, m.b.weight, m.b.bias],
                                    allow_unused=True)
        from tests.helpers import make_opts

        opts = make_opts(ddp_comm_hook=hook)
        wrapped = ddp.wrap(m, opts, types.SimpleNamespace(device=torch.device("cpu")))
        wrapped(loss_of).backward()
        grads = [p.grad for p in (m.a.weight, m.a.bias, m.b.weight, m.b.bias, m.c.weight,
                                  m.frozen.weight)]
        out[hook] = [[None if g is None else g.tolist() for g in gs] for gs in (local, grads)]
        del wrapped  # DDP's reducer (and its hooks) before the process group it holds
    queue.put((rank, out))
    # both done before either tears gloo down (a peer's teardown mid-exit aborted one process
    # once in CI: "terminate called without an active exception", exit -6)
    dist.barrier()
    dist.destroy_process_group()


def _two_processes() -> dict:
    """{hook: {rank: (local gradients, reduced gradients)}} of _comm_hook_worker."""
    from tests.helpers import spawn_two_processes

    results: dict = {}
    for rank, out in spawn_two_processes(_comm_hook_worker, timeout=240):
        for hook, lists in out.items():
            results.setdefault(hook, {})[rank] = [
                [None if g is None else torch.tensor(g) for g in gs] for gs in lists]
    return results


def test_comm_hooks_sum_across_two_processes():
    """Two bare gloo processes, DDP as wrap() builds it. The sum hook: every trained gradient is
    the SUM of the two processes' own gradients (not DDP's mean), exactly; b, used only by
    process 0, gets process 0's gradient on both; c, used by none, keeps grad None; the frozen
    layer gets none. The bf16 hook: the same sum within bf16 rounding (2^-8 relative per
    element, a little more where the two terms cancel), and not exactly (it compresses)."""
    results = _two_processes()
    for hook in ("no", "bf16"):
        (l0, g0), (l1, g1) = results[hook][0], results[hook][1]
        want = [l0[0] + l1[0], l0[1] + l1[1], l0[2], l0[3]]
        assert l1[2] is None and l1[3] is None
        for g in (g0, g1):
            assert g[4] is None and g[5] is None
            for got, w in zip(g[:4], want):
                if hook == "no":
                    assert torch.equal(got, w)
                else:
                    assert torch.allclose(got, w, rtol=2 ** -7, atol=2 ** -7 * float(w.abs().max()))
        assert all(torch.equal(a, b) for a, b in zip(g0[:4], g1[:4]))  # both ranks alike
        if hook == "bf16":
            assert not all(torch.equal(got, w) for got, w in zip(g0[:4], want))


def test_ddp_option_errors_before_loading(run_script, dataset, tmp_path, no_weight_loading,
                                          monkeypatch):
    """One-line errors before any weight loads: a compression hook where DDP does not reduce
    (the fused steps' hooks, fsdp, deepspeed), a static graph with gradient accumulation on
    several processes (PyTorch's static graph under no_sync: pytorch/pytorch#143580), an
    unknown hook, a bucket of 0 MB."""
    base = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
            "--output_dir", str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "1"]
    cases = [
        (["--ddp_comm_hook", "bf16", "--fused_backward_pass", "--optimizer_type", "AdamW"],
         "ddp_comm_hook bf16 cannot be combined with fused_backward_pass"),
        (["--ddp_comm_hook", "int8"], "'int8' is not one of: no, bf16, fp16"),
        (["--ddp_bucket_cap_mb", "0"], "ddp_bucket_cap_mb"),
    ]
    for extra, msg in cases:
        rc, out, err = run_script("train_lora", base + extra)
        assert rc == 2 and msg in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
    rc, out, err = run_script("train_dreambooth", base + ["--ddp_comm_hook", "fp16", "--fsdp"])
    assert rc == 2 and "ddp_comm_hook fp16 cannot be combined with fsdp" in err, err
    monkeypatch.setenv("WORLD_SIZE", "2")  # the plan of a 2-process launch (nothing starts)
    rc, out, err = run_script("train_lora", base + ["--ddp_static_graph",
                                                    "--gradient_accumulation_steps", "2"])
    assert rc == 2 and "ddp_static_graph cannot be combined with gradient_accumulation_steps 2" \
        in err and "pytorch/pytorch#143580" in err, err


def test_dop_and_dataset_multipliers_under_ddp(one_process_group, data, tmp_path, monkeypatch):
    """A DOP subset (its prior runs outside DDP's forward, without gradient) and two datasets'
    network multipliers, under the DDP strategy with gradient checkpointing (whose recomputation
    in the backward must run at the batch's multiplier, not DOP's 0 or the run's): the weights
    equal the plain one-process run without checkpointing bit for bit."""
    import os

    from library.distributed import strategy

    folder = os.path.join(data, "2_sks shape")
    cfg = tmp_path / "datasets.toml"
    cfg.write_text("[general]\nresolution = 64\ncaption_extension = \".caption\"\n"
                   f"[[datasets]]\nnetwork_multiplier = 0.5\n"
                   f"[[datasets.subsets]]\nimage_dir = \"{folder}\"\n"
                   f"[[datasets.subsets]]\nimage_dir = \"{folder}\"\nclass_tokens = \"shape\"\n"
                   "custom_attributes = {diff_output_preservation = true}\n"
                   f"[[datasets]]\nnetwork_multiplier = -1.0\n"
                   f"[[datasets.subsets]]\nimage_dir = \"{folder}\"\n")

    def args(out, *drop):
        a = lora_args(data, str(tmp_path / out), "--dataset_config", cfg, "--max_train_steps", "3")
        i = a.index("--train_data_dir")
        a = a[:i] + a[i + 2:]
        return [x for x in a if x not in drop]

    ref = train_in_process(args("ref", "--gradient_checkpointing"))
    assert type(ref["run"].parts.strategy).__name__ == "SingleProcess"
    monkeypatch.setattr(strategy, "for_run", lambda opts, acc: strategy.DDP(acc, opts))
    res = train_in_process(args("ddp"))
    assert type(res["run"].parts.strategy).__name__ == "DDP"
    assert sum(s.dop for s in res["run"].tset.samples) == 2
    assert res["run"].parts.method.network.multiplier == 1.0  # the run's, after the last step
    assert _same(res["tensors"], ref["tensors"]) == []
