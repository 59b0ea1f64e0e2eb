"""One-command GPU benchmark: speed, memory and FLOP utilisation of the main training setups.

    python benchmarks/gpu.py [--steps 12] [--warmup 4] [--no-compile] [--only sdxl-lora-b1 ...]
                             [--sd-scripts PATH [--sd-scripts-python PYTHON]] [--peak-tflops N]
    python benchmarks/gpu.py --dry-run       # the same code path on the CPU: tiny models, 1 step

Cases, on the real-size random-weight architectures (sd15-arch, sdxl-arch; nothing downloaded),
bf16 (mixed_precision bf16 and full_bf16), SDPA attention, cached latents and text-encoder
outputs, each eager and with ``torch_compile`` (inductor):
  sd15-lora-b1 / -b4   train_lora, SD1.5 at 512 px, rank 16, batch 1 / 4, AdamW
  sdxl-lora-b1 / -b4   train_lora, SDXL at 1024 px, rank 16, batch 1 / 4, AdamW
  sdxl-full-b1         train_dreambooth, the whole SDXL U-Net at 1024 px, batch 1,
                       Adafactor with fused_backward_pass (the memory-lean full fine-tune)
  flux-lora-b1         train_lora, FLUX.1 dev at 1024 px, batch 1, rank 16 (networks.lora_flux),
                       fp8_base (the frozen transformer in float8), AdamW; sd-scripts' published
                       FLUX LoRA setting (12-16 GB there)
  flux-full-swap-b1    train_dreambooth, the whole FLUX.1 dev transformer at 1024 px, batch 1,
                       full_bf16, Adafactor with fused_backward_pass, blocks_to_swap 8 (sd-scripts'
                       full fine-tune in 24 GB)
  anima-lora-b1        train_lora, Anima (DiT 2B with its LLM adapter, Qwen3-0.6B, Qwen-Image VAE) at
                       1024 px, batch 1, rank 16 (networks.lora_anima), AdamW
  lumina-lora-b1       train_lora, Lumina Image 2.0 (Next-DiT 2B, Gemma-2 2B, FLUX.1's autoencoder) at
                       1024 px, batch 1, rank 16 (networks.lora_lumina), AdamW
  sd15-gen-512 / sdxl-gen-1024   gen_img's renderer, SD1.5 at 512 px / SDXL at 1024 px, bf16, 30
                       steps, batch 1: images/s and peak memory next to diffusers' own pipeline on
                       the same components (benchmarks/gen_img_rate.py ``gpu_row``)
The FLUX.1 cases run on random full-size weight files written once into the working folder
(benchmarks/flux_weights.py, about 34 GB, bf16), text-encoder outputs cached as the SD cases; the
Anima and Lumina 2 cases likewise (benchmarks/dit_weights.py, about 5.7 and 10.6 GB).
For each: it/s over the steps after ``--warmup`` (the first steps compile and allocate), peak
allocated and reserved CUDA memory, and the fraction of the GPU's peak bf16 FLOP/s reached: one
training step's forward and backward FLOPs counted by ``torch.utils.flop_counter`` (on the eager
run; compiled runs do the same math) x it/s / the peak (a table of known GPUs below, or
``--peak-tflops``). With ``--sd-scripts PATH`` every case with an sd-scripts counterpart also
runs through it (SD1.5 / SDXL LoRA: train_network.py / sdxl_train_network.py; sdxl-full-b1:
sdxl_train.py; flux-lora-b1: flux_train_network.py with networks.lora_flux; flux-full-swap-b1:
flux_train.py; anima-lora-b1 / lumina-lora-b1: anima_train_network.py / lumina_train_network.py with
networks.lora_anima / networks.lora_lumina, the flow-matching settings stated on both sides), by
``--sd-scripts-python`` (its own venv; default: this Python) through
benchmarks/sd_scripts_launch.py, with the same training options (training_options: one list for
both sides), on the same random weights (SD: written once as single files; FLUX.1, Anima, Lumina 2:
the files above, in the layouts sd-scripts' loaders read: gpu.sd_scripts_files) and our tokenizers
(the shipped CLIP one, the tiny T5 and Gemma ones) under ``--tokenizer_cache_dir`` and, for flux_train.py, which loads its tokenizers from
the hub, a hub cache (HF_HUB_CACHE): it/s over the same steps after ``--warmup`` from the
launcher's time stamps after each optimizer step (CUDA synchronised; fused steps at the
scheduler's step), as ours, and its peak allocated / reserved CUDA memory over the whole run.
What differs: SD1 sd-scripts cannot cache text-encoder outputs (it encodes the captions every
step, frozen); SDXL, FLUX.1, Anima and Lumina 2 cache them as ours. benchmarks/sd_scripts_flux_check.py
checks sd-scripts' FLUX.1 side on the CPU (headers, loaders, options);
benchmarks/sd_scripts_dit_rows_check.py runs sd-scripts' Anima and Lumina 2 rows on the CPU (tiny
files of the same writer, 2 steps).

Sized to finish within 8 minutes on one H200 (the default steps, without ``--sd-scripts``); a
bigger ``--steps`` gives steadier numbers. Disk: the FLUX.1 files take 34 GB, and each run's
output folder (the full fine-tune saves a 24 GB transformer) is deleted once its row is taken. Prints one table; ``--json FILE`` also writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import dit_weights, flux_weights, gen_img_rate, sd_scripts_launch, step_timer  # noqa: E402
from library.models.families.lumina import text  # noqa: E402
from tools.make_sample_dataset import make_sample_dataset  # noqa: E402

# Dense bf16 tensor-core peak FLOP/s (vendor data sheets), by a substring of the device name.
PEAK_BF16_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("GH200", 989.4),
                    ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.1), ("L40", 181.0),
                    ("RTX 6000 Ada", 364.2), ("RTX 4090", 165.2), ("RTX 3090", 71.0), ("A10", 125.0),
                    ("L4", 121.0))

CASES = {
    "sd15-lora-b1": ("train_lora", "sd15", 512, 1),
    "sd15-lora-b4": ("train_lora", "sd15", 512, 4),
    "sdxl-lora-b1": ("train_lora", "sdxl", 1024, 1),
    "sdxl-lora-b4": ("train_lora", "sdxl", 1024, 4),
    "sdxl-full-b1": ("train_dreambooth", "sdxl", 1024, 1),
    "flux-lora-b1": ("train_lora", "flux", 1024, 1),
    "flux-full-swap-b1": ("train_dreambooth", "flux", 1024, 1),
    "anima-lora-b1": ("train_lora", "anima", 1024, 1),
    "lumina-lora-b1": ("train_lora", "lumina", 1024, 1),
}
# the families whose random full-size files benchmarks/dit_weights.py writes
DIT_ARCHS = tuple(dit_weights.NAMES)
FLUX_BLOCKS_TO_SWAP = 8
GEMMA_TOKENIZER_ID = "google/gemma-2-2b"  # the tokenizer sd-scripts' Lumina 2 strategy loads
# FLUX.1's flow-matching settings, stated on both sides (sd-scripts' defaults, which are ours too):
# a changed default on either side cannot make the two rows train differently.
FLUX_FLOW = ["--timestep_sampling", "sigma", "--model_prediction_type", "sigma_scaled", "--guidance_scale", 3.5,
             "--discrete_flow_shift", 3.0, "--weighting_scheme", "uniform", "--t5xxl_max_token_length", 512]
# Anima's and Lumina 2's, likewise (the defaults of sd-scripts' anima_train_utils / lumina_train_util)
DIT_FLOW = {"anima": ["--timestep_sampling", "sigmoid", "--sigmoid_scale", 1.0, "--discrete_flow_shift", 1.0],
            "lumina": ["--timestep_sampling", "shift", "--discrete_flow_shift", 6.0, "--model_prediction_type", "raw"]}
# sd-scripts' script for each (our script, architecture) it has a row for.
SD_SCRIPTS_ENTRY = {("train_lora", "sd15"): "train_network.py", ("train_lora", "sdxl"): "sdxl_train_network.py",
                    ("train_dreambooth", "sdxl"): "sdxl_train.py", ("train_lora", "flux"): "flux_train_network.py",
                    ("train_dreambooth", "flux"): "flux_train.py", ("train_lora", "anima"): "anima_train_network.py",
                    ("train_lora", "lumina"): "lumina_train_network.py"}


def training_options(name: str, dry: bool) -> list:
    """The training options of a case, in sd-scripts' names and meanings: the same list for our
    run (case_args) and sd-scripts' (sd_scripts_args)."""
    script, arch, size, batch = CASES[name]
    flux, lora = arch == "flux", script == "train_lora"
    args = ["--resolution", 64 if dry else size, "--train_batch_size", batch, "--cache_latents",
            "--cache_text_encoder_outputs", "--sdpa", "--seed", 1]
    if not dry:  # the CPU has no bf16 autocast worth timing; the dry run checks the code path
        args += ["--mixed_precision", "bf16", "--full_bf16"]
        if flux and lora:
            args.append("--fp8_base")
    if flux:
        args += FLUX_FLOW
    if flux and not lora:  # tiny-flux (2 double, 2 single blocks) swaps at most 2
        args += ["--blocks_to_swap", 2 if dry else FLUX_BLOCKS_TO_SWAP]
    if lora and arch in DIT_ARCHS:  # the family's own LoRA module (sd-scripts' networks.lora_anima / _lumina)
        return args + DIT_FLOW[arch] + ["--network_module", f"networks.lora_{arch}", "--network_dim", 16, "--network_alpha", 16,
                       "--network_train_unet_only", "--optimizer_type", "AdamW", "--learning_rate", "1e-4"]
    if lora:
        return args + ["--network_module", "networks.lora_flux" if flux else "networks.lora",
                       "--network_dim", 16, "--network_alpha", 16, "--network_train_unet_only",
                       "--optimizer_type", "AdamW", "--learning_rate", "1e-4"]
    return args + ["--optimizer_type", "Adafactor", "--optimizer_args", "scale_parameter=False",
                   "relative_step=False", "warmup_init=False", "--fused_backward_pass", "--learning_rate", "1e-6"]


def case_args(name: str, data: str, out: str, steps: int, dry: bool, work: str = "") -> tuple[str, list]:
    """Our entry script and its options; FLUX.1 cases read their files from ``work``
    (benchmarks/flux_weights.py)."""
    script, arch, size, batch = CASES[name]
    flux = arch == "flux"
    if dry:
        model = f"tiny-{arch}"
    elif arch in DIT_ARCHS:
        model = dit_weights.paths(work, arch)["pretrained_model_name_or_path"]
    else:
        model = flux_weights.paths(work)["model"] if flux else f"{arch}-arch"
    args = ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", out,
            "--max_train_steps", steps, *training_options(name, dry), "--save_model_as", "safetensors"]
    if arch in DIT_ARCHS and not dry:  # the parts beside the DiT: qwen3 / vae / t5_tokenizer_path, gemma2 / ae
        args += [a for option, path in dit_weights.paths(work, arch).items()
                 if option != "pretrained_model_name_or_path" for a in (f"--{option}", path)]
    if flux and not dry:
        files = flux_weights.paths(work)
        args += ["--clip_l", files["clip_l"], "--t5xxl", files["t5xxl"], "--ae", files["ae"]]
    return script, args


def step_flops(run, batch: int) -> float:
    """FLOPs of one micro-step's forward and backward (the U-Net, the loss), counted by torch;
    the gradients are taken with autograd.grad, so no optimizer hook steps."""
    params = [p for p in run.parts.params if p.requires_grad]
    idx = list(range(min(batch, len(run.tset.samples))))
    with FlopCounterMode(display=False) as counter:
        loss = run.micro_step_loss(1, idx, None, len(idx))
        torch.autograd.grad(loss, params, allow_unused=True)
    return float(counter.get_total_flops())


def peak_flops(device_name: str, override: float | None) -> float | None:
    if override:
        return override * 1e12
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops * 1e12
    return None


def run_case(name, compiled, data, work, steps, warmup, dry, cuda):
    out = os.path.join(work, f"{name}-{'c' if compiled else 'e'}")
    script, args = case_args(name, data, out, steps, dry, work)
    if compiled:  # the dry run traces with dynamo only: inductor's CPU compile takes minutes
        args += ["--torch_compile", "--dynamo_backend", "eager" if dry else "inductor"]
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    try:
        times, run = step_timer.timed_run(script, args, sync=sync)
    finally:  # the saved model is not needed (FLUX.1's full one: 24 GB of the disk)
        shutil.rmtree(out, ignore_errors=True)
    timed = times[warmup:] if len(times) > warmup else times[-1:]
    row = {"case": name, "compile": compiled, "steps": len(timed),
           "it_s": len(timed) / sum(timed), "first_step_s": times[0],
           "wall_s": time.perf_counter() - t0}
    if cuda:
        row["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    if not compiled:
        row["flops"] = step_flops(run, CASES[name][3])
    del run
    return row


def sd_scripts_files(work: str, arch: str) -> dict:
    """dit_weights' files of ``arch`` as sd-scripts' options take them: ``model`` (the DiT; Anima's
    carries its LLM adapter, so no --llm_adapter_path), Anima's ``qwen3`` folder, ``vae`` (sd-scripts
    reads one file: the diffusers folder's weights, whose names its Qwen-Image VAE shares) and
    ``t5_tokenizer_path``; Lumina 2's ``gemma2`` and ``ae`` files (the Gemma tokenizer comes from
    --tokenizer_cache_dir, sd_scripts_tokenizers)."""
    files = dit_weights.paths(work, arch)
    files["model"] = files.pop("pretrained_model_name_or_path")
    if arch == "anima":
        files["vae"] = os.path.join(files["vae"], "diffusion_pytorch_model.safetensors")
    return files


def sd_scripts_tokenizers(work: str) -> str:
    """sd_scripts_launch.tokenizer_cache plus the tiny Gemma tokenizer under Gemma-2 2B's id in the
    hub cache layout: lumina_train_network.py asks the hub for it with --tokenizer_cache_dir as
    ``cache_dir``."""
    cache = sd_scripts_launch.tokenizer_cache(work)
    if not os.path.isdir(os.path.join(cache, "models--" + GEMMA_TOKENIZER_ID.replace("/", "--"))):
        gemma = os.path.join(work, "sd-scripts-gemma-tokenizer")
        sd_scripts_launch.write_tokenizer(text.build_tiny_tokenizer(), gemma, {
            "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
            "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "padding_side": "right"})
        sd_scripts_launch.hub_entry(cache, GEMMA_TOKENIZER_ID, gemma)
    return cache


def sd_scripts_args(name: str, files: dict, tokenizers: str, data: str, out: str, steps: int,
                    options: list | None = None) -> tuple[str, list]:
    """sd-scripts' entry script and options for a case, the same run as case_args': ``files`` the
    model file (``model``) and, for FLUX.1, ``clip_l``, ``t5xxl`` and ``ae`` (flux_weights.paths), for
    Anima and Lumina 2 sd_scripts_files'; ``options`` replaces training_options (the CPU check's)."""
    script, arch, size, batch = CASES[name]
    opts = list(options if options is not None else training_options(name, dry=False))
    if arch == "sd15":  # SD1's train_network.py has no text-encoder output cache (it rejects the option)
        opts.remove("--cache_text_encoder_outputs")
    args = ["--pretrained_model_name_or_path", files["model"], "--tokenizer_cache_dir", tokenizers,
            "--train_data_dir", data, "--output_dir", out, "--max_train_steps", steps, *opts,
            "--max_data_loader_n_workers", 0]
    if arch == "flux":
        args += ["--clip_l", files["clip_l"], "--t5xxl", files["t5xxl"], "--ae", files["ae"]]
    if arch in DIT_ARCHS:
        args += [a for option, path in files.items() if option != "model" for a in (f"--{option}", path)]
    return SD_SCRIPTS_ENTRY[(script, arch)], args


def sd_scripts_case(name, sd_scripts, python, data, work, steps, warmup) -> dict:
    """One case through sd-scripts on the same random weights (SD: a single file written once per
    architecture; FLUX.1: flux_weights' four files): it/s over the steps after ``warmup`` and peak
    CUDA memory (benchmarks/sd_scripts_launch.py)."""
    script, arch, size, batch = CASES[name]
    if (script, arch) not in SD_SCRIPTS_ENTRY:
        return {"case": name, "sd_scripts": "not run (no sd-scripts counterpart wired)"}
    if arch == "flux":  # flux_train.py loads its tokenizers from the hub cache, not --tokenizer_cache_dir
        files, env = flux_weights.paths(work), {"HF_HUB_CACHE": sd_scripts_launch.hub_cache(work)}
    elif arch in DIT_ARCHS:
        files, env = sd_scripts_files(work, arch), {}
    else:
        files, env = {"model": sd_scripts_launch.random_weights_file(work, arch)}, {}
    out = os.path.join(work, f"sd-{name}")
    entry, args = sd_scripts_args(name, files, sd_scripts_tokenizers(work), data, out, steps)
    try:
        r = sd_scripts_launch.run(sd_scripts_launch.command(python, sd_scripts, entry, args, None), cwd=sd_scripts,
                                  env=sd_scripts_launch.clean_env(env))
    except RuntimeError as e:
        return {"case": name, "sd_scripts": f"failed: {e}"}
    finally:
        shutil.rmtree(out, ignore_errors=True)  # flux_train.py saves the 24 GB transformer at the end
    timed = r["times"][max(warmup - 1, 0):] or r["times"][-1:]  # r["times"] starts at step 2
    row = {"case": name, "sd_scripts_it_s": len(timed) / sum(timed), "sd_scripts_params": r["params"]}
    if r["peak"]:
        row["sd_scripts_peak_alloc_gib"], row["sd_scripts_peak_reserved_gib"] = (b / 2**30 for b in r["peak"])
    return row


def format_table(rows: list, peak: float | None) -> list[str]:
    flops = {r["case"]: r["flops"] for r in rows if "flops" in r}
    lines = [f"{'case':<17} {'compile':<7} {'it/s':>7} {'1st step s':>10} {'alloc GiB':>9} "
             f"{'resv GiB':>8} {'GFLOP/step':>10} {'% peak':>7}"]
    for r in rows:
        if "it_s" not in r:
            continue
        f = flops.get(r["case"])
        util = f"{100 * f * r['it_s'] / peak:6.1f}%" if (peak and f) else "    n/a"
        alloc = f"{r['peak_alloc_gib']:9.2f}" if "peak_alloc_gib" in r else "      n/a"
        resv = f"{r['peak_reserved_gib']:8.2f}" if "peak_reserved_gib" in r else "     n/a"
        tf = f"{f / 1e9:10.1f}" if f else "       n/a"
        lines.append(f"{r['case']:<17} {'yes' if r['compile'] else 'no':<7} {r['it_s']:7.2f} "
                     f"{r['first_step_s']:10.1f} {alloc} {resv} {tf} {util}")
    gib = lambda v: "n/a" if v is None else f"{v:.2f} GiB"  # noqa: E731
    for r in rows:
        if "images_s" in r:
            lines.append(f"{r['case']:<17} gen_img {r['images_s']:.3f} images/s, peak {gib(r['peak_alloc_gib'])}; "
                         f"diffusers' pipeline {r['diffusers_images_s']:.3f} images/s, peak "
                         f"{gib(r['diffusers_peak_alloc_gib'])} ({r['size']} px, {r['steps']} steps)")
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:<17} {'yes' if r['compile'] else 'no':<7} {r['error']}")
    for r in rows:
        if "sd_scripts_it_s" in r:
            n = r.get("sd_scripts_params")
            peak = (f"peak {r['sd_scripts_peak_alloc_gib']:.2f} GiB allocated / "
                    f"{r['sd_scripts_peak_reserved_gib']:.2f} GiB reserved, " if "sd_scripts_peak_alloc_gib" in r else "")
            lines.append(f"{r['case']:<17} sd-scripts {r['sd_scripts_it_s']:7.2f} it/s, {peak}"
                         f"{f'{n:,}' if n else '?'} trainable parameters")
        elif "sd_scripts" in r:
            lines.append(f"{r['case']:<17} sd-scripts {r['sd_scripts']}")
    return lines


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny models on the CPU, 1 step per case")
    p.add_argument("--steps", type=int, default=12, help="timed steps per case (after --warmup)")
    p.add_argument("--warmup", type=int, default=4, help="steps not timed (compile, allocation)")
    p.add_argument("--only", nargs="*", choices=sorted(CASES) + sorted(gen_img_rate.GPU_CASES),
                   help="run only these cases")
    p.add_argument("--no-compile", action="store_true", help="skip the torch_compile runs")
    p.add_argument("--sd-scripts", metavar="PATH", help="a kohya-ss/sd-scripts checkout")
    p.add_argument("--sd-scripts-python", metavar="PYTHON",
                   help="the Python that runs sd-scripts (its own venv; default: this one)")
    p.add_argument("--peak-tflops", type=float, help="the GPU's peak bf16 TFLOP/s, if not in the table")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--work", metavar="DIR", help="working folder (default: a temporary one)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sd_scripts_launch.check_paths(args.sd_scripts, args.sd_scripts_python, "train_network.py")
        if args.sd_scripts and args.dry_run:
            raise sd_scripts_launch.SdScriptsError("--sd-scripts with --dry-run: sd-scripts cannot load the tiny models "
                                     "(it builds the full-size architectures)")
        python = args.sd_scripts_python or sys.executable
        missing = sd_scripts_launch.missing_modules(python) if args.sd_scripts else []
        if missing:
            raise sd_scripts_launch.SdScriptsError(f"--sd-scripts: {python} lacks {', '.join(missing)}")
    except sd_scripts_launch.SdScriptsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("error: benchmarks/gpu.py needs a CUDA GPU (use --dry-run to check it on the CPU)",
              file=sys.stderr)
        return 2
    steps, warmup = (1, 0) if args.dry_run else (args.steps + args.warmup, args.warmup)
    names = args.only or list(CASES) + list(gen_img_rate.GPU_CASES)

    work = args.work or tempfile.mkdtemp(prefix="sdtk-gpu-bench-")
    device = torch.cuda.get_device_name() if cuda else "cpu (dry run)"
    peak = peak_flops(device, args.peak_tflops) if cuda else None
    print(f"device: {device}; peak bf16 {peak / 1e12:.0f} TFLOP/s" if peak else f"device: {device}",
          flush=True)
    data = {}
    rows = []
    for i, name in enumerate(names):
        if name in gen_img_rate.GPU_CASES:  # generation: ours next to diffusers' pipeline
            rows.append(gen_img_rate.gpu_row(name, args.dry_run))
            print(f"  {name}: {rows[-1]['images_s']:.3f} images/s (diffusers' pipeline "
                  f"{rows[-1]['diffusers_images_s']:.3f})", flush=True)
            continue
        arch = CASES[name][1]
        if arch == "flux" and not args.dry_run and not all(map(os.path.exists, flux_weights.paths(work).values())):
            print("writing random full-size FLUX.1 files (once per working folder) ...", flush=True)
            flux_weights.write_flux_files(work)
        if arch in DIT_ARCHS and not args.dry_run and not all(map(os.path.exists, dit_weights.paths(work, arch).values())):
            print(f"writing random full-size {arch} files (once per working folder) ...", flush=True)
            dit_weights.write_files(work, arch)
        size = 64 if args.dry_run else CASES[name][2]
        if size not in data:  # 4 images: batch 4 fits one step
            data[size] = os.path.dirname(make_sample_dataset(os.path.join(work, f"data{size}"),
                                                             n_images=4, size=size, repeats=1))
        # blocks_to_swap copies between the blocks' graphs: torch_compile is refused with it
        compile_too = not args.no_compile and "swap" not in name
        for compiled in (False, True) if compile_too else (False,):
            try:
                rows.append(run_case(name, compiled, data[size], work, steps, warmup, args.dry_run, cuda))
            except SystemExit as e:  # a failed run (printed above): the other cases still run
                rows.append({"case": name, "compile": compiled, "error": str(e)})
                print(f"  {name} compile={compiled}: failed ({e})", flush=True)
                continue
            print(f"  {name} compile={compiled}: {rows[-1]['it_s']:.2f} it/s", flush=True)
        if args.sd_scripts:
            rows.append(sd_scripts_case(name, args.sd_scripts, python, data[size], work, steps, warmup))
            if arch != "flux" and all(n not in CASES or CASES[n][1] != arch for n in names[i + 1:]):
                # sd-scripts' copy of the SD weights: its disk goes to the FLUX.1 rows' 58 GB
                sd_scripts_launch.remove_random_weights_file(work, arch)
    print("\n".join(format_table(rows, peak)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": device, "peak_flops": peak, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
