"""Runs a kohya-ss/sd-scripts training script with exact per-step time stamps, and the helpers the
benchmarks (ddp_scaling.py, gpu.py) share to run it side by side with ours.

    SD_PYTHON benchmarks/sd_scripts_launch.py SD_SCRIPTS/train_network.py [its arguments]
    SD_PYTHON -m accelerate.commands.launch [...] benchmarks/sd_scripts_launch.py SD_SCRIPTS/train_db.py [...]

As a script it runs in sd-scripts' own environment (its venv, its ``library`` package; nothing of
this toolkit is imported) and changes nothing in sd-scripts' files. Before the training script
runs (``runpy``, as ``__main__``, its folder first on ``sys.path``):
- Timing: accelerate's ``AcceleratedOptimizer.step`` (the optimizer sd-scripts prepares and steps
  once per optimizer step) is wrapped. After each call that stepped (``sync_gradients``: not a
  gradient-accumulation micro-step), the rank-0 process waits for the GPU if CUDA is in use and
  prints ``sdtk-step N SECONDS`` (``time.perf_counter``); before the first step it prints
  ``sdtk-trainable-params N``, the elements of the parameters in the optimizer's groups that
  require a gradient. On the CPU, from step 2 on, the step line ends with `` te=SECONDS``: the
  time spent in the CLIP text encoders' forward during that step (SD1 sd-scripts encodes the captions every step; it
  has no text-encoder output cache for SD1, which our rows use). Step N's duration is ``SECONDS[N] - SECONDS[N-1]``: end of one optimizer
  step to the end of the next, everything in between (data, forward, backward, all-reduce, clip,
  step) included, which is what ``benchmarks/step_timer.py`` measures on our side (it marks
  after each step's update). Step 1 has no start mark here, so it is always warmup.
  A fused backward pass (flux_train.py's ``--fused_backward_pass``) steps each parameter inside
  the backward and never calls the optimizer's ``step``: there accelerate's
  ``AcceleratedScheduler.step``, which the training loop calls once per step after the backward,
  marks the step instead (the trainable parameters are then counted from the scheduler's
  optimizers); a scheduler step right after an optimizer step that marked adds no mark.
- Memory: when the script returns, if it used CUDA, it prints ``sdtk-peak-memory ALLOCATED
  RESERVED``: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` in bytes over the
  whole run (loading, caching and training; the counters gpu.py reads for our rows).
- torchvision: 0.28.0, the release built for torch 2.13, is on the package registry only as a
  CUDA build; its C++ ops library cannot load next to the CPU torch, and its import then fails
  registering fake kernels for ``torchvision::nms`` and ``::qnms`` ("operator torchvision::nms
  does not exist", a torchvision bug: its other registrations check that the ops loaded).
  sd-scripts uses only torchvision's pure-Python transforms, so when the ops library does not
  load the launcher declares those two operators' schemas first; the ops themselves stay unusable.
- accelerate on several CPU processes: see _skip_ddp_for_frozen_modules_on_cpu (sd-scripts' LoRA
  cannot start there otherwise; on GPUs accelerate already behaves so).
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType

# Run as a script, the launcher is in sd-scripts' process: our ``library`` package must not be
# imported there (it would stand for sd-scripts' own ``library``), so the helpers of our side
# import it when called, and the repository root is not put on sys.path.

# Top-level modules sd-scripts' train_db.py / train_network.py (and its library) import.
SD_SCRIPTS_MODULES = ("torch", "torchvision", "accelerate", "transformers", "diffusers", "ftfy", "cv2",
                      "einops", "safetensors", "toml", "voluptuous", "imagesize", "huggingface_hub")
# The tokenizers sd-scripts loads from the hub, found offline under --tokenizer_cache_dir as
# <cache>/<id with "/" replaced by "_">: the CLIP ones (our shipped CLIP tokenizer under each id)
# and FLUX.1's / SD3's T5 one (our tiny offline T5 tokenizer, benchmarks/flux_weights.py's).
SD_SCRIPTS_TOKENIZERS = ("openai/clip-vit-large-patch14", "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k")
T5_TOKENIZER_ID = "google/t5-v1_1-xxl"
# The snapshot name of hub_cache's folders (any 40 hex digits: nothing is fetched).
HUB_REVISION = "0" * 40
STEP_LINE = re.compile(r"^sdtk-step (\d+) ([0-9.]+)(?: te=([0-9.]+))?$", re.M)
PARAMS_LINE = re.compile(r"^sdtk-trainable-params (\d+)$", re.M)
PEAK_LINE = re.compile(r"^sdtk-peak-memory (\d+) (\d+)$", re.M)


# -- our side: command lines, checks, parsing -------------------------------------------------
class SdScriptsError(Exception):
    """A bad --sd-scripts / --sd-scripts-python value (the benchmarks print it as one line, exit 2)."""


def check_paths(sd_scripts: str | None, python: str | None, entry: str) -> None:
    if python and not sd_scripts:
        raise SdScriptsError("--sd-scripts-python needs --sd-scripts (the checkout to run)")
    if sd_scripts and not os.path.isfile(os.path.join(sd_scripts, entry)):
        raise SdScriptsError(f"--sd-scripts {sd_scripts}: no {entry} there, not an sd-scripts checkout")
    if python and not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise SdScriptsError(f"--sd-scripts-python {python}: not an executable file")


def missing_modules(python: str) -> list[str]:
    """The modules of SD_SCRIPTS_MODULES that ``python`` cannot find (checked in that interpreter)."""
    code = ("import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] "
            "if importlib.util.find_spec(m) is None))")
    p = subprocess.run([python, "-c", code, *SD_SCRIPTS_MODULES], capture_output=True, text=True,
                       env=clean_env({}), timeout=120)
    if p.returncode != 0:
        raise SdScriptsError(f"--sd-scripts-python {python}: does not run Python "
                             f"({(p.stderr.strip().splitlines() or ['?'])[-1]})")
    return p.stdout.split()


def clean_env(extra: dict) -> dict:
    """The environment for sd-scripts: offline, without this toolkit on PYTHONPATH (its ``library``
    package would shadow sd-scripts' own) nor a parent's distributed variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


# The start of a side-by-side check's code in sd-scripts' process (sd_scripts_lumina_check.py,
# sd_scripts_anima_check.py): argv = this file's path, the work folder, the model config as JSON.
# sd-scripts' networks/ is a namespace package: a regular one elsewhere on the path (this toolkit's,
# installed editable) would win, so those entries go; then torchvision's missing ops are declared.
CHECK_PRELUDE = r"""
import importlib.util, json, os, sys
sys.path = ["."] + [p for p in sys.path if p and not os.path.isfile(os.path.join(p, "networks", "__init__.py"))]
spec = importlib.util.spec_from_file_location("sdtk_launch", sys.argv[1])
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
launch._declare_missing_torchvision_ops()
work, cfg = sys.argv[2], json.loads(sys.argv[3])
"""


def run_check(argv, doc: str, family: str, models_file: str, write_inputs, sd_side: str) -> int:
    """The main of a side-by-side check: ``--sd-scripts`` (a checkout whose library has
    ``models_file``), ``--sd-scripts-python``, ``--work``; our side's ``write_inputs(work) -> config``,
    then CHECK_PRELUDE + ``sd_side`` in sd-scripts' process. Prints its ``ok`` / ``FAILED`` / ``note``
    lines; 0 when every check is ok, 1 otherwise, 2 for a folder that is not such a checkout."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--sd-scripts", required=True, metavar="PATH", help="a kohya-ss/sd-scripts checkout")
    p.add_argument("--sd-scripts-python", metavar="PYTHON", default=sys.executable)
    p.add_argument("--work", metavar="DIR", help="where the files go (default: a temporary folder)")
    a = p.parse_args(argv)
    if not os.path.isfile(os.path.join(a.sd_scripts, "library", models_file)):
        print(f"error: --sd-scripts {a.sd_scripts}: not a kohya-ss/sd-scripts checkout with {family} "
              f"(its library folder has no {models_file})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="sdtk-check-") as tmp:
        work = os.path.abspath(a.work or tmp)
        os.makedirs(work, exist_ok=True)
        config = write_inputs(work)
        r = subprocess.run([a.sd_scripts_python, "-c", CHECK_PRELUDE + sd_side, os.path.abspath(__file__), work,
                            json.dumps(config)], cwd=a.sd_scripts, capture_output=True, text=True,
                           env=clean_env({"OMP_NUM_THREADS": "1"}))
        lines = [line for line in r.stdout.splitlines() if line.startswith(("ok", "FAILED", "note"))]
        print("\n".join(lines))
        if r.returncode != 0:
            print("FAILED sd-scripts' side stopped: " + (r.stderr.strip().splitlines() or ["?"])[-1])
        checks = [line for line in lines if not line.startswith("note")]
        return 0 if r.returncode == 0 and checks and all(line.startswith("ok") for line in checks) else 1


def remove_random_weights_file(work: str, arch: str) -> None:
    """Delete random_weights_file's file, if written."""
    path = os.path.join(work, f"{arch}-arch.safetensors")
    if os.path.exists(path):
        os.remove(path)


def random_weights_file(work: str, arch: str) -> str:
    """``<arch>-arch`` (our random-weight real-size architecture, "sd15" or "sdxl") as a single file
    in ``work``, written once: the model sd-scripts loads, the same weights as our rows."""
    path = os.path.join(work, f"{arch}-arch.safetensors")
    if not os.path.exists(path):
        # lazy: our library must not load in sd-scripts' process (the module's note above)
        from library.models import loading, sd_checkpoint

        bundle = loading.load_model_bundle(f"{arch}-arch")
        sd_checkpoint.save_single_file(bundle.components(), bundle.family, path, embed_config=False)
    return path


def tokenizer_cache(work: str) -> str:
    """A --tokenizer_cache_dir for sd-scripts holding our shipped CLIP tokenizer files under every
    CLIP id it looks for and the tiny T5 tokenizer under T5-XXL's, so it never goes to the hub
    (gpu.sd_scripts_tokenizers adds Lumina 2's Gemma one)."""
    # lazy: our library must not load in sd-scripts' process (the module's note above)
    from library.models import loading, t5

    cache = os.path.join(work, "sd-scripts-tokenizers")
    for model_id in SD_SCRIPTS_TOKENIZERS:
        dest = os.path.join(cache, model_id.replace("/", "_"))
        if not os.path.isdir(dest):
            shutil.copytree(loading.SHIPPED_TOKENIZER, dest)
    dest = os.path.join(cache, T5_TOKENIZER_ID.replace("/", "_"))
    if not os.path.isdir(dest):
        write_t5_tokenizer(t5.build_tiny_tokenizer(), dest)
    return cache


def write_tokenizer(tokenizer, folder: str, config: dict) -> None:
    """A fast tokenizer as transformers 4 (sd-scripts' pin) and 5 both load it: the tokenizers-library
    file and a tokenizer_config.json of ``config`` alone (transformers 5's own save_pretrained writes
    keys and classes 4 cannot read: ``extra_special_tokens`` as a list, ``TokenizersBackend``)."""
    os.makedirs(folder, exist_ok=True)
    tokenizer.backend_tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)


def write_t5_tokenizer(tokenizer, dest: str) -> None:
    """A T5 tokenizer folder that both transformers versions load as ``T5TokenizerFast`` (write_tokenizer)."""
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write_tokenizer(tokenizer, tmp, {"tokenizer_class": "T5Tokenizer", "eos_token": "</s>", "pad_token": "<pad>",
                                     "unk_token": "<unk>", "extra_ids": 0,
                                     "model_max_length": tokenizer.model_max_length})
    os.replace(tmp, dest)


def hub_entry(cache: str, model_id: str, source: str) -> None:
    """``source``'s files as ``model_id``'s snapshot in the hub cache layout under ``cache`` (once)."""
    repo = os.path.join(cache, "models--" + model_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", HUB_REVISION)
    if not os.path.isdir(snapshot):
        shutil.copytree(source, snapshot)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w", encoding="utf-8") as f:
        f.write(HUB_REVISION)


def hub_cache(work: str) -> str:
    """A Hugging Face hub cache (for ``HF_HUB_CACHE``) holding tokenizer_cache's tokenizers under
    their hub ids: sd-scripts' flux_train.py builds its tokenizers without --tokenizer_cache_dir,
    so offline it finds them only there."""
    tokenizers = tokenizer_cache(work)
    cache = os.path.join(work, "sd-scripts-hub")
    for model_id in (*SD_SCRIPTS_TOKENIZERS, T5_TOKENIZER_ID):
        hub_entry(cache, model_id, os.path.join(tokenizers, model_id.replace("/", "_")))
    return cache


def command(python: str, sd_scripts: str, entry: str, args: list, procs: int | None, port: int = 0) -> list:
    """The command line: the launcher running sd-scripts' ``entry``; with ``procs``, under ``accelerate
    launch`` (2 or more: ``--multi_gpu``, torchrun processes, which accelerate puts on gloo when there
    is no CUDA; 1: ``--cpu``, one plain process)."""
    me = os.path.abspath(__file__)
    script = [me, os.path.join(os.path.abspath(sd_scripts), entry), *map(str, args)]
    if procs is None:
        return [python, *script]
    launch = [python, "-m", "accelerate.commands.launch", "--num_processes", str(procs), "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1"]
    if procs > 1:
        launch += ["--multi_gpu", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
    else:
        launch += ["--cpu"]
    return launch + script


def parse_output(text: str) -> dict:
    """The launcher's lines in an sd-scripts run's standard output: ``times``, the durations of
    steps 2..N in seconds; ``te``, the text-encoder forward seconds of those steps (CPU runs; else
    empty); ``params``, the trainable parameter count (None if it printed none); ``peak``, the
    peak allocated and reserved CUDA memory in bytes (None: the run used no CUDA)."""
    marks = [(int(n), float(t), float(te) if te else None) for n, t, te in STEP_LINE.findall(text)]
    if [m[0] for m in marks] != list(range(1, len(marks) + 1)):
        raise ValueError(f"step marks out of order: {[m[0] for m in marks]}")
    params = PARAMS_LINE.findall(text)
    peak = PEAK_LINE.findall(text)
    return {"times": [b[1] - a[1] for a, b in zip(marks, marks[1:])],
            "te": [m[2] for m in marks[1:] if m[2] is not None],
            "params": int(params[0]) if params else None,
            "peak": (int(peak[-1][0]), int(peak[-1][1])) if peak else None}


def run(cmd: list, cwd: str, env: dict, timeout: int | None = None) -> dict:
    """Run ``cmd``; its parse_output, or RuntimeError with its last error line."""
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
        raise RuntimeError(((errors or lines or ["?"])[-1]).strip()[:240])
    out = parse_output(p.stdout)
    if not out["times"]:
        raise RuntimeError("fewer than 2 optimizer steps in its output")
    return out


# -- sd-scripts' side: the launcher -----------------------------------------------------------
def _declare_missing_torchvision_ops() -> None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.origin:
        return
    libs = glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so"))
    try:
        if libs:
            torch.ops.load_library(libs[0])  # torchvision loads it again: a no-op then
            return
    except OSError:
        pass
    for op in ("nms", "qnms"):
        if hasattr(torch.ops.torchvision, op):  # declared already (a check's prelude, then main)
            continue
        torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def _skip_ddp_for_frozen_modules_on_cpu() -> None:
    """accelerate 1.6 wraps every prepared model in DistributedDataParallel on several CPU processes,
    even one without trainable parameters (its GPU branch skips those), and DDP refuses such a
    module: sd-scripts' LoRA prepares the frozen U-Net, so it cannot start on 2 CPU processes. Do
    on the CPU what accelerate does on GPUs (sd-scripts' multi-GPU path): leave such a model
    unwrapped."""
    real = Accelerator.prepare_model

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if self.distributed_type == DistributedType.MULTI_CPU and not any(p.requires_grad for p in model.parameters()):
            evaluation_mode = True  # accelerate's switch for "no DDP wrapper"; nothing else differs
        return real(self, model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    Accelerator.prepare_model = prepare_model


def _install_step_marks() -> None:
    rank0 = int(os.environ.get("RANK", "0")) == 0
    real_step, real_scheduler_step = AcceleratedOptimizer.step, AcceleratedScheduler.step
    state = {"count": 0, "marked": False}  # marked: by an optimizer step since the last scheduler step
    te = {"seconds": 0.0, "on": None}

    def first_call(groups) -> None:
        if te["on"] is None:  # the first call (an accumulation micro-step, or step 1)
            if rank0:
                n = sum(p.numel() for g in groups for p in g["params"] if p.requires_grad)
                print(f"sdtk-trainable-params {n}", flush=True)
            te["on"] = _time_text_encoders(_clip_classes(), te)  # from step 2 on (step 1 is warmup)

    def mark() -> None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
        state["count"] += 1
        if rank0:
            suffix = f" te={te['seconds']:.6f}" if te["on"] and not cuda and state["count"] > 1 else ""
            print(f"sdtk-step {state['count']} {time.perf_counter():.6f}{suffix}", flush=True)
        te["seconds"] = 0.0

    def step(self, *args, **kwargs):
        first_call(self.optimizer.param_groups)
        out = real_step(self, *args, **kwargs)
        if self.gradient_state.sync_gradients:
            mark()
            state["marked"] = True
        return out

    def scheduler_step(self, *args, **kwargs):
        out = real_scheduler_step(self, *args, **kwargs)
        if self.gradient_state.sync_gradients:
            if not state["marked"]:  # no optimizer step: the parameters were stepped in the backward
                first_call([g for opt in self.optimizers for g in opt.param_groups])
                mark()
            state["marked"] = False
        return out

    AcceleratedOptimizer.step = step
    AcceleratedScheduler.step = scheduler_step


def _print_peak_memory() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized() and int(os.environ.get("RANK", "0")) == 0:
        print(f"sdtk-peak-memory {torch.cuda.max_memory_allocated()} {torch.cuda.max_memory_reserved()}", flush=True)


def _clip_classes() -> list:
    """transformers' CLIP text encoder classes, if the training script imported transformers
    (looked up then, so the launcher itself does not pay for importing it)."""
    tr = sys.modules.get("transformers")
    return [getattr(tr, n) for n in ("CLIPTextModel", "CLIPTextModelWithProjection")] if tr else []


def _time_text_encoders(classes: list, acc: dict) -> bool:
    """Add the seconds spent in each class's forward to acc["seconds"] (on the CPU, where calls
    are synchronous; SD1 sd-scripts has no text-encoder output cache and encodes the captions
    every step). False when there is nothing to time."""
    for cls in classes:
        def timed(self, *args, _real=cls.forward, **kwargs):
            start = time.perf_counter()
            try:
                return _real(self, *args, **kwargs)
            finally:
                acc["seconds"] += time.perf_counter() - start
        cls.forward = timed
    return bool(classes)


def main() -> None:
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(script))
    _declare_missing_torchvision_ops()
    _skip_ddp_for_frozen_modules_on_cpu()
    _install_step_marks()
    runpy.run_path(script, run_name="__main__")
    _print_peak_memory()


if __name__ == "__main__":
    main()
