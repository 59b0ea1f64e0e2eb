"""Our training step against a bare PyTorch step on the same U-Net, in one run, interleaved.

    python benchmarks/step_overhead.py [--quick] [--modes full1 full2 lora] [--rounds 3] [--block 2]
                                       [--profile DIR] [--json FILE]

Modes (each its own launch, one thread per process, 64 px, batch 1 per process, plain SGD at
lr 1e-4, ``max_grad_norm 0``, cached latents and text-encoder outputs):
  full1  the whole U-Net trained (train_dreambooth, text encoder frozen), 1 process
  full2  the same, 2 processes (torchrun, gloo)
  lora   LoRA rank 16 on the U-Net (train_lora, ``network_train_unet_only``), 1 process
The model is ``sd15-arch`` (SD1.5's real-width U-Net, 860 M parameters, random weights, no
download); ``--quick`` shrinks its U-Net to block widths 64/128/256/256 (about 1/10 of the
parameters) for iterating, and runs the LoRA mode on ``tiny-sd15``, where the step is bound by
host work.

"ours" is the real trainer path (library.cli.main, the loop, the stepper, the non-finite guard,
the progress bar): a step's time runs from the end of one step's update to the end of the next
(library/run/run_state.py's ``after_step`` hook, which the loop calls after each update).
"bare" is a plain PyTorch loop over the very same U-Net module and parameters, inside the same
process: zero_grad (set to None), forward, MSE against the latents, backward, ``SGD.step``;
under 2 processes through ``DistributedDataParallel`` (gloo, PyTorch's defaults except
``gradient_as_bucket_view``, which ours then uses too: a second set of buckets beside ours'
would not fit in memory), built for each block and dropped after it; LoRA: the run's own LoRA
parameters, the frozen U-Net under them. Inputs have ours' shapes (4x8x8 latents, 77 tokens).

Interleaving: after ``--warmup`` steps of ours, ``--rounds`` rounds of one bare block and one
ours block of ``--block`` timed steps each; the first step of every block is dropped (it meets
memory the other side just released), and under DDP bare's second too (a new wrapper rebuilds its
buckets there). Load from other jobs then falls on
both sides alike. Printed per mode: the median step of each side, their ratio (ours / bare;
1.00 means no overhead), in wall-clock time and in the process's CPU time (all its threads; it
leaves out time spent waiting for a core, so it is steadier on a loaded machine, but also the
waits for the other process under DDP), and every timed step. ``--profile DIR``: cProfile of ours' timed steps
(and of bare's) written there (``.prof`` files, rank 0).

``--sd-scripts PATH [--sd-scripts-python PYTHON]``: sd-scripts' train_network.py on the lora
mode's training (sd15-arch, so not with ``--quick``), run after ours through
benchmarks/sd_scripts_launch.py with benchmarks/ddp_scaling.py's command line plus
``--max_grad_norm 0`` (its venv: docs/PERFORMANCE.md, "sd-scripts side by side"); its median step
and ours / sd-scripts are printed under the table. Not interleaved: it runs in its own venv.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from diffusers import UNet2DConditionModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import ddp_scaling, sd_scripts_launch, step_timer  # noqa: E402
from library import cli  # noqa: E402
from library.accelerator import free_port  # noqa: E402
from library.models import loading  # noqa: E402
from library.run.run_state import HOOKS  # noqa: E402
from tools.make_sample_dataset import make_sample_dataset  # noqa: E402

MODES = {"full1": ("train_dreambooth", 1), "full2": ("train_dreambooth", 2), "lora": ("train_lora", 1)}
QUICK_WIDTHS = [64, 128, 256, 256]


# -- the worker (each process of one mode) -----------------------------------------------------
def _shrink_unet() -> None:
    """--quick: sd15-arch's U-Net at smaller block widths (this worker process only)."""
    real = loading._build_arch

    def build(arch):
        out = real(arch)
        cfg = dict(out["unet"].config, block_out_channels=QUICK_WIDTHS)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(loading.ARCH_SEED)
            out["unet"] = UNet2DConditionModel.from_config(cfg)
        return out

    loading._build_arch = build


def clock() -> tuple[float, float]:
    """(wall clock, this process's CPU time: every thread's, user and system)."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> list[float]:
    now = clock()
    return [now[0] - start[0], now[1] - start[1]]


def total_steps(warmup: int, rounds: int, block: int) -> int:
    return warmup + rounds * (block + 1)


def schedule(warmup: int, rounds: int, block: int) -> dict[int, tuple[str, bool]]:
    """Ours' steps 1..N (``global_step`` after the update) -> (what its time is: "warmup",
    "first" (a block's first step, dropped) or "timed"; whether a bare block runs after it).
    After the warmup: ``rounds`` times a bare block, then ours' block (one dropped step, then
    ``block`` timed ones)."""
    out = {}
    for step in range(1, total_steps(warmup, rounds, block) + 1):
        k = step - warmup  # 1.. within the rounds
        kind = "warmup" if k <= 0 else ("first" if (k - 1) % (block + 1) == 0 else "timed")
        out[step] = (kind, k >= 0 and k % (block + 1) == 0 and k < rounds * (block + 1))
    return out


class Bare:
    """The bare PyTorch step over the run's U-Net and trained parameters."""

    def __init__(self, unet, params, world: int):
        self.unet, self.params, self.world = unet, params, world
        g = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
        self.x = torch.randn(1, unet.config.in_channels, 8, 8, generator=g)
        self.cond = torch.randn(1, 77, unet.config.cross_attention_dim, generator=g)
        self.t = torch.randint(0, 1000, (1,), generator=g)

    def block(self, n: int, profiler=None) -> list[list[float]]:
        """``n`` timed steps ((wall, cpu) each) after the untimed ones: one, and under DDP two
        (DDP rebuilds its buckets in the second iteration of a new wrapper)."""
        skip = 2 if self.world > 1 else 1
        saved = [p.grad for p in self.params]  # ours' gradients (or None), set aside
        for p in self.params:
            p.grad = None
        model = self.unet
        if self.world > 1:
            model = torch.nn.parallel.DistributedDataParallel(self.unet, init_sync=False,
                                                              gradient_as_bucket_view=True)
        opt = torch.optim.SGD(self.params, lr=1e-4)
        times = []
        for i in range(skip + n):
            if profiler is not None and i >= skip:
                profiler.enable()
            start = clock()
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(self.x, self.t, self.cond).sample, self.x)
            loss.backward()
            opt.step()
            times.append(since(start))
            if profiler is not None:
                profiler.disable()
        opt.zero_grad(set_to_none=True)
        del model, opt
        for p, g in zip(self.params, saved):
            p.grad = g
        return times[skip:]


def worker(a) -> dict:
    torch.set_num_threads(1)
    script, _ = MODES[a.mode]
    if a.quick:
        _shrink_unet()
    model = "tiny-sd15" if a.quick and a.mode == "lora" else "sd15-arch"
    steps = total_steps(a.warmup, a.rounds, a.block)
    args = ["--pretrained_model_name_or_path", model, "--train_data_dir", a.data, "--output_dir", a.out,
            "--resolution", "64", "--train_batch_size", "1", "--max_train_steps", steps,
            "--cache_latents", "--cache_text_encoder_outputs", "--optimizer_type", "torch.optim.SGD",
            "--learning_rate", "1e-4", "--max_grad_norm", "0", "--seed", "1",
            "--save_model_as", "safetensors"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        args.append("--ddp_gradient_as_bucket_view")  # as the bare DDP (see the docstring)
    if a.mode == "lora":
        args += ["--network_dim", "16", "--network_alpha", "16", "--network_train_unet_only"]
    rank0 = int(os.environ.get("RANK", "0")) == 0
    prof = {"ours": cProfile.Profile(), "bare": cProfile.Profile()} if a.profile and rank0 else {}
    plan = schedule(a.warmup, a.rounds, a.block)
    ours: list[list[float]] = []   # per block
    bare: list[list[float]] = []
    state = {"last": None, "bare": None, "params": 0}

    def after_step(view, loss, lr):
        now = clock()
        if prof:
            prof["ours"].disable()
        step = view.progress.global_step
        kind, bare_after = plan[step]
        if kind == "first":
            ours.append([])
        elif kind == "timed":
            ours[-1].append([now[0] - state["last"][0], now[1] - state["last"][1]])
        if bare_after:
            if state["bare"] is None:
                params = [p for p in view.parts.params if p.requires_grad]
                state["params"] = sum(p.numel() for p in params)
                state["bare"] = Bare(view.parts.bundle.unet, params, world)
            bare.append(state["bare"].block(a.block, prof.get("bare")))
        state["last"] = clock()
        if prof and plan.get(step + 1, ("", False))[0] == "timed":
            prof["ours"].enable()

    with HOOKS.add(after_step=after_step):
        step_timer.timed_run(script, args)
    if prof:
        os.makedirs(a.profile, exist_ok=True)
        for side, p in prof.items():
            p.dump_stats(os.path.join(a.profile, f"{a.mode}-{side}.prof"))
    label = f"{model} (quick widths)" if a.quick and model == "sd15-arch" else model
    return {"ours": ours, "bare": bare, "params": state["params"], "model": label}


# -- the launcher ------------------------------------------------------------------------------
def launch(a, mode: str, data: str, work: str) -> dict:
    _, procs = MODES[mode]
    result = os.path.join(work, f"{mode}.json")
    out = os.path.join(work, f"out-{mode}")
    wargs = ["--worker", "--mode", mode, "--data", data, "--out", out, "--result", result,
             "--rounds", a.rounds, "--block", a.block, "--warmup", a.warmup]
    if a.quick:
        wargs.append("--quick")
    if a.profile:
        wargs += ["--profile", os.path.abspath(a.profile)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), os.path.abspath(__file__),
           *map(str, wargs)]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=ddp_scaling.worker_env(), capture_output=True, text=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)  # a full save is a 3.4 GB file
    if p.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{p.stderr[-4000:]}")
    with open(result, encoding="utf-8") as f:
        return json.load(f)


def summary(mode: str, r: dict) -> dict:
    """Medians of the timed steps (wall clock and CPU time) of each side, and ours / bare."""
    out = {"mode": mode, "model": r["model"], "trained": r["params"],
           "ours_steps": r["ours"], "bare_steps": r["bare"]}
    for i, clock_name in enumerate(("wall", "cpu")):
        o = step_timer.median([t[i] for b in r["ours"] for t in b])
        b = step_timer.median([t[i] for blk in r["bare"] for t in blk])
        out.update({f"ours_{clock_name}": o, f"bare_{clock_name}": b, f"ratio_{clock_name}": o / b})
    return out


def format_rows(rows: list, a) -> list[str]:
    lines = [f"\nper-step medians, {a.rounds} rounds of {a.block} timed steps per side "
             f"(ours / bare interleaved), 1 thread per process; wall clock, and CPU time of the "
             f"process (less sensitive to other jobs, blind to waits for the other process)",
             f"{'mode':<6} {'model':<26} {'trained':>12} {'ours s':>8} {'bare s':>8} {'ratio':>6} "
             f"{'ours cpu':>9} {'bare cpu':>9} {'ratio':>6}"]
    for r in rows:
        lines.append(f"{r['mode']:<6} {r['model']:<26} {r['trained']:12,d} {r['ours_wall']:8.3f} "
                     f"{r['bare_wall']:8.3f} {r['ratio_wall']:6.3f} {r['ours_cpu']:9.3f} "
                     f"{r['bare_cpu']:9.3f} {r['ratio_cpu']:6.3f}")
    lines.append("(ratio = ours / bare; steps below as wall/cpu seconds, blocks separated by |)")
    for r in rows:
        def fmt(blocks):
            return " | ".join(" ".join(f"{w:.2f}/{c:.2f}" for w, c in b) for b in blocks)
        lines.append(f"{r['mode']}: ours {fmt(r['ours_steps'])}")
        lines.append(f"{r['mode']}: bare {fmt(r['bare_steps'])}")
    return lines


def sd_scripts_lora(a, data: str, work: str) -> list[float]:
    """sd-scripts' train_network.py on the lora mode's training (sd15-arch written as a single
    file, rank 16, U-Net only, SGD at 1e-4, 64 px, cached latents, max_grad_norm 0: ddp_scaling's
    command line), 1 process: its step times after as many warm-up steps as ours had, with the
    same number of timed steps (benchmarks/sd_scripts_launch.py marks them)."""
    python = a.sd_scripts_python or sys.executable
    missing = sd_scripts_launch.missing_modules(python)
    if missing:
        raise RuntimeError(f"missing {', '.join(missing)} in {python}")
    timed = a.rounds * a.block
    same = argparse.Namespace(batch=1, warmup=a.warmup + 1, steps=timed)
    model = sd_scripts_launch.random_weights_file(work, "sd15")
    out = os.path.join(work, "sd-lora")
    args = ddp_scaling.sd_scripts_args("lora", model, sd_scripts_launch.tokenizer_cache(work), data, out,
                                       same) + ["--max_grad_norm", "0"]
    cmd = sd_scripts_launch.command(python, a.sd_scripts, "train_network.py", args, 1, free_port())
    r = sd_scripts_launch.run(cmd, cwd=a.sd_scripts,
                              env=sd_scripts_launch.clean_env({"OMP_NUM_THREADS": "1"}))
    return r["times"][a.warmup:]  # its list starts at step 2


def sd_scripts_rows(a, data: str, work: str, lora: dict) -> list[str]:
    try:
        times = sd_scripts_lora(a, data, work)
    except (RuntimeError, sd_scripts_launch.SdScriptsError) as e:
        return [f"lora: sd-scripts train_network.py not run: {e}"]
    m = step_timer.median(times)
    return [f"lora: sd-scripts train_network.py {m:.3f} s/step (wall, median of {len(times)}; "
            f"run after ours, not interleaved: its own venv); ours / sd-scripts "
            f"{lora['ours_wall'] / m:.3f}", "lora: sd-scripts " + " ".join(f"{t:.2f}" for t in times)]


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller U-Net (iterating), tiny-sd15 LoRA")
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    p.add_argument("--rounds", type=int, default=3, help="bare/ours block pairs")
    p.add_argument("--block", type=int, default=2, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=2, help="ours' steps before the first block")
    p.add_argument("--profile", metavar="DIR", help="cProfile of the timed steps (rank 0) into DIR")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--sd-scripts", metavar="PATH",
                   help="a kohya-ss/sd-scripts checkout: its train_network.py beside the lora mode")
    p.add_argument("--sd-scripts-python", metavar="PYTHON",
                   help="the Python that runs sd-scripts (its own venv; default: this one)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a launched process
    for internal in ("--mode", "--data", "--out", "--result"):
        p.add_argument(internal, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.worker:
        result = worker(a)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(a.result, "w", encoding="utf-8") as f:
                json.dump(result, f)
        return 0
    try:
        sd_scripts_launch.check_paths(a.sd_scripts, a.sd_scripts_python, "train_network.py")
        if a.sd_scripts and (a.quick or "lora" not in a.modes):
            raise sd_scripts_launch.SdScriptsError(
                "--sd-scripts compares the lora mode on sd15-arch: not with --quick (sd-scripts "
                "cannot load the tiny models), and the lora mode must be among --modes")
    except sd_scripts_launch.SdScriptsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="sdtk-overhead-")
    try:
        n = 2 * (a.warmup + a.rounds * (a.block + 1))
        data = os.path.dirname(make_sample_dataset(os.path.join(work, "data"), n_images=n, size=64,
                                                   repeats=1))
        rows = []
        for mode in a.modes:
            t0 = time.perf_counter()
            rows.append(summary(mode, launch(a, mode, data, work)))
            r = rows[-1]
            print(f"  {mode}: ours {r['ours_wall']:.3f} s, bare {r['bare_wall']:.3f} s, ratio "
                  f"{r['ratio_wall']:.3f}; CPU time ratio {r['ratio_cpu']:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        lines = format_rows(rows, a)
        if a.sd_scripts:
            lines += sd_scripts_rows(a, data, work, next(r for r in rows if r["mode"] == "lora"))
        print("\n".join(lines))
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump(rows, f, indent=1)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
