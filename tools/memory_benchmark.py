"""Peak memory of real training runs against batch size, per optimizer / memory setting.

    python tools/memory_benchmark.py --model sd15-arch --method finetune --resolution 256 \\
        --batch_sizes 1,2,4 --variants adamw,adamw8bit,adafactor,fused,groups4 --steps 2 \\
        --out bench/sd15

Every (variant, batch size) runs the real entry script (``train_dreambooth.py`` for
``--method finetune``: the full U-Net; ``train_lora.py`` for ``--method lora``, U-Net only) in a
fresh Python process for ``--steps`` optimizer steps, with latents and text-encoder outputs
cached, on a generated dataset of ``max(batch_sizes)`` images at ``--resolution``. That process
reports its own peak memory:

- CUDA: ``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()``;
- always: the peak resident set size of the process (``ru_maxrss``), which on a CPU-only machine
  is the memory that decides what fits.

Peaks are taken per phase: "load" (loading, setup and caching), "train" (the training loop:
the high-water mark is reset at its start, through ``/proc/self/clear_refs`` on Linux and
``torch.cuda.reset_peak_memory_stats``) and "save" (the final save). The fitted lines and the
plot use the training loop's peak. ``--out`` receives ``results.csv``, ``results.md``
(the table, the fitted line memory = a x batch + b per variant, the command) and ``plot.png``
(needs matplotlib: ``pip install -e .[plots]``; without it the plot is skipped with a note).

Variants are names joined by ``+``: an optimizer (``adamw``, ``adamw8bit``, ``adafactor``,
``lion``, ``sgd``; ``adafactor`` steps by the learning rate, ``relative_step=False
scale_parameter=False warmup_init=False``, the setting the README's numbers were measured with;
its default relative step keeps the same state) and modifiers: ``fused``
(``fused_backward_pass``; alone it means fused Adafactor, as in sd-scripts), ``groupsN`` (``fused_optimizer_groups N``; alone: Adafactor),
``bf16`` (``mixed_precision bf16``), ``fullbf16`` (bf16 weights: ``mixed_precision bf16
full_bf16``), ``gc`` (gradient checkpointing), ``fp8`` / ``fp8unet`` (``--method lora``: the
frozen U-Net and text encoders / the U-Net only in float8: ``mixed_precision bf16 fp8_base`` /
``fp8_base_unet``), ``zero1`` / ``zero2`` (DeepSpeed ZeRO stage 1 /
2, one process). E.g. ``adamw+fullbf16+gc``.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make the repository root importable
    sys.path.insert(0, ROOT)

from tools.make_sample_dataset import make_sample_dataset  # noqa: E402


ADAFACTOR_ARGS = ["relative_step=False", "scale_parameter=False", "warmup_init=False"]
OPTIMIZERS = {
    "adamw": ["--optimizer_type", "AdamW"],
    "adamw8bit": ["--optimizer_type", "AdamW8bit"],
    "adafactor": ["--optimizer_type", "Adafactor", "--optimizer_args", *ADAFACTOR_ARGS],
    "lion": ["--optimizer_type", "Lion"],
    "sgd": ["--optimizer_type", "SGDNesterov"],
}
MODIFIERS = {
    "fused": ["--fused_backward_pass"],
    "bf16": ["--mixed_precision", "bf16"],
    "fullbf16": ["--mixed_precision", "bf16", "--full_bf16"],
    "gc": ["--gradient_checkpointing"],
    "fp8": ["--mixed_precision", "bf16", "--fp8_base"],
    "fp8unet": ["--mixed_precision", "bf16", "--fp8_base_unet"],
    "zero1": ["--deepspeed", "--zero_stage", "1"],
    "zero2": ["--deepspeed", "--zero_stage", "2"],
}


class BenchmarkError(ValueError):
    pass


def variant_flags(variant: str) -> list[str]:
    """The entry-script flags of a variant name (see the module docstring)."""
    parts = [p.strip().lower() for p in variant.split("+") if p.strip()]
    if not parts:
        raise BenchmarkError(f"variant {variant!r}: empty")
    optimizer, flags = None, []
    for part in parts:
        m = re.fullmatch(r"groups(\d+)", part)
        if part in OPTIMIZERS:
            if optimizer is not None:
                raise BenchmarkError(f"variant {variant!r}: two optimizers")
            optimizer = part
        elif m:
            flags += ["--fused_optimizer_groups", m.group(1)]
        elif part in MODIFIERS:
            flags += MODIFIERS[part]
        else:
            known = sorted(OPTIMIZERS) + sorted(MODIFIERS) + ["groupsN"]
            raise BenchmarkError(f"variant {variant!r}: unknown part {part!r} (known: "
                                 f"{', '.join(known)})")
    if optimizer is None:
        # fused / groups alone: Adafactor (sd-scripts' fused optimizer); otherwise AdamW
        optimizer = "adafactor" if any(f in flags for f in ("--fused_backward_pass",
                                                            "--fused_optimizer_groups")) else "adamw"
    return OPTIMIZERS[optimizer] + flags


def fit_line(xs, ys):
    """Least-squares (a, b) of y = a*x + b; (None, y) for a single point."""
    pts = [(float(x), float(y)) for x, y in zip(xs, ys) if y is not None]
    if not pts:
        return None, None
    if len({x for x, _ in pts}) < 2:
        return None, sum(y for _, y in pts) / len(pts)
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    a = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return a, my - a * mx


# The child: runs the entry script in this fresh process and reports its peaks to a JSON file.
CHILD = r"""
import json, os, resource, runpy, sys, time
report_path, script = sys.argv[1], sys.argv[2]
sys.argv = [script] + sys.argv[3:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))

def peaks():
    out = {"rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    out["rss_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    if "torch" in sys.modules:
        import torch
        if torch.cuda.is_available():
            out["cuda_allocated_bytes"] = torch.cuda.max_memory_allocated()
            out["cuda_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return out

def reset():
    # a new high-water mark per phase: Linux resets VmHWM on "5" > /proc/self/clear_refs
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        report["phases"] = True
    except OSError:
        report["phases"] = False
    if "torch" in sys.modules:
        import torch
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

report = {"rc": None}
from library.run import stages
real_train = stages.Run.train
def train(self):
    report["load"] = peaks()  # loading, setup and caching
    reset()
    t0 = time.time()
    real_train(self)
    report["train_seconds"] = time.time() - t0
    report["steps"] = self.progress.global_step
    report["train"] = peaks()  # the training loop
    reset()
stages.Run.train = train
try:
    runpy.run_path(script, run_name="__main__")
    report["rc"] = 0
except SystemExit as e:
    report["rc"] = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
finally:
    report["save"] = peaks()  # the final save and exit
    with open(report_path, "w") as f:
        json.dump(report, f)
"""


def run_config(args, variant: str, batch: int, data_dir: str, work: str) -> dict:
    script = os.path.join(ROOT, "train_dreambooth.py" if args.method == "finetune"
                          else "train_lora.py")
    out_dir = os.path.join(work, f"{re.sub(r'[^a-z0-9]+', '_', variant.lower())}-b{batch}")
    flags = ["--pretrained_model_name_or_path", args.model, "--train_data_dir", data_dir,
             "--output_dir", out_dir, "--resolution", str(args.resolution),
             "--train_batch_size", str(batch), "--max_train_steps", str(args.steps),
             "--learning_rate", str(args.learning_rate), "--max_grad_norm", "0",
             "--cache_latents", "--cache_text_encoder_outputs"]
    if args.method == "lora":
        flags += ["--network_dim", str(args.network_dim), "--network_alpha",
                  str(args.network_dim), "--network_train_unet_only"]
    flags += variant_flags(variant)
    report_path = os.path.join(work, f"report-{os.path.basename(out_dir)}.json")
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [sys.executable, "-c", CHILD, report_path, script, *flags]
    t0 = time.time()
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=args.timeout)
        rc, tail = res.returncode, (res.stderr or "").strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", [f"killed after {args.timeout} s"]
    wall = time.time() - t0
    report = {}
    if os.path.isfile(report_path):
        with open(report_path) as f:
            report = json.load(f)
        os.remove(report_path)
    shutil.rmtree(out_dir, ignore_errors=True)  # full models are large; only the numbers matter
    ok = rc == 0 and report.get("rc") == 0 and "train" in report
    gib = 1024 ** 3

    def g(section, key):
        v = report.get(section, {}).get(key)
        return round(v / gib, 3) if v is not None else None

    row = {"variant": variant, "batch": batch, "status": "ok" if ok else f"failed ({rc})",
           "load_rss_gib": g("load", "rss_bytes"), "train_rss_gib": g("train", "rss_bytes"),
           "save_rss_gib": g("save", "rss_bytes"),
           "cuda_allocated_gib": g("train", "cuda_allocated_bytes"),
           "cuda_reserved_gib": g("train", "cuda_reserved_bytes"),
           "phases_separate": report.get("phases", False),
           "train_seconds": round(report["train_seconds"], 1) if "train_seconds" in report else None,
           "wall_seconds": round(wall, 1), "flags": " ".join(variant_flags(variant))}
    if not ok:
        row["error"] = " | ".join(tail)
    return row


COLUMNS = ["variant", "batch", "status", "load_rss_gib", "train_rss_gib", "save_rss_gib",
           "cuda_allocated_gib", "cuda_reserved_gib", "phases_separate", "train_seconds",
           "wall_seconds", "flags"]


def primary_key(rows) -> str:
    """The memory the fitted lines and the plot use: CUDA peak allocated, else the peak RSS."""
    return "cuda_allocated_gib" if any(r.get("cuda_allocated_gib") is not None for r in rows) \
        else "train_rss_gib"


def fits(rows, variants) -> dict:
    key = primary_key(rows)
    out = {}
    for v in variants:
        pts = [(r["batch"], r[key]) for r in rows if r["variant"] == v and r["status"] == "ok"]
        out[v] = fit_line([b for b, _ in pts], [m for _, m in pts])
    return out


def machine() -> str:
    # lazy: --help loads this module before torch; torch is imported when machine() runs
    import torch

    if torch.cuda.is_available():
        return f"CUDA {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        mem = f", {kb / 1024 ** 2:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (f"CPU only ({os.cpu_count()} cores{mem}), {platform.machine()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def write_outputs(args, rows, variants, command: str) -> list[str]:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS + ["error"], extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    key = primary_key(rows)
    lines_fit = fits(rows, variants)
    notes = []
    md = [f"# Memory benchmark: {args.model}, {args.method}"
          + (f" (LoRA dim {args.network_dim})" if args.method == "lora" else " (full U-Net)"),
          "", f"`{command}`", "",
          f"{machine()}; {args.resolution} px, {args.steps} step(s) per run, latents and "
          "text-encoder outputs cached, max_grad_norm 0. Peak resident set (RSS) of the training "
          "process in each phase: load (loading, setup, caching), train (the training loop), "
          "save (the final save); each phase's peak is measured from its start"
          + ("" if all(r.get("phases_separate") for r in rows if r["status"] == "ok") else
             " where the OS allows it (else it includes the earlier phases)")
          + ". CUDA: peak allocated / reserved in the training loop. GiB = 2^30 bytes.", "",
          "| variant | batch | status | load peak RSS | train peak RSS | save peak RSS | "
          "CUDA allocated | CUDA reserved | train s |", "|---|---|---|---|---|---|---|---|---|"]

    def fmt(v):
        return "" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    for r in rows:
        md.append(f"| {r['variant']} | {r['batch']} | {r['status']} | {fmt(r['load_rss_gib'])} | "
                  f"{fmt(r['train_rss_gib'])} | {fmt(r['save_rss_gib'])} | "
                  f"{fmt(r['cuda_allocated_gib'])} | {fmt(r['cuda_reserved_gib'])} | "
                  f"{fmt(r['train_seconds'])} |")
    md += ["", f"Fitted {key.replace('_gib', '')} (GiB) = a x batch + b:", "",
           "| variant | a (GiB per sample) | b (GiB) |", "|---|---|---|"]
    for v in variants:
        a, b = lines_fit[v]
        md.append(f"| {v} | {fmt(a) if a is not None else 'n/a (one batch size)'} | {fmt(b)} |")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        md += ["", "Failed runs:"] + [f"- {r['variant']} batch {r['batch']}: {r.get('error', '')}"
                                       for r in failed]
    try:
        # lazy: optional dependency (matplotlib: pip install -e ".[plots]"), imported when used
        import matplotlib

        matplotlib.use("Agg")
        # lazy: optional dependency (matplotlib: pip install -e ".[plots]"), imported when used
        import matplotlib.pyplot as plt
    except ImportError:
        notes.append("plot.png skipped: matplotlib is not installed (pip install -e .[plots])")
    else:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for v in variants:
            pts = [(r["batch"], r[key]) for r in rows if r["variant"] == v and r["status"] == "ok"]
            if pts:
                ax.plot([b for b, _ in pts], [m for _, m in pts], marker="o", label=v)
        ax.set_xticks(sorted({r["batch"] for r in rows}))
        ax.set_xlabel("batch size")
        ax.set_ylabel(("CUDA peak allocated" if key.startswith("cuda") else "peak RSS") + " (GiB)")
        ax.set_title(f"{args.model} {args.method}, {args.resolution} px")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "plot.png"), dpi=100)
        plt.close(fig)
    md += [""] + notes
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return notes


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default="sd15-arch", help="any pretrained_model_name_or_path "
                    "(default sd15-arch: SD1.5's architecture with random weights)")
    ap.add_argument("--method", choices=("finetune", "lora"), default="finetune")
    ap.add_argument("--network_dim", type=int, default=16, help="LoRA rank (--method lora)")
    ap.add_argument("--batch_sizes", default="1,2,4")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--variants", default="adamw,adamw8bit,adafactor,fused,groups4")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    ap.add_argument("--learning_rate", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each run")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--out", required=True, help="folder for results.csv, results.md, plot.png")
    args = ap.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--batch_sizes: comma-separated integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        ap.error("--batch_sizes: at least one, each >= 1")
    if args.resolution % 8:
        ap.error("--resolution: a multiple of 8")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        try:
            flags = variant_flags(v)
        except BenchmarkError as e:
            ap.error(str(e))
        if args.method == "finetune" and {"--fp8_base", "--fp8_base_unet"} & set(flags):
            ap.error(f"variant {v!r}: fp8 base weights are a LoRA setting: use --method lora")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    sys.path.insert(0, ROOT)

    work = os.path.join(args.out, "work")
    data = os.path.join(work, "data")
    shutil.rmtree(work, ignore_errors=True)
    make_sample_dataset(data, n_images=max(args.batch_sizes), size=args.resolution, repeats=1)
    command = "python tools/memory_benchmark.py " + " ".join(argv)
    rows = []
    for v in args.variants:
        for b in args.batch_sizes:
            row = run_config(args, v, b, data, work)
            rows.append(row)
            key = primary_key([row])
            print(f"{v:>20} batch {b}: {row['status']}, peak {row[key]} GiB "
                  f"({key.replace('_gib', '')}); RSS load {row['load_rss_gib']}, train "
                  f"{row['train_rss_gib']}, save {row['save_rss_gib']} GiB; "
                  f"{row['wall_seconds']} s", flush=True)
            if row["status"] != "ok":
                print(f"{'':>20} {row.get('error', '')}", flush=True)
    notes = write_outputs(args, rows, args.variants, command)
    shutil.rmtree(work, ignore_errors=True)
    for v, (a, b) in fits(rows, args.variants).items():
        line = f"{a:.3f} x batch + {b:.3f}" if a is not None else \
            (f"{b:.3f} (one batch size)" if b is not None else "no successful run")
        print(f"fit {v}: {line} GiB", flush=True)
    for n in notes:
        print("note: " + n, flush=True)
    print(f"wrote {os.path.join(args.out, 'results.csv')} and results.md"
          + ("" if notes else " and plot.png"), flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
