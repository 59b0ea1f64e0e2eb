"""debug_dataset: the first global batches of epoch 1 as they would train, on one contact sheet.

sd-scripts' ``--debug_dataset`` logs every sample of the dataset and, on Windows, shows each
image in an OpenCV window, then exits without training. Here the first ``BATCHES`` global
batches of epoch 1 (the training order: library/data/step_plan.py) are logged one line per sample
and drawn into ``<output_dir>/<output_name>_debug_dataset.png``: one row per batch, each image as
prepared (resize, crop, color_aug, flip) above its caption as processed (dropout, wildcards,
token warmup at that step, shuffle, tag dropout). Every draw is keyed to (seed, epoch, sample),
so the sheet shows exactly what a run with any process count trains. No model weight loads.
"""
from __future__ import annotations

import os
import textwrap

from library.data import step_plan

BATCHES = 4  # global batches drawn
CELL = 192   # the longer side of each image on the sheet, in pixels
TEXT_LINES = 6
LINE_HEIGHT = 12


def sample_lines(tset, plan, seed: int, batches: int = BATCHES) -> list[tuple[int, int, str, str]]:
    """(step, sample index, caption, log line) of each sample of the first ``batches`` global
    batches of epoch 1."""
    out = []
    for step, gb in enumerate(step_plan.epoch_batches(tset.bucket_of, seed, 1, plan.global_batch)[:batches]):
        for i in gb.indices:
            s = tset.samples[i]
            cap = tset.caption(i, 1, step)
            line = (f"step {step + 1}, sample {i}: {s.path}, bucket {s.bucket[0]}x{s.bucket[1]}, "
                    f"flipped {tset.flip(i, 1)}, reg {s.is_reg}, network multiplier "
                    f"{'run' if s.network_multiplier is None else s.network_multiplier}, "
                    f"diff_output_preservation {s.dop}, caption {cap!r}")
            out.append((step, i, cap, line))
    return out


def _thumbnail(pixels):
    """(3, H, W) in [-1, 1] -> a PIL image, the longer side CELL."""
    # lazy: the dry run's plan loads this module before torch; torch and PIL are imported when
    # _thumbnail() runs
    import torch  # heavy: only for a debug_dataset run
    from PIL import Image

    arr = ((pixels.clamp(-1, 1) + 1) * 127.5).round().to(dtype=torch.uint8)
    img = Image.fromarray(arr.permute(1, 2, 0).numpy(), "RGB")
    scale = CELL / max(img.size)
    return img.resize((max(1, round(img.size[0] * scale)), max(1, round(img.size[1] * scale))))


def write_sheet(tset, plan, seed: int, path: str, log) -> str:
    """Log the samples and write the contact sheet to ``path`` (atomically); returns ``path``."""
    # lazy: the dry run's plan loads this module before torch; PIL is imported when write_sheet()
    # runs
    from PIL import Image, ImageDraw

    rows: dict[int, list] = {}
    for step, i, cap, line in sample_lines(tset, plan, seed):
        log.info(f"debug_dataset: {line}")
        rows.setdefault(step, []).append((_thumbnail(tset.prepare(i, 1).pixels), cap))
    cols = max(len(r) for r in rows.values())
    text_h = TEXT_LINES * LINE_HEIGHT + 4
    sheet = Image.new("RGB", (cols * (CELL + 8) + 8, len(rows) * (CELL + text_h + 8) + 8), "white")
    draw = ImageDraw.Draw(sheet)
    for r, step in enumerate(sorted(rows)):
        y0 = 8 + r * (CELL + text_h + 8)
        for c, (thumb, cap) in enumerate(rows[step]):
            x0 = 8 + c * (CELL + 8)
            sheet.paste(thumb, (x0, y0))
            wrapped = textwrap.wrap(f"[{step + 1}] {cap}" if cap else f"[{step + 1}] (empty caption)",
                                    width=CELL // 6)[:TEXT_LINES]
            for k, text in enumerate(wrapped):
                draw.text((x0, y0 + CELL + 2 + k * LINE_HEIGHT), text, fill="black")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.png"
    sheet.save(tmp)
    os.replace(tmp, path)
    return path
