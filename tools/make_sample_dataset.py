"""Write a small deterministic dataset in the ``N_concept`` folder convention.

    python tools/make_sample_dataset.py --out data/sample [--images 4] [--size 64]

Creates ``OUT/<repeats>_<concept>/shape_XX.png`` (coloured shapes on a plain background, drawn
with PIL, no randomness) with one ``.caption`` file each, for the README quick start and tests.
"""
from __future__ import annotations

import argparse
import os
import sys

from PIL import Image, ImageDraw

_COLOURS = [("red", (220, 40, 40)), ("blue", (40, 70, 220)), ("green", (40, 170, 70)),
            ("yellow", (230, 200, 40)), ("purple", (150, 60, 190)), ("orange", (240, 140, 30))]
_BACKGROUNDS = [(245, 245, 240), (30, 30, 40), (200, 220, 235), (235, 215, 200)]
_SHAPES = ("circle", "square", "triangle")


def _draw(index: int, size: int) -> tuple[Image.Image, str]:
    colour_name, colour = _COLOURS[index % len(_COLOURS)]
    shape = _SHAPES[index % len(_SHAPES)]
    img = Image.new("RGB", (size, size), _BACKGROUNDS[index % len(_BACKGROUNDS)])
    draw = ImageDraw.Draw(img)
    # vary the shape's size and position with the index so images differ beyond colour
    margin = size // 8 + (index * size // 16) % (size // 4)
    box = (margin, margin + (index % 3) * size // 32, size - margin, size - margin)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((box[0] + box[2]) // 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=colour)
    return img, f"a {colour_name} {shape}"


def make_sample_dataset(out_dir: str, n_images: int = 4, size: int = 64, repeats: int = 5,
                        concept: str = "sks shape") -> str:
    """Write ``n_images`` images of ``size`` px; return the concept folder's path."""
    if n_images < 1 or size < 8 or repeats < 1:
        raise ValueError("n_images and repeats must be >= 1 and size >= 8")
    folder = os.path.join(out_dir, f"{repeats}_{concept}")
    os.makedirs(folder, exist_ok=True)
    for i in range(n_images):
        img, description = _draw(i, size)
        stem = os.path.join(folder, f"shape_{i:02d}")
        img.save(stem + ".png")
        with open(stem + ".caption", "w", encoding="utf-8") as f:
            f.write(f"{concept}, {description}\n")
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder to write (the train_data_dir)")
    p.add_argument("--images", type=int, default=4, help="number of images (default 4)")
    p.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="repeats in the folder name (default 5)")
    p.add_argument("--concept", default="sks shape", help="class tokens (default 'sks shape')")
    a = p.parse_args(argv)
    try:
        folder = make_sample_dataset(a.out, a.images, a.size, a.repeats, a.concept)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.images} images to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
