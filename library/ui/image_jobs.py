"""The Generate page and a run's Compare panel as tool jobs: the form's fields become gen_img.py's
or tools/compare_checkpoints.py's argument list (the command-line scripts themselves run, in the
queue; no second generator), and a job's images are read back with their A1111 text.

    generate_job(form, allowed, default_parent) -> ImageJob    gen_img.py: a model (path or
                                built-in name) and its separate parts (``parts``: --vae, --ae,
                                --qwen3, --gemma2, ...; ``system_prompt``), LoRAs with weights,
                                prompt, negative prompt, seed, steps, size, sampler, scale, images
    run_model(opts, output_dir, output_name) -> RunModel    a finished run's model flags (from
                                its config's Options) and saved files
    compare_job(form, run) -> ImageJob          compare_checkpoints.py over the run's saved files
    write_prompts(job)                          the job's folder made, its prompt file written
    images(outdir) -> {"images": [...], "grid": layout | None}

Each job gets a fresh folder (``gen-<time>`` under the Generate page's output folder, default
``generated/`` in the first allowed folder, or the server's data folder; ``compare/grid-<time>``
in the run's output folder): that is the job's output folder, whose files the API serves. The
prompts go to a file in it (``prompt.txt``: one line, the negative prompt as the prompt line's
``--n``; ``prompts.txt``: the grid's lines), so a prompt is never taken for a flag or a path.
A field's bad value is one DataError line naming the field; the model and LoRA paths are checked
against ``--allowed_paths`` with every other argument, as for any tool job (library/ui/tool_jobs.py).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from library.config.options import GEN_IMG_PARTS, gen_img_flags
from library.errors import DataError
from library.files import atomic_path
from library.ui.workbench import inside

GEN_IMG, COMPARE = "gen_img.py", "tools/compare_checkpoints.py"
PROMPT_FILE, PROMPTS_FILE = "prompt.txt", "prompts.txt"
MAX_LORAS, MAX_PROMPTS, MAX_MULTIPLIERS, MAX_IMAGES = 8, 16, 8, 16
MAX_SIZE, MAX_STEPS, MAX_SEED = 4096, 1000, 2 ** 32 - 1


@dataclass(frozen=True)
class ImageJob:
    tool: str
    args: list
    outdir: str
    prompt_file: str
    prompts: str          # the prompt file's text


@dataclass(frozen=True)
class RunModel:
    """What compare_checkpoints needs of a finished run: its model and saved files."""
    model: str
    output_dir: str
    output_name: str
    flags: tuple          # the model's other flags (--vae, --v2, --clip_l, ...)
    network_module: str | None




def _absolute(path: str) -> str:
    """A path the run's process (working folder: the server's) found, as an absolute path (a tool
    job runs in another folder); a hub id or built-in name unchanged."""
    p = os.path.expanduser(path)
    return os.path.abspath(p) if os.path.lexists(p) else path


def run_model(opts, output_dir: str, output_name: str) -> RunModel:
    flags = gen_img_flags(opts, _absolute)  # the run's parts, text settings and prediction type
    module = opts.network_module if "network_module" in opts.given else None
    return RunModel(_absolute(opts.pretrained_model_name_or_path), output_dir, output_name,
                    tuple(flags), module)


def _int(form: dict, name: str, lo: int, hi: int):
    v = form.get(name)
    if v is None or v == "":
        return None
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise DataError(f"{name}: an integer from {lo} to {hi} is required, got {v!r}")
    return v


def _float(form: dict, name: str, v=None, lo: float = -100.0, hi: float = 100.0):
    v = form.get(name) if v is None else v
    if v is None or v == "":
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise DataError(f"{name}: a number is required, got {v!r}") from None
    if isinstance(v, bool) or not lo <= x <= hi:
        raise DataError(f"{name}: a number from {lo:g} to {hi:g} is required, got {v!r}")
    return x


def _text(form: dict, name: str, required: bool = False) -> str:
    v = form.get(name, "")
    if v is None:
        v = ""
    if not isinstance(v, str) or "\0" in v:
        raise DataError(f"{name}: a string is required")
    v = v.strip()
    if required and not v:
        raise DataError(f"{name}: required")
    return v


def _one_line(text: str, name: str) -> str:
    if "\n" in text or "\r" in text:
        raise DataError(f"{name}: one line is required (a prompt line's options follow ' --')")
    return text


def _sampling_args(form: dict) -> list[str]:
    """seed, steps, size, sampler, scale: gen_img's flags (those left empty: its defaults)."""
    out = []
    for name, flag, lo, hi in (("seed", "--seed", 0, MAX_SEED), ("steps", "--steps", 1, MAX_STEPS),
                               ("width", "--W", 8, MAX_SIZE), ("height", "--H", 8, MAX_SIZE)):
        v = _int(form, name, lo, hi)
        if v is not None:
            out += [flag, str(v)]
    sampler = _text(form, "sampler")
    if sampler:
        if not sampler.replace("_", "").replace("+", "").isalnum():
            raise DataError(f"sampler: {sampler!r} is not a sampler name")
        out += ["--sampler", sampler]
    scale = _float(form, "scale", lo=0.0, hi=100.0)
    if scale is not None:
        out += ["--scale", f"{scale:g}"]
    return out


def _part_args(form: dict) -> list[str]:
    """The form's ``parts`` ({flag name: path}: a single-file model's separate files) and text
    options as gen_img's flags; an unknown name or a value that reads as a flag is one line."""
    parts = form.get("parts") or {}
    if not isinstance(parts, dict):
        raise DataError("parts: an object of {name: path} is required")
    out = []
    for name, value in parts.items():
        if name not in GEN_IMG_PARTS:
            raise DataError(f"parts: unknown part {name!r} (one of {', '.join(GEN_IMG_PARTS)})")
        path = _text(parts, name)
        if path.startswith("-"):
            raise DataError(f"{name}: {path!r} is not a file or folder name")
        if path:
            out += [f"--{name}", path]
    text = _one_line(_text(form, "system_prompt"), "system_prompt")
    if text:
        out.append(f"--system_prompt={text}")  # one argument: a text starting with '-' is not a flag
    return out


def fresh_folder(parent: str, prefix: str) -> str:
    """``<parent>/<prefix>-<UTC time>`` (with ``-2``, ``-3``, ... when taken); not created."""
    base = os.path.join(parent, f"{prefix}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    path, n = base, 1
    while os.path.lexists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def generate_job(form: dict, allowed: list[str], default_parent: str) -> ImageJob:
    model = _text(form, "model", required=True)
    if model.startswith("-"):
        raise DataError(f"model: {model!r} is not a model path or name")
    prompt = _one_line(_text(form, "prompt", required=True), "prompt")
    negative = _one_line(_text(form, "negative_prompt"), "negative_prompt")
    loras = form.get("loras") or []
    if not isinstance(loras, list) or len(loras) > MAX_LORAS:
        raise DataError(f"loras: a list of at most {MAX_LORAS} {{path, weight}} entries is required")
    paths, weights = [], []
    for i, lo in enumerate(loras, 1):
        if not isinstance(lo, dict):
            raise DataError(f"loras {i}: {{path, weight}} is required")
        path = _text(lo, "path", required=True)
        if path.startswith("-"):
            raise DataError(f"LoRA {i}: {path!r} is not a file name")
        paths.append(path)
        w = _float(lo, "weight", lo=-10.0, hi=10.0)
        weights.append(1.0 if w is None else w)
    base = os.path.realpath(allowed[0]) if allowed else os.getcwd()  # a tool job's working folder
    parent = os.path.join(base, os.path.expanduser(_text(form, "outdir") or default_parent))
    outdir = fresh_folder(inside(parent, allowed, "outdir"), "gen")
    prompt_file = os.path.join(outdir, PROMPT_FILE)
    args = ["--ckpt", model, "--outdir", outdir, "--from_file", prompt_file, *_sampling_args(form)]
    args += _part_args(form)
    images = _int(form, "images", 1, MAX_IMAGES)
    if images is not None:
        args += ["--images_per_prompt", str(images)]
    if paths:
        args += ["--network_weights", *paths, "--network_mul", *(f"{w:g}" for w in weights)]
    line = prompt + (f" --n {negative}" if negative else "")
    return ImageJob(GEN_IMG, args, outdir, prompt_file, line + "\n")


def compare_job(form: dict, run: RunModel) -> ImageJob:
    text = form.get("prompts", "")
    if not isinstance(text, str) or "\0" in text:
        raise DataError("prompts: a string is required")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not lines or len(lines) > MAX_PROMPTS:
        raise DataError(f"prompts: 1 to {MAX_PROMPTS} prompt lines are required")
    muls = form.get("multipliers", [1.0])
    if isinstance(muls, str):
        muls = [m for m in muls.replace(",", " ").split() if m]
    if not isinstance(muls, list) or not 1 <= len(muls) <= MAX_MULTIPLIERS:
        raise DataError(f"multipliers: 1 to {MAX_MULTIPLIERS} numbers are required")
    muls = [_float({}, "multipliers", m, lo=-10.0, hi=10.0) for m in muls]
    outdir = fresh_folder(os.path.join(run.output_dir, "compare"), "grid")
    prompt_file = os.path.join(outdir, PROMPTS_FILE)
    args = ["--ckpt", run.model, *run.flags, "--lora_dir", run.output_dir, "--outdir", outdir,
            "--from_file", prompt_file, "--multipliers", *(f"{m:g}" for m in muls)]
    if run.output_name:
        args += ["--output_name", run.output_name]
    if run.network_module:
        args += ["--network_module", run.network_module]
    args += _sampling_args(form)
    if "--seed" not in args:
        args += ["--seed", "0"]  # the grid's fixed seeds (compare_checkpoints' default, said)
    return ImageJob(COMPARE, args, outdir, prompt_file, "\n".join(lines) + "\n")


def write_prompts(job: ImageJob) -> None:
    try:
        os.makedirs(job.outdir)
        with atomic_path(job.prompt_file) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write(job.prompts)
    except OSError as e:
        raise DataError(f"outdir {job.outdir}: cannot write there ({e.strerror or e})") from None


def _png_text(path: str) -> str | None:
    # lazy: PIL only when a job's images are listed (the server starts without it)
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.text.get("parameters")
    except Exception:  # PIL raises many types for a file being written or broken
        return None


def images(outdir: str) -> dict:
    """The PNGs a generate or compare job wrote (relative names, in order) with A1111's
    ``parameters`` text; a finished grid's layout (grid.json) too."""
    found = []
    for sub in ("", "cells"):
        folder = os.path.join(outdir, sub)
        if os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                if name.endswith(".png") and name != "grid.png" and not name.startswith("."):
                    rel = f"{sub}/{name}" if sub else name
                    found.append({"name": rel, "parameters": _png_text(os.path.join(outdir, rel))})
    grid = None
    try:
        with open(os.path.join(outdir, "grid.json"), encoding="utf-8") as f:
            grid = json.load(f)
    except (OSError, ValueError):
        pass
    return {"images": found, "grid": grid}
