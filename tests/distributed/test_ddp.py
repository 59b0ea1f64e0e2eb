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

import os

import pytest
import torch

from tests.training.test_equivalence import read_file, train_in_process


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
        from library.distributed import accelerator as distributed
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
        from library.training.run_state import HOOKS

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
    assert not run.parts.stepper.sum_after_backward
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
