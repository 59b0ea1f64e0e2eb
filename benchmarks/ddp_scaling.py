"""CPU scaling benchmark: 2 processes x 1 thread against 1 process x 1 thread, side by side.

    python benchmarks/ddp_scaling.py [--steps 3] [--warmup 1] [--methods dreambooth lora]
                                     [--strategies ddp sum] [--no-bare] [--sd-scripts PATH]

On the real-width SD1.5 U-Net (``sd15-arch``, random weights) at 64 px, the same per-process
batch (``--batch``, default 1) in every run, plain SGD, cached latents and text-encoder outputs:
  ours      train_dreambooth (the whole U-Net) and train_lora (rank 16, U-Net only) through this
            toolkit's trainer, launched with torchrun; one row per ``--strategies`` entry: "ddp"
            is the trainer's engine (PyTorch DistributedDataParallel over the denoiser, buckets
            all-reduced during the backward, library/distributed/ddp.py); "sum" the path before
            it (each process backpropagates its share, then ``library.distributed.accelerator
            .sum_gradients`` all-reduces flat buckets after the backward), selected in the
            worker by ``strategy.DDP.use_reducer = False`` (not a user option)
  bare DDP  the same U-Net in ``torch.nn.parallel.DistributedDataParallel`` (gloo), SGD, random
            inputs: what PyTorch itself reaches on this machine
  sd-scripts  train_db.py / train_network.py when ``--sd-scripts`` names a checkout whose
            dependencies import in this Python (else the missing modules are listed)
Time per step = the median over the ``--steps`` steps after ``--warmup``; ratio = 2-process step
/ 1-process step (1.0: perfect scaling of the global batch, 2.0: no gain over one process).
Run it on an idle machine (it takes minutes; ``uptime`` load under 2): the processes share the
cores with whatever else runs.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

# Per gradient strategy: extra trainer options, and whether the DDP strategy runs PyTorch's
# DistributedDataParallel ("ddp", the trainer's engine) or the old synchronous bucketed sum after
# the backward ("sum"; strategy.DDP.use_reducer set in the worker process).
STRATEGIES = {"ddp": {"args": [], "reducer": True}, "sum": {"args": [], "reducer": False}}
METHOD_SCRIPT = {"dreambooth": "train_dreambooth", "lora": "train_lora"}
# Top-level modules sd-scripts' train_db.py / train_network.py import (its requirements.txt).
SD_SCRIPTS_MODULES = ("torchvision", "accelerate", "transformers", "diffusers", "ftfy", "cv2",
                      "einops", "safetensors", "toml", "voluptuous", "imagesize", "huggingface_hub")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def launch(procs: int, worker_args: list, result: str) -> dict:
    """Run this script's worker under torchrun with ``procs`` processes; its rank-0 result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), os.path.abspath(__file__),
           "--worker", *map(str, worker_args), "--result", result]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"worker failed ({' '.join(map(str, worker_args))}, {procs} processes):\n"
                         + p.stderr[-3000:])
    with open(result, encoding="utf-8") as f:
        return json.load(f)


# -- workers (one per process, under torchrun) ------------------------------------------------
def ours_worker(a) -> list:
    import step_timer

    from library.distributed import strategy

    strategy.DDP.use_reducer = STRATEGIES[a.strategy]["reducer"]
    script = METHOD_SCRIPT[a.method]
    args = ["--pretrained_model_name_or_path", "sd15-arch", "--train_data_dir", a.data,
            "--output_dir", a.out, "--resolution", "64", "--train_batch_size", a.batch,
            "--max_train_steps", a.warmup + a.steps, "--cache_latents",
            "--cache_text_encoder_outputs", "--optimizer_type", "torch.optim.SGD",
            "--learning_rate", "1e-4", "--seed", "1", *STRATEGIES[a.strategy]["args"]]
    if a.method == "lora":
        args += ["--network_dim", "16", "--network_alpha", "16", "--network_train_unet_only"]
    times, _ = step_timer.timed_run(script, args)
    return times


def bare_worker(a) -> list:
    """Bare PyTorch: the sd15 U-Net, DDP over gloo when several processes, SGD, random inputs."""
    import torch
    import torch.distributed as dist
    from diffusers import UNet2DConditionModel

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
    return times


def sd_scripts_missing() -> list[str]:
    return [m for m in SD_SCRIPTS_MODULES if importlib.util.find_spec(m) is None]


def sd_scripts_run(path: str, method: str, procs: int, data: str, work: str, a) -> float:
    """Median step time of sd-scripts' train_db.py / train_network.py (its tqdm rate)."""
    model = os.path.join(work, "sd15-arch.safetensors")
    if not os.path.exists(model):
        from library.models import loading as models
        from library.models.sd_checkpoint import save_single_file

        bundle = models.load_model_bundle("sd15-arch")
        save_single_file(bundle.components(), bundle.family, model, embed_config=False)
    entry = "train_db.py" if method == "dreambooth" else "train_network.py"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(procs),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), *(["--multi_gpu"] if procs > 1 else ["--cpu"]),
           os.path.join(path, entry), "--pretrained_model_name_or_path", model,
           "--train_data_dir", data, "--output_dir", os.path.join(work, f"sd-{method}-{procs}"),
           "--resolution", "64", "--train_batch_size", str(a.batch),
           "--max_train_steps", str(a.warmup + a.steps), "--cache_latents",
           "--optimizer_type", "SGD", "--learning_rate", "1e-4", "--seed", "1",
           "--max_data_loader_n_workers", "0", "--sdpa"]
    if method == "lora":
        cmd += ["--network_module", "networks.lora", "--network_dim", "16", "--network_alpha", "16",
                "--network_train_unet_only"]
    p = subprocess.run(cmd, cwd=path, env=_env(), capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError((p.stderr.strip().splitlines() or ["?"])[-1][:200])
    rates = re.findall(r"([\d.]+)(it/s|s/it)", p.stderr)
    if not rates:
        raise RuntimeError("no rate in its output")
    v, unit = rates[-1]
    return 1 / float(v) if unit == "it/s" else float(v)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps not timed")
    p.add_argument("--batch", type=int, default=1, help="per-process batch")
    p.add_argument("--methods", nargs="*", default=["dreambooth", "lora"], choices=sorted(METHOD_SCRIPT))
    p.add_argument("--strategies", nargs="*", default=["ddp", "sum"], choices=sorted(STRATEGIES))
    p.add_argument("--no-bare", action="store_true", help="skip the bare PyTorch DDP rows")
    p.add_argument("--sd-scripts", metavar="PATH", help="a kohya-ss/sd-scripts checkout")
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
        import torch

        torch.set_num_threads(1)
        times = ours_worker(a) if a.worker == "ours" else bare_worker(a)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(a.result, "w", encoding="utf-8") as f:
                json.dump({"times": times}, f)
        return 0
    if a.sd_scripts and not os.path.isfile(os.path.join(a.sd_scripts, "train_db.py")):
        print(f"error: --sd-scripts {a.sd_scripts}: no train_db.py there", file=sys.stderr)
        return 2
    import step_timer  # noqa: F401  (puts the repo root on sys.path)
    from tools.make_sample_dataset import make_sample_dataset

    work = tempfile.mkdtemp(prefix="sdtk-ddp-bench-")
    n = 2 * a.batch * (a.warmup + a.steps)  # enough samples for every step of 2 processes
    data = os.path.dirname(make_sample_dataset(os.path.join(work, "data"), n_images=n, size=64, repeats=1))
    rows = []

    def timed(label, fn):
        res = {}
        for procs in (1, 2):
            t = fn(procs)
            res[procs] = t
            print(f"  {label}, {procs} process(es): {t:.2f} s/step", flush=True)
        rows.append((label, res[1], res[2]))

    def median_after_warmup(r):
        return step_timer.median(r["times"][a.warmup:] or r["times"])

    for method in a.methods:
        for s in a.strategies:
            timed(f"ours {method} ({s})", lambda procs, m=method, s=s: median_after_warmup(launch(
                procs, ["ours", "--method", m, "--strategy", s, "--data", data, "--out",
                        os.path.join(work, f"{m}-{s}-{procs}"), "--steps", a.steps, "--warmup", a.warmup,
                        "--batch", a.batch], os.path.join(work, f"r-{m}-{s}-{procs}.json"))))
        if a.sd_scripts:
            missing = sd_scripts_missing()
            if missing:
                rows.append((f"sd-scripts {method}", f"not run: missing {', '.join(missing)}", None))
            else:
                try:
                    timed(f"sd-scripts {method}", lambda procs, m=method: sd_scripts_run(
                        a.sd_scripts, m, procs, data, work, a))
                except RuntimeError as e:
                    rows.append((f"sd-scripts {method}", f"failed: {e}", None))
    if not a.no_bare:
        timed("bare PyTorch DDP (full U-Net)", lambda procs: median_after_warmup(launch(
            procs, ["bare", "--steps", a.steps, "--warmup", a.warmup, "--batch", a.batch],
            os.path.join(work, f"r-bare-{procs}.json"))))
    print(f"\nsd15-arch U-Net, 64 px, per-process batch {a.batch}, 1 thread per process, "
          f"median of {a.steps} steps after {a.warmup}")
    print(f"{'run':<34} {'1 proc s/step':>13} {'2 procs s/step':>14} {'ratio':>6}")
    for label, one, two in rows:
        if two is None:
            print(f"{label:<34} {one}")
        else:
            print(f"{label:<34} {one:13.2f} {two:14.2f} {two / one:6.2f}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump([{"run": r[0], "one": r[1], "two": r[2]} for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
