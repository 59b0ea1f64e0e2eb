"""CPU scaling benchmark: 2 processes x 1 thread against 1 process x 1 thread, side by side.

    python benchmarks/ddp_scaling.py [--steps 3] [--warmup 1] [--methods dreambooth lora]
                                     [--strategies ddp sum] [--no-bare]
                                     [--sd-scripts PATH [--sd-scripts-python PYTHON]]

On the real-width SD1.5 U-Net (``sd15-arch``, random weights) at 64 px, the same per-process
batch (``--batch``, default 1) in every run, plain SGD, cached latents and text-encoder outputs:
  ours      train_dreambooth (the whole U-Net) and train_lora (rank 16, U-Net only) through this
            toolkit's trainer, launched with torchrun; one row per ``--strategies`` entry: "ddp"
            is the trainer's engine (PyTorch DistributedDataParallel over the denoiser, buckets
            all-reduced during the backward, library/distributed/ddp.py); "sum" the path before
            it (each process backpropagates its share, then ``library.accelerator
            .sum_gradients`` all-reduces flat buckets after the backward), selected in the
            worker by ``sum_after_backward_ddp`` (this benchmark's DDP subclass; not a user option)
  bare DDP  the same U-Net in ``torch.nn.parallel.DistributedDataParallel`` (gloo), SGD, random
            inputs: what PyTorch itself reaches on this machine
  sd-scripts  train_db.py / train_network.py when ``--sd-scripts`` names a checkout, run by
            ``--sd-scripts-python`` (its own venv; default: this Python; the modules it lacks
            are listed instead) through benchmarks/sd_scripts_launch.py under ``accelerate
            launch`` (2 processes: ``--multi_gpu``, which accelerate runs on gloo without CUDA),
            on the same random weights (``sd15-arch`` written as a single file), the same data,
            our shipped CLIP tokenizer (``--tokenizer_cache_dir``), SGD, lr 1e-4, 64 px, cached
            latents, SDPA, no mixed precision. DreamBooth: the whole U-Net, text encoder frozen
            (``--stop_text_encoder_training -1``; captions padded to 77 tokens as ours, so no
            ``--no_token_padding``); LoRA: rank 16, alpha 16, U-Net only. What differs: SD1
            sd-scripts has no text-encoder output cache, so it runs the frozen text encoder
            forward every step (its time is printed as "text encoder"); its LoRA all-reduces
            each LoRA parameter's gradient after the backward (``all_reduce_network``)
Time per step = the median over the ``--steps`` steps after ``--warmup``, on rank 0: ours from
benchmarks/step_timer.py, sd-scripts' from the launcher's time stamps after each optimizer step
(its step 1 has no start mark, so ``--warmup`` is at least 1 with ``--sd-scripts``); ratio =
2-process step / 1-process step (1.0: perfect scaling of the global batch, 2.0: no gain over
one process). "trainable" = the parameters the optimizer updates, as each side counts them.
Run it on an idle machine (it takes minutes; ``uptime`` load under 2): the processes share the
cores with whatever else runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from diffusers import UNet2DConditionModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import sd_scripts_launch, step_timer  # noqa: E402
from library.accelerator import free_port  # noqa: E402
from library.distributed import strategy  # noqa: E402
from tools.make_sample_dataset import make_sample_dataset  # noqa: E402

# Per gradient strategy: extra trainer options, and whether the DDP strategy runs PyTorch's
# DistributedDataParallel ("ddp", the trainer's engine) or the old synchronous bucketed sum after
# the backward ("sum"; the worker process runs sum_after_backward_ddp's strategy).
STRATEGIES = {"ddp": {"args": [], "reducer": True}, "sum": {"args": [], "reducer": False}}
METHOD_SCRIPT = {"dreambooth": "train_dreambooth", "lora": "train_lora"}
SD_SCRIPTS_ENTRY = {"dreambooth": "train_db.py", "lora": "train_network.py"}


def worker_env() -> dict:
    """A launched worker's environment: one thread, offline, this checkout first, no parent's
    distributed variables (benchmarks/step_overhead.py's workers too)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def launch(procs: int, worker_args: list, result: str) -> dict:
    """Run this script's worker under torchrun with ``procs`` processes; its rank-0 result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), os.path.abspath(__file__),
           "--worker", *map(str, worker_args), "--result", result]
    p = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"worker failed ({' '.join(map(str, worker_args))}, {procs} processes):\n"
                         + p.stderr[-3000:])
    with open(result, encoding="utf-8") as f:
        return json.load(f)


# -- workers (one per process, under torchrun) ------------------------------------------------
def sum_after_backward_ddp():
    """The DDP strategy of the path before DistributedDataParallel: no reducer, the plain
    stepper sums the gradients after the backward (``BucketedSum``, chosen by the strategy's
    ``make_stepper``). A subclass of the trainer's, for this benchmark's "sum" column only."""
    class SumAfterBackward(strategy.DDP):
        def uses_reducer(self, opts) -> bool:
            return False

    return SumAfterBackward


def ours_worker(a) -> list:
    production = strategy.DDP
    if not STRATEGIES[a.strategy]["reducer"]:
        # this worker process only: for_run builds the benchmark's DDP subclass
        strategy.DDP = sum_after_backward_ddp()
    script = METHOD_SCRIPT[a.method]
    args = ["--pretrained_model_name_or_path", "sd15-arch", "--train_data_dir", a.data,
            "--output_dir", a.out, "--resolution", "64", "--train_batch_size", a.batch,
            "--max_train_steps", a.warmup + a.steps, "--cache_latents",
            "--cache_text_encoder_outputs", "--optimizer_type", "torch.optim.SGD",
            "--learning_rate", "1e-4", "--seed", "1", *STRATEGIES[a.strategy]["args"]]
    if a.method == "lora":
        args += ["--network_dim", "16", "--network_alpha", "16", "--network_train_unet_only"]
    times, run = step_timer.timed_run(script, args)
    used = run.parts.strategy
    if isinstance(used, production) and used.engine != STRATEGIES[a.strategy]["reducer"]:
        raise SystemExit(f"--strategy {a.strategy}: the run's DDP strategy "
                         f"{'used' if used.engine else 'did not use'} DDP's reducer")
    return {"times": times, "params": sum(p.numel() for p in run.parts.params if p.requires_grad)}


def bare_worker(a) -> list:
    """Bare PyTorch: the sd15 U-Net, DDP over gloo when several processes, SGD, random inputs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = UNet2DConditionModel.load_config(os.path.join(ROOT, "configs", "models", "sd15"),
                                           subfolder="unet")
    unet = UNet2DConditionModel.from_config(cfg).train()
    model = torch.nn.parallel.DistributedDataParallel(unet) if world > 1 else unet
    opt = torch.optim.SGD(unet.parameters(), lr=1e-4)
    b = a.batch
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    x = torch.randn(b, 4, 8, 8, generator=g)
    cond = torch.randn(b, 77, cfg["cross_attention_dim"], generator=g)
    t = torch.randint(0, 1000, (b,), generator=g)
    times = []
    for _ in range(a.warmup + a.steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x, t, cond).sample, x)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    if world > 1:
        dist.destroy_process_group()
    return {"times": times, "params": sum(p.numel() for p in unet.parameters())}


def sd_scripts_args(method: str, model: str, tokenizers: str, data: str, out: str, a) -> list:
    """sd-scripts' options for the same run as ours (see the module docstring for what differs)."""
    args = ["--pretrained_model_name_or_path", model, "--tokenizer_cache_dir", tokenizers,
            "--train_data_dir", data, "--output_dir", out, "--resolution", "64",
            "--train_batch_size", a.batch, "--max_train_steps", a.warmup + a.steps, "--cache_latents",
            "--optimizer_type", "SGD", "--learning_rate", "1e-4", "--seed", "1",
            "--max_data_loader_n_workers", "0", "--sdpa", "--mixed_precision", "no"]
    if method == "lora":
        return args + ["--network_module", "networks.lora", "--network_dim", "16", "--network_alpha", "16",
                       "--network_train_unet_only"]
    return args + ["--stop_text_encoder_training", "-1",  # -1: the text encoder is not trained
                   "--save_model_as", "safetensors"]


def sd_scripts_run(path: str, python: str, method: str, procs: int, data: str, work: str, a) -> dict:
    """sd-scripts' train_db.py / train_network.py under accelerate launch: rank 0's step times and
    trainable parameter count (benchmarks/sd_scripts_launch.py)."""
    model = sd_scripts_launch.random_weights_file(work, "sd15")
    tokenizers = sd_scripts_launch.tokenizer_cache(work)
    out = os.path.join(work, f"sd-{method}-{procs}")
    cmd = sd_scripts_launch.command(python, path, SD_SCRIPTS_ENTRY[method], sd_scripts_args(method, model, tokenizers, data, out, a),
                      procs, free_port())
    try:
        return sd_scripts_launch.run(cmd, cwd=path, env=sd_scripts_launch.clean_env({"OMP_NUM_THREADS": "1"}))
    finally:
        shutil.rmtree(out, ignore_errors=True)  # a DreamBooth output is a 4 GB checkpoint


def format_table(rows: list, a) -> list[str]:
    lines = [f"\nsd15-arch U-Net, 64 px, per-process batch {a.batch}, 1 thread per process, "
             f"median of {a.steps} steps after {a.warmup}",
             f"{'run':<30} {'1 proc s/step':>13} {'2 procs s/step':>14} {'ratio':>6} {'trainable':>11}"]
    for r in rows:
        if "note" in r:
            lines.append(f"{r['run']:<30} {r['note']}")
            continue
        params = f"{r['params']:11,d}" if r.get("params") else f"{'':11}"
        lines.append(f"{r['run']:<30} {r['one']:13.2f} {r['two']:14.2f} {r['two'] / r['one']:6.2f} {params}")
        if r.get("te_one") is not None:
            lines.append(f"{'  of it text encoder forward':<30} {r['te_one']:13.2f} {r['te_two']:14.2f}")
    return lines


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps not timed")
    p.add_argument("--batch", type=int, default=1, help="per-process batch")
    p.add_argument("--methods", nargs="*", default=["dreambooth", "lora"], choices=sorted(METHOD_SCRIPT))
    p.add_argument("--strategies", nargs="*", default=["ddp", "sum"], choices=sorted(STRATEGIES))
    p.add_argument("--no-bare", action="store_true", help="skip the bare PyTorch DDP rows")
    p.add_argument("--sd-scripts", metavar="PATH", help="a kohya-ss/sd-scripts checkout")
    p.add_argument("--sd-scripts-python", metavar="PYTHON",
                   help="the Python that runs sd-scripts (its own venv; default: this one)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    # worker mode (internal: what the launched processes run)
    p.add_argument("--worker", choices=["ours", "bare"], help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.worker:
        torch.set_num_threads(1)
        result = ours_worker(a) if a.worker == "ours" else bare_worker(a)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(a.result, "w", encoding="utf-8") as f:
                json.dump(result, f)
        return 0
    try:
        sd_scripts_launch.check_paths(a.sd_scripts, a.sd_scripts_python, "train_db.py")
        if a.sd_scripts and a.warmup < 1:
            raise sd_scripts_launch.SdScriptsError("--warmup 0 with --sd-scripts: sd-scripts' first step has no start "
                                     "mark (see benchmarks/sd_scripts_launch.py); use --warmup 1 or more")
        missing = sd_scripts_launch.missing_modules(a.sd_scripts_python or sys.executable) if a.sd_scripts else []
    except sd_scripts_launch.SdScriptsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="sdtk-ddp-bench-")
    try:  # the work folder holds multi-GB DreamBooth outputs: never leave it behind
        return _measure(a, work, missing)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(a, work: str, missing: list) -> int:
    n = 2 * a.batch * (a.warmup + a.steps)  # enough samples for every step of 2 processes
    data = os.path.dirname(make_sample_dataset(os.path.join(work, "data"), n_images=n, size=64, repeats=1))
    rows = []

    def timed(label, fn):
        res = {}
        for procs in (1, 2):
            res[procs] = r = fn(procs)
            te = f", text encoder {step_timer.median(r['te']):.2f} s of it" if r.get("te") else ""
            print(f"  {label}, {procs} process(es): {r['step']:.2f} s/step{te}", flush=True)
        rows.append({"run": label, "one": res[1]["step"], "two": res[2]["step"], "params": res[1].get("params"),
                     "te_one": step_timer.median(res[1]["te"]) if res[1].get("te") else None,
                     "te_two": step_timer.median(res[2]["te"]) if res[2].get("te") else None})

    def after_warmup(r, first=0):
        """r with "step": the median of its step times after warmup; sd-scripts' list starts at step
        2 (first=1), ours and bare at step 1."""
        skip = max(a.warmup - first, 0)
        r["te"] = r.get("te", [])[skip:]
        return dict(r, step=step_timer.median(r["times"][skip:] or r["times"]))

    def ours(method, strategy, procs):
        out = os.path.join(work, f"{method}-{strategy}-{procs}")
        try:
            return launch(procs, ["ours", "--method", method, "--strategy", strategy, "--data", data,
                                  "--out", out, "--steps", a.steps, "--warmup", a.warmup, "--batch", a.batch],
                          os.path.join(work, f"r-{method}-{strategy}-{procs}.json"))
        finally:
            shutil.rmtree(out, ignore_errors=True)  # a DreamBooth output is a 4 GB checkpoint

    python = a.sd_scripts_python or sys.executable
    for method in a.methods:
        for s in a.strategies:
            timed(f"ours {method} ({s})", lambda procs, m=method, s=s: after_warmup(ours(m, s, procs)))
        if a.sd_scripts:
            if missing:
                rows.append({"run": f"sd-scripts {method}",
                             "note": f"not run: missing {', '.join(missing)} in {python}"})
            else:
                try:
                    timed(f"sd-scripts {method}", lambda procs, m=method: after_warmup(sd_scripts_run(
                        a.sd_scripts, python, m, procs, data, work, a), first=1))
                except RuntimeError as e:
                    rows.append({"run": f"sd-scripts {method}", "note": f"failed: {e}"})
    if not a.no_bare:
        timed("bare PyTorch DDP (full U-Net)", lambda procs: after_warmup(launch(
            procs, ["bare", "--steps", a.steps, "--warmup", a.warmup, "--batch", a.batch],
            os.path.join(work, f"r-bare-{procs}.json"))))
    print("\n".join(format_table(rows, a)))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
