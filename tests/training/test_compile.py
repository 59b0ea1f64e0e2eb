"""torch_compile / dynamo_backend (library/training/compile_unet.py).

Fast tests: the fallback on graph breaks (whole U-Net -> block by block -> eager block) on a small
module of the U-Net's shape, the combinations rejected before loading, and the in-place compile
keeping parameter names. The end-to-end equivalence of compiled and eager training (LoRA and
DreamBooth, SD1 and SDXL tiny models, with the LoRA hooks and gradient checkpointing in the graph)
is marked slow: dynamo's tracing of a whole (even tiny) U-Net takes about a minute of CPU time on
this machine with aot_eager, so the four cases do not fit the default suite's budget. The aot_eager
cases (dynamo tracing and AOT autograd's joint forward/backward graph, no code generation) must
match eager training to 1e-5 per tensor with SGD; the inductor cases (generated kernels that fuse
and reorder float operations) to 1e-4.
"""
import logging

import pytest
import torch

from tests.conftest import read, rel_diff


class _Block(torch.nn.Module):
    def __init__(self, breaks=False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.breaks = breaks

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        if self.breaks and float(y.detach().sum()) > -1e9:  # data-dependent Python branch: a graph break
            y = y * 2
        return y


class _ToyUNet(torch.nn.Module):
    """The attributes compile_unet's fallback walks (down_blocks, mid_block, up_blocks)."""

    def __init__(self, top_breaks, block_breaks):
        super().__init__()
        self.down_blocks = torch.nn.ModuleList([_Block(), _Block(block_breaks)])
        self.mid_block = _Block()
        self.up_blocks = torch.nn.ModuleList([_Block()])
        self.top_breaks = top_breaks

    def forward(self, x):
        for m in [*self.down_blocks, self.mid_block, *self.up_blocks]:
            x = m(x)
        if self.top_breaks:
            print("", end="")  # a side effect dynamo cannot put in a graph
        return x


def _loss_and_grads(model, x):
    model.zero_grad()
    loss = model(x).square().sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("top_breaks,block_breaks", [(False, False), (True, False), (True, True)])
def test_compile_falls_back_block_by_block_and_matches_eager(top_breaks, block_breaks, caplog):
    from library.training.compile_unet import compile_unet

    torch.manual_seed(0)
    eager = _ToyUNet(top_breaks, block_breaks)
    compiled = _ToyUNet(top_breaks, block_breaks)
    compiled.load_state_dict(eager.state_dict())
    names = [n for n, _ in compiled.named_parameters()]
    x = torch.randn(3, 4)
    with caplog.at_level(logging.INFO, logger="sdtk"):
        w = compile_unet(compiled, "eager", logging.getLogger("sdtk"))
        for _ in range(2):  # the second call runs what the first one compiled
            got = _loss_and_grads(compiled, x)
    want = _loss_and_grads(eager, x)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)
    assert [n for n, _ in compiled.named_parameters()] == names  # saves and resumes unchanged
    text = caplog.text
    if not top_breaks:
        assert w.state == "compiled" and w.blocks is None
        assert "U-Net traced and compiled" in text
        return
    assert w.state == "eager" and "compiling its blocks one by one" in text
    states = [b.state for b in w.blocks]
    assert len(states) == 4
    assert states == (["compiled", "eager", "compiled", "compiled"] if block_breaks else ["compiled"] * 4)
    assert ("U-Net down_blocks.1 runs eagerly (graph break" in text) == block_breaks


class _GradOnlyBreak(_ToyUNet):
    """Traces as one graph without gradients (a sample before training) and breaks with them
    (as diffusers' checkpointed branch, taken only when gradients are enabled)."""

    def forward(self, x):
        x = super().forward(x)
        if torch.is_grad_enabled():
            print("", end="")
        return x


def test_a_graph_break_in_a_later_trace_falls_back_too(caplog):
    """The first call (no_grad) compiles one graph; the training call traces again and breaks:
    it falls back block by block instead of raising, and trains as eager."""
    from library.training.compile_unet import compile_unet

    torch.manual_seed(0)
    eager = _ToyUNet(False, False)
    compiled = _GradOnlyBreak(False, False)
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(3, 4)
    with caplog.at_level(logging.INFO, logger="sdtk"):
        w = compile_unet(compiled, "eager", logging.getLogger("sdtk"))
        with torch.no_grad():
            assert torch.equal(compiled(x), eager(x))
        assert w.state == "compiled"
        got = _loss_and_grads(compiled, x)
    want = _loss_and_grads(eager, x)
    assert w.state == "eager" and [b.state for b in w.blocks] == ["compiled"] * 4
    assert "compiling its blocks one by one" in caplog.text
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_a_model_error_is_not_taken_for_a_graph_break():
    from library.training.compile_unet import compile_unet

    m = _ToyUNet(False, False)
    w = compile_unet(m, "eager")
    with pytest.raises(RuntimeError):
        m(torch.randn(3, 5))  # wrong width: the model's own error propagates, nothing falls back
    assert w.state == "new" and w.blocks is None


@pytest.mark.parametrize("extra,message", [
    (["--dynamo_backend", "no"], "torch_compile with dynamo_backend = \"no\""),
    (["--fsdp"], "torch_compile cannot be combined with fsdp"),
])
def test_impossible_combinations_fail_before_loading(extra, message, dataset, tmp_path, run_script,
                                                     no_weight_loading):
    rc, _, err = run_script("train_dreambooth", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
        "--output_dir", tmp_path, "--resolution", "64", "--max_train_steps", "1",
        "--torch_compile", *extra])
    assert rc == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and message in line


def _spy_compile(monkeypatch) -> list:
    """torch.compile replaced by a spy: a call on a module's bound method is recorded as
    (fn, backend, fullgraph, runner) and runs ``fn`` eagerly, counting the calls (runner.n);
    other callers (libraries' own) get the real torch.compile."""
    calls = []
    real_compile = torch.compile

    def spy(fn, backend=None, fullgraph=False, **kw):
        if not isinstance(getattr(fn, "__self__", None), torch.nn.Module):
            return real_compile(fn, backend=backend or "inductor", fullgraph=fullgraph, **kw)

        def run(*a, **k):
            run.n += 1
            return fn(*a, **k)
        run.n = 0
        calls.append((fn, backend, fullgraph, run))
        return run

    monkeypatch.setattr(torch, "compile", spy)
    return calls


def test_the_options_reach_the_compile_of_the_training_unet(dataset, tmp_path, train, monkeypatch):
    """`torch_compile` / `dynamo_backend` end to end, fast: torch.compile replaced by a spy that
    records its call and runs the function eagerly; the run must hand it the U-Net's own forward,
    with the chosen backend and fullgraph, and train through it; without `torch_compile` it is
    never called."""
    calls = _spy_compile(monkeypatch)
    args = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
            "--resolution", "64", "--cache_latents", "--max_train_steps", "2", "--network_dim", "4"]
    rc, _, err, _ = train("train_lora", args + ["--output_dir", tmp_path / "eager"])
    assert rc == 0, err
    assert calls == []
    rc, _, err, run = train("train_lora", args + ["--output_dir", tmp_path / "c", "--torch_compile",
                                                  "--dynamo_backend", "aot_eager"])
    assert rc == 0, err
    (fn, backend, fullgraph, wrapped), = calls
    unet = run.parts.bundle.unet
    assert backend == "aot_eager" and fullgraph is True
    assert getattr(fn, "__self__", None) is unet and fn.__func__ is type(unet).forward
    assert wrapped.n == 2  # every training forward went through the compiled function


def test_a_fused_stepper_compiles_the_unet_block_by_block(dataset, tmp_path, train, monkeypatch):
    """fused_backward_pass steps each parameter in its gradient hook; one compiled graph would
    compute every U-Net gradient before the first hook (tests/distributed/test_ddp_compile.py
    measures it), so the trainer compiles each block (down_blocks.N, mid_block, up_blocks.N) as
    its own graph, never the whole U-Net, and every block's training forward goes through it."""
    calls = _spy_compile(monkeypatch)
    rc, _, err, run = train("train_lora", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
        "--resolution", "64", "--cache_latents", "--max_train_steps", "2", "--network_dim", "4",
        "--output_dir", tmp_path, "--fused_backward_pass", "--optimizer_type", "AdamW",
        "--torch_compile", "--dynamo_backend", "aot_eager"])
    assert rc == 0, err
    unet = run.parts.bundle.unet
    blocks = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
    assert len(calls) == len(blocks)
    assert {id(fn.__self__) for fn, *_ in calls} == {id(b) for b in blocks}
    assert all(backend == "aot_eager" and full for _, backend, full, _ in calls)
    assert all(r.n == 2 for *_, r in calls)  # two training forwards through each block
    assert "compiled block by block" in err


def test_unknown_backend_is_one_line(dataset, tmp_path, run_script):
    rc, _, err = run_script("train_lora", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
        "--output_dir", tmp_path, "--max_train_steps", "1", "--torch_compile",
        "--dynamo_backend", "inductr"])
    assert rc == 2 and "dynamo_backend" in err and "did you mean inductor" in err


def _train_args(script, model, data, out):
    args = ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", "2", "--train_batch_size", "2",
            "--cache_latents", "--gradient_checkpointing", "--seed", "5",
            "--optimizer_type", "torch.optim.SGD"]
    if script == "train_lora":
        return args + ["--network_dim", "4", "--network_train_unet_only", "--learning_rate", "0.5"]
    return args + ["--learning_rate", "1e-2"]


def _final_weights(train, script, args, out):
    rc, _, err, run = train(script, args)
    assert rc == 0, err
    if script == "train_lora":
        return read(str(out / "last.safetensors"))[0], err
    return {n: p.detach().clone() for n, p in run.parts.bundle.unet.named_parameters()}, err


@pytest.mark.slow
@pytest.mark.parametrize("backend,tol", [("aot_eager", 1e-5), ("inductor", 1e-4)])
@pytest.mark.parametrize("model", ["tiny-sd15", "tiny-sdxl"])
@pytest.mark.parametrize("script", ["train_lora", "train_dreambooth"])
def test_compiled_training_matches_eager(script, model, backend, tol, dataset, tmp_path, train):
    """Slow (see the module docstring): 2 SGD steps of batch 2, gradient checkpointing on, the
    U-Net compiled as one graph (no fallback) against eager; every trained tensor within ``tol``."""
    eager, _ = _final_weights(train, script, _train_args(script, model, dataset, tmp_path / "e"),
                              tmp_path / "e")
    args = _train_args(script, model, dataset, tmp_path / "c") + ["--torch_compile",
                                                                   "--dynamo_backend", backend]
    compiled, err = _final_weights(train, script, args, tmp_path / "c")
    assert "torch_compile: U-Net traced and compiled" in err and "one by one" not in err
    assert eager.keys() == compiled.keys()
    for k, b in eager.items():
        assert rel_diff(compiled[k], b) < tol, k
    if script == "train_lora":  # the runs trained: up weights start at zero
        assert any(float(v.abs().sum()) > 0 for k, v in eager.items() if k.endswith("lora_up.weight"))
    else:
        from library.models.families.sd_common.tiny_models import ARCH_OF_NAME, build_tiny_components

        start = dict(build_tiny_components(ARCH_OF_NAME[model])["unet"].named_parameters())
        assert any(not torch.equal(start[k], v) for k, v in eager.items())
