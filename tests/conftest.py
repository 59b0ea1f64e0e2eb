"""Shared fixtures: offline mode, a generated dataset, and an in-process entry-script runner."""
import contextlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.accelerator import free_port  # noqa: E402  (after ROOT is importable)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the resume check's model-hash cache: one per test session, never the user's ~/.cache/sdtk
if "SDTK_HASH_CACHE" not in os.environ:
    import tempfile

    os.environ["SDTK_HASH_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="sdtk-test-"), "file-hashes.json")


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """One intra-op thread: the CPU backward is then bit-reproducible (with several threads its
    reductions vary run to run in the last bits, which AdamW's first step amplifies), and on a
    shared 2-core machine it is faster. Subprocess tests set OMP_NUM_THREADS=1 likewise."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def dataset(tmp_path):
    """Two 64 px images in ``2_sks shape`` (4 samples per epoch)."""
    from tools.make_sample_dataset import make_sample_dataset

    root = tmp_path / "data"
    make_sample_dataset(str(root), n_images=2, size=64, repeats=2)
    return str(root)


def reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture
def run_script(capsys):
    """Run an entry script in-process: ``run_script("train_lora", [...]) -> (rc, out, err)``."""
    from library.cli import main

    def _run(script, args):
        reset_accelerate()
        rc = main(script, [str(a) for a in args])
        out, err = capsys.readouterr()
        reset_accelerate()
        return rc, out, err

    return _run


@contextlib.contextmanager
def runs_kept():
    """While open, every Run the trainer returns is appended to the yielded list (the entry
    scripts return only an exit code; a test compares the Run's in-memory model with its files)."""
    from library.run import trainer

    runs, real_run = [], trainer.run

    def spy(opts, method_name):
        runs.append(real_run(opts, method_name))
        return runs[-1]

    trainer.run = spy
    try:
        yield runs
    finally:
        trainer.run = real_run


@pytest.fixture
def train(run_script):
    """``train(script, args) -> (rc, stdout, stderr, run)``: like run_script, keeping the trainer's
    Run (its in-memory model) for comparison with what was saved."""
    with runs_kept() as runs:
        def _train(script, args):
            runs.clear()
            rc, out, err = run_script(script, args)
            return rc, out, err, (runs[0] if runs else None)

        yield _train


class FakeAccelerator:
    """The Accelerator calls a stepper makes, for a plain model without Accelerate."""

    def __init__(self):
        import torch

        self.device = torch.device("cpu")

    def backward(self, loss):
        loss.backward()

    def clip_grad_norm_(self, params, max_norm):
        import torch

        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def prepare(self, optimizer):
        return optimizer


def two_process_command(target: str, args: list, launcher=("--multi_gpu",), **env_extra):
    """(cmd, env) of ``accelerate launch --multi_gpu --num_processes 2 target *args`` on the CPU:
    a free port, offline, one thread per process, and no launcher variables inherited.
    ``launcher``: the launch mode's flags (e.g. ``--use_deepspeed --zero_stage 2``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes",
           "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(port), target, *[str(a) for a in args]]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_extra)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              *(k for k in os.environ if k.startswith("ACCELERATE_"))):
        env.pop(k, None)
    return cmd, env


@pytest.fixture
def no_weight_loading(monkeypatch):
    """Fails the test if model weights are loaded (for checks that must come before loading)."""
    from library.models import loading as models

    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the options were checked")

    monkeypatch.setattr(models, "load_model_bundle", refuse)


def read(path):
    """(tensors, metadata) of a safetensors file."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def count_sd_scripts_modules(components, conv=False):
    """LoRA modules per prefix by sd-scripts' rule, counted independently by walking the models:
    every Linear and 1x1 Conv2d below a Transformer2DModel (U-Net) or a CLIP attention/MLP (text
    encoders); with conv_dim also every Conv2d/Linear below ResnetBlock2D, Downsample2D and
    Upsample2D."""
    import torch

    def count(root, classes, any_conv):
        n = 0
        for module in root.modules():
            if type(module).__name__ in classes:
                for child in module.modules():
                    if isinstance(child, torch.nn.Linear):
                        n += 1
                    elif isinstance(child, torch.nn.Conv2d):
                        n += 1 if (any_conv or child.kernel_size == (1, 1)) else 0
        return n

    unet_classes = {"Transformer2DModel"}
    n_unet = count(components["unet"], unet_classes, False)
    if conv:
        n_unet += count(components["unet"], {"ResnetBlock2D", "Downsample2D", "Upsample2D"}, True)
    te_classes = {"CLIPAttention", "CLIPSdpaAttention", "CLIPMLP"}
    if "text_encoder_2" in components:
        return {"unet": n_unet, "te1": count(components["text_encoder"], te_classes, False),
                "te2": count(components["text_encoder_2"], te_classes, False)}
    return {"unet": n_unet, "te": count(components["text_encoder"], te_classes, False)}


def rel_diff(a, b, zero=1e-8):
    """||a-b|| / ||b|| per tensor; absolute ||a-b|| where b is (numerically) zero."""
    d = float((a.float() - b.float()).norm())
    n = float(b.float().norm())
    return d / n if n > zero else d


def diffusers_pipeline(arch, c):
    """A diffusers pipeline (SD or SDXL) over the components ``c`` of a built model."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    if arch == "sdxl":
        return StableDiffusionXLPipeline(vae=c["vae"], text_encoder=c["text_encoder"],
                                         text_encoder_2=c["text_encoder_2"], tokenizer=c["tokenizer"],
                                         tokenizer_2=c["tokenizer_2"], unet=c["unet"], scheduler=c["scheduler"])
    return StableDiffusionPipeline(vae=c["vae"], text_encoder=c["text_encoder"], tokenizer=c["tokenizer"],
                                   unet=c["unet"], scheduler=c["scheduler"], safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)


def diffusers_load_problems(pipe, path) -> list[str]:
    """``pipe.load_lora_weights(path)``, returning every warning diffusers or peft logged and every
    Python warning about LoRA keys or adapters (an empty list: every key was consumed)."""
    import logging
    import warnings

    records = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("diffusers", "peft")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe.load_lora_weights(path)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    return [r.getMessage() for r in records] + [
        str(w.message) for w in caught if any(s in str(w.message).lower() for s in ("lora", "key", "adapter"))]
