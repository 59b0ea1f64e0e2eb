"""Options for unit tests, built from the schema (library/config/options.py) like a real run's.

    opts = make_opts(optimizer_type="AdamW8bit", optimizer_args={"weight_decay": 0.01})

Every option a test does not name has its schema default; a named one is read as the same key
in a run file (typed, range- and choice-checked), and a name the script does not take is an
error, so a test cannot build options no run could have. The required options
(pretrained_model_name_or_path, training length...) are not required here: a unit test names
only what its unit reads. End-to-end tests use parse_args with an argv instead.

``source_files()`` lists the toolkit's own Python files, for the tests that scan the code.
``load_lora_logged(pipe, path)`` runs diffusers' ``load_lora_weights`` and returns what diffusers
logged meanwhile (lower case), for the tests that every key of a file is taken.
``assert_same_unet_function(ref, unet)``: two U-Nets of the same weights in other layouts (1x1
conv or Linear projections) give the same output up to float32 rounding.
``single_token_self_attention(unet)`` finds the LoRA targets whose gradient is zero in exact
arithmetic (a test must not assert what float noise does there).
"""
from __future__ import annotations

import contextlib
import glob
import io
import logging
import os

from library.accelerator import free_port
from library.config.parse import Options, options_from_values

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_opts(script: str = "train_lora", **overrides) -> Options:
    return options_from_values(script, overrides)


def source_files() -> list[str]:
    """Every Python file of the toolkit: the entry scripts and library/, networks/, tools/ and
    benchmarks/ with their sub-packages (not tests/)."""
    files = glob.glob(os.path.join(ROOT, "*.py"))
    for d in ("library", "networks", "tools", "benchmarks"):
        files += glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)
    return sorted(files)


def spawn_two_processes(worker, timeout: float) -> list:
    """Runs ``worker(rank, port, queue)`` in two spawned processes (a gloo job of two on a free
    local port) and returns what each put on the queue (one item each, in arrival order); both
    must exit 0. Much cheaper than launching an entry script: no accelerate, no model."""
    import multiprocessing


    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        items = [queue.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return items


def run_with_one_spawned_process(worker, timeout: float) -> list:
    """Runs ``worker(rank, port, queue)`` as rank 0 in this process and as rank 1 in one spawned
    process (a gloo job of two) and returns [rank 0's item, rank 1's item]; the spawned process
    must exit 0. Half the start-up of ``spawn_two_processes``: this process has its imports
    (torch, dynamo) loaded already. This process must hold no process group, and the worker
    must destroy the one it makes."""
    import multiprocessing
    import queue as queues


    ctx = multiprocessing.get_context("spawn")
    remote, local = ctx.Queue(), queues.SimpleQueue()
    port = free_port()
    proc = ctx.Process(target=worker, args=(1, port, remote))
    proc.start()
    try:
        worker(0, port, local)
        items = [local.get(), remote.get(timeout=timeout)]
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    assert proc.exitcode == 0, proc.exitcode
    return items


@contextlib.contextmanager
def single_token_self_attention(unet):
    """Collects, while the block runs, the to_q / to_k projections of the U-Net's self-attention
    layers (attn1) that a forward feeds a single token: their softmax is 1 whatever q and k are,
    so the gradients to those projections and to a LoRA on them are zero in exact arithmetic
    (the tiny SD1 U-Net's mid block at 64 px). One CPU's kernels leave exact zeros there, another's
    float noise, which AdamW then scales to learning-rate-sized steps: a test excludes them by
    this rule, never by a list measured on one machine. Yields the set of modules, filled as it runs."""
    found: set = set()

    def record(attn, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.dim() == 3 and hidden.shape[1] == 1:
            found.update((attn.to_q, attn.to_k))

    handles = [m.register_forward_pre_hook(record, with_kwargs=True)
               for name, m in unet.named_modules() if name.endswith("attn1") and hasattr(m, "to_q")]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def lora_names_of(network, modules) -> set[str]:
    """The kohya names of a network's LoRA modules applied to the given base modules."""
    ids = {id(m) for m in modules}
    return {lora.lora_name for lora in (*network.text_encoder_loras, *network.unet_loras)
            if id(lora.org_module) in ids}


def reaccelerate(run, acc) -> None:
    """A finished run's parts on a new Accelerator ``acc`` (the test runner reset Accelerate's
    state after the run): the run's record and the batch loss, which computes with it."""
    run.parts.accelerator = acc
    run.parts.batch_loss.accelerator = acc


def load_lora_logged(pipe, path: str) -> str:
    """``pipe.load_lora_weights(path)`` with diffusers' log at INFO captured: the log, lower case
    (diffusers names the keys it skips or cannot place there)."""
    from diffusers.utils import logging as diffusers_logging  # lazy: only the diffusers loader tests need it

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setLevel(logging.INFO)
    diffusers_logging.get_logger("diffusers").addHandler(handler)
    diffusers_logging.set_verbosity_info()
    try:
        pipe.load_lora_weights(path)
    finally:
        diffusers_logging.get_logger("diffusers").removeHandler(handler)
        diffusers_logging.set_verbosity_warning()
    return buf.getvalue().lower()


def assert_same_unet_function(ref, unet) -> None:
    """``unet`` computes what ``ref`` computes on one random input: the same products by another
    kernel (a 1x1 convolution against a Linear layer), so float32 rounding only (1e-5 of the
    output's largest magnitude)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, ref.config.in_channels, 16, 16, generator=g)
    ctx = torch.randn(1, 7, ref.config.cross_attention_dim, generator=g)
    with torch.no_grad():
        want, got = ref(x, 10, ctx).sample, unet(x, 10, ctx).sample
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
