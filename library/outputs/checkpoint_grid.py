"""Compare checkpoints: a labelled grid of a run's saved LoRA files x multipliers x prompts at
fixed seeds, through gen_img's Generator (tools/compare_checkpoints.py's core, callable by the UI).

    files = find_checkpoints(folder, output_name)   a run's files, in training order
    files = checkpoints_of(paths)                   an explicit list, in its order
    args = parse_args(argv)                         gen_img's flags plus the grid's
    result = compare(args)                          the cells' PNGs, grid.png, grid.json

A run's files are sd-scripts' names (library/files.py ``output_file``): ``name-000001`` per epoch,
``name-step00000010`` per step and the final ``name``, ordered by their ``ss_steps`` metadata
(then ``ss_epoch``), or by the number in the name where a file has no metadata (the final file
last). The model loads once; each file's network is hooked in place of the previous one.

Layout: one row per file (labelled with its name, epoch and step), one column per prompt line
and multiplier (prompt-major; labelled "prompt i", "x m"). A prompt line's seed is its ``--d``,
else the one gen_img draws with the same ``--seed`` (default 0), so every cell is the image
``gen_img.py --network_weights FILE --network_mul M`` renders with that prompt line and seed.
Each cell is also its own PNG with A1111's ``parameters`` text (``cells/``); ``grid.json``
describes rows, columns and cells.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont
from tqdm import tqdm

from library.files import atomic_path
from library.outputs import gen_options, generation, infotext
from library.outputs.gen_options import GenError
from library.safetensors_file import read_header

logger = logging.getLogger("sdtk")
GRID_PNG, GRID_JSON, CELLS = "grid.png", "grid.json", "cells"
# sd-scripts' saved names: -000001 (epoch), -step00000010 (step), none (the final file)
_SAVED = re.compile(r"^(?P<base>.+?)(?:-(?P<epoch>\d{6})|-step(?P<step>\d{8}))?\.safetensors$")
PAD, LINE = 4, 12  # label margins and line height (PIL's default bitmap font is 11 px high)


@dataclass(frozen=True)
class Checkpoint:
    path: str
    name: str            # the file name without .safetensors
    epoch: int | None    # ss_epoch, else the name's epoch
    step: int | None     # ss_steps, else the name's step

    def label(self) -> list[str]:
        where = ", ".join(f"{k} {v}" for k, v in (("epoch", self.epoch), ("step", self.step)) if v is not None)
        return [self.name] + ([where] if where else [])


def _metadata(path: str) -> dict:
    try:
        return read_header(path)[1].get("__metadata__") or {}
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise GenError(f"{path}: not a safetensors file ({e})") from None


def _int(md: dict, key: str) -> int | None:
    try:
        return int(md[key])
    except (KeyError, ValueError):
        return None


def read_checkpoint(path: str) -> Checkpoint:
    if not os.path.isfile(path):
        raise GenError(f"{path}: no such file")
    md = _metadata(path)
    name = os.path.basename(path)
    m = _SAVED.match(name)
    epoch, step = _int(md, "ss_epoch"), _int(md, "ss_steps")
    if m and epoch is None and m["epoch"]:
        epoch = int(m["epoch"])
    if m and step is None and m["step"]:
        step = int(m["step"])
    return Checkpoint(path, name[:-len(".safetensors")] if name.endswith(".safetensors") else name, epoch, step)


def checkpoints_of(paths: list[str]) -> list[Checkpoint]:
    return [read_checkpoint(p) for p in paths]


def find_checkpoints(folder: str, output_name: str | None = None) -> list[Checkpoint]:
    """The saved files of one run in ``folder``, in training order."""
    if not os.path.isdir(folder):
        raise GenError(f"--lora_dir {folder}: no such folder")
    runs: dict[str, list[tuple[str, re.Match]]] = {}
    for f in sorted(os.listdir(folder)):
        m = _SAVED.match(f)
        if m and os.path.isfile(os.path.join(folder, f)):
            runs.setdefault(m["base"] if (m["epoch"] or m["step"]) else f[:-len(".safetensors")], []).append((f, m))
    if output_name is not None:
        runs = {k: v for k, v in runs.items() if k == output_name}
        if not runs:
            raise GenError(f"--lora_dir {folder}: no file of --output_name {output_name} "
                           f"({output_name}.safetensors, {output_name}-000001.safetensors, ...)")
    if not runs:
        raise GenError(f"--lora_dir {folder}: holds no .safetensors file")
    if len(runs) > 1:
        raise GenError(f"--lora_dir {folder}: holds the files of several runs ({', '.join(sorted(runs))}); "
                       "choose one with --output_name")
    [found] = runs.values()
    files = [(read_checkpoint(os.path.join(folder, f)), m) for f, m in found]

    def by_metadata(item):
        c, m = item
        return (c.step, c.epoch or 0, not (m["epoch"] or m["step"]))

    def by_name(item):  # a file without ss_steps: the name's epoch or step, the final file last
        _, m = item
        return (not (m["epoch"] or m["step"]), int(m["epoch"] or m["step"] or 0))
    order = by_metadata if all(c.step is not None for c, _ in files) else by_name
    return [c for c, _ in sorted(files, key=order)]


# -- options ----------------------------------------------------------------------------------
# gen_img's flags that the grid sets itself
_NOT_HERE = {"network_weights": [], "network_mul": [], "network_merge": False, "images_per_prompt": 1,
             "n_iter": 1, "iter_same_seed": False, "sequential_file_name": False, "interactive": False,
             "shuffle_prompts": False, "use_original_file_name": False}


def build_parser():
    p = gen_options.build_parser(prog="compare_checkpoints.py", description=(
        "Render a labelled grid of a run's saved LoRA files x multipliers x prompts at fixed seeds "
        "(gen_img's flags; docs/GENERATION.md)"))
    p.add_argument("--lora_dir", help="the run's output folder: its saved files (-000001, -step00000010, final)")
    p.add_argument("--output_name", help="with --lora_dir: the run's file name, where the folder holds several runs")
    p.add_argument("--files", nargs="*", default=[], help="the LoRA files, in this order (instead of --lora_dir)")
    p.add_argument("--multipliers", type=float, nargs="+", default=[1.0], help="LoRA multipliers (columns)")
    return p


def parse_args(argv: list[str]):
    args = build_parser().parse_args(argv)
    for key, unset in _NOT_HERE.items():
        if getattr(args, key) != unset:
            raise GenError(f"--{key}: not a compare_checkpoints option (the grid sets the files, "
                           "multipliers and seeds itself)")
    if bool(args.lora_dir) == bool(args.files):
        raise GenError("give one of --lora_dir or --files")
    if args.output_name and not args.lora_dir:
        raise GenError("--output_name selects files of --lora_dir")
    if len(args.network_module) > 1 or len(args.network_args) > 1:
        raise GenError("--network_module / --network_args: one, for every file")
    if args.seed is None:
        args.seed = 0
    kwargs = gen_options.network_kwargs(args.network_args[0], 0) if args.network_args else {}
    args.network_args = []
    gen_options.check_args(args)
    args.grid_network_kwargs = kwargs
    return args


# -- the grid ---------------------------------------------------------------------------------
def _cell_name(row: int, col: int, ckpt: Checkpoint, job, mul: float) -> str:
    return f"r{row:03d}_c{col:03d}_{ckpt.name}_x{mul:g}_{job.seed}.png"


def compare(args) -> dict:
    """Render every cell, then the labelled grid; returns the layout written to grid.json."""
    files = find_checkpoints(args.lora_dir, args.output_name) if args.lora_dir else checkpoints_of(args.files)
    prompts = generation.check_before_loading(args)
    gen = generation.Generator(args)
    jobs = gen_options.plan_jobs(args, prompts, gen.defaults)
    module = args.network_module[0] if args.network_module else None
    for c in files:  # every file loads into this model before any image renders
        gen.swap_network(c.path, module, args.grid_network_kwargs)
    logger.info(f"{len(files)} files: {', '.join(c.name for c in files)}")
    columns = [(i, job, mul) for i, job in enumerate(jobs) for mul in args.multipliers]
    os.makedirs(os.path.join(args.outdir, CELLS), exist_ok=True)
    cells: list[list[str]] = []
    bar = tqdm(total=len(files) * len(columns), desc="cells")
    for r, c in enumerate(files):
        gen.swap_network(c.path, module, args.grid_network_kwargs)
        row: dict[int, str] = {}
        for mi, mul in enumerate(args.multipliers):
            todo = [dataclasses.replace(job, muls=(mul,)) for job in jobs]
            k = 0
            for batch in gen_options.batches(todo, args.batch_size):
                for job, image in zip(batch, gen.render(batch)):
                    col = k * len(args.multipliers) + mi
                    name = os.path.join(CELLS, _cell_name(r, col, c, job, mul))
                    infotext.save_png(image, os.path.join(args.outdir, name), gen.parameters(job), {
                        "prompt": job.prompt, "negative-prompt": job.negative, "seed": job.seed,
                        "sampler": job.sampler, "steps": job.steps, "scale": job.scale, "multiplier": mul,
                        "checkpoint": c.name})
                    row[col] = name
                    k += 1
                    bar.update()
        cells.append([row[j] for j in range(len(columns))])
    bar.close()
    layout = {
        "model": args.ckpt, "outdir": args.outdir,
        "rows": [{"file": c.path, "name": c.name, "epoch": c.epoch, "step": c.step, "label": c.label()}
                 for c in files],
        "columns": [{"prompt_index": i + 1, "prompt": job.prompt, "negative_prompt": job.negative,
                     "seed": job.seed, "multiplier": mul, "width": job.width, "height": job.height,
                     "steps": job.steps, "scale": job.scale, "sampler": job.sampler,
                     "label": column_label(i, mul)} for i, job, mul in columns],
        "cells": cells, "grid": GRID_PNG}
    grid = draw_grid([[os.path.join(args.outdir, n) for n in row] for row in cells],
                     [r["label"] for r in layout["rows"]], [c["label"] for c in layout["columns"]])
    layout["grid_size"] = list(grid.size)
    with atomic_path(os.path.join(args.outdir, GRID_PNG)) as tmp:
        grid.save(tmp, format="PNG")
    with atomic_path(os.path.join(args.outdir, GRID_JSON)) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(layout, f, indent=1)
    return layout


def column_label(prompt_index: int, mul: float) -> list[str]:
    return [f"prompt {prompt_index + 1}", f"x{mul:g}"]


def label_box(lines: list[str]) -> tuple[int, int]:
    """The size of a label block in PIL's default font, margins included."""
    font = ImageFont.load_default()
    width = max((int(font.getlength(t)) for t in lines), default=0)
    return width + 2 * PAD, len(lines) * LINE + 2 * PAD


def draw_grid(paths: list[list[str]], row_labels: list[list[str]], col_labels: list[list[str]]) -> Image.Image:
    """The cells on a white sheet, each in a slot of the largest cell's size, row labels on the
    left and column labels on top (PIL's default font)."""
    images = [[Image.open(p).convert("RGB") for p in row] for row in paths]
    cw = max(im.width for row in images for im in row)
    ch = max(im.height for row in images for im in row)
    left = max(label_box(lab)[0] for lab in row_labels)
    top = max(label_box(lab)[1] for lab in col_labels)
    sheet = Image.new("RGB", (left + cw * len(col_labels), top + ch * len(row_labels)), "white")
    draw, font = ImageDraw.Draw(sheet), ImageFont.load_default()
    for j, lab in enumerate(col_labels):
        for k, t in enumerate(lab):
            draw.text((left + j * cw + PAD, PAD + k * LINE), t, fill="black", font=font)
    for i, (lab, row) in enumerate(zip(row_labels, images)):
        for k, t in enumerate(lab):
            draw.text((PAD, top + i * ch + PAD + k * LINE), t, fill="black", font=font)
        for j, im in enumerate(row):
            sheet.paste(im, (left + j * cw, top + i * ch))
    return sheet
