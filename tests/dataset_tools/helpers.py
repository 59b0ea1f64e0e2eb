"""Small image folders for the dataset tools' tests (random pixels, fixed seeds)."""
import os

import numpy as np
from PIL import Image


def write_image(path, size, seed=0, mode="RGB"):
    """A (w, h) image of random pixels at ``path`` (format from the extension); returns it."""
    w, h = size
    channels = {"RGB": 3, "RGBA": 4}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, channels), dtype=np.uint8)
    img = Image.fromarray(pixels, mode)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    img.save(path)
    return img


def write_text(path, text):
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def read_text(path):
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def error_line(err):
    """The single error line a tool printed (its other stderr lines are INFO/WARNING log lines)."""
    errors = [ln for ln in err.strip().splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]
