"""Random inpainting masks (train_inpainting), one per sample and epoch.

The kinds and their odds follow sd-scripts' ``library/mask_generator.py`` (``random_mask``):
40 % a cloud (fractional Brownian motion: octaves of upsampled uniform noise, thresholded so that
a fraction drawn in [0.1, 0.3] of the image is masked; a third of the clouds are joined with a
polygon or a shape), 35 % one or two random polygons (6 vertices around a centre, radius from a
coverage in [0.1, 0.6] of the area), 25 % a rectangle or ellipse (sides from a coverage in
[0.1, 0.4]). The mask is 1 where the model regenerates the image.

Every draw comes from one ``random.Random`` the caller seeds by (seed, epoch, sample), the key of
the other augmentations (library/data/training_data.py), so a sample's mask is the same whatever
the process count, batch split or resume point.
"""
from __future__ import annotations

import math
import random

KIND_WEIGHTS = (("cloud", 0.40), ("polygon", 0.35), ("shape", 0.25))


def random_mask(width: int, height: int, rng: random.Random, tries: int = 8):
    """(height, width) float32 tensor, 1 = inpaint, 0 = keep. sd-scripts' polygons can fall
    entirely outside the image (a centre near an edge, every vertex on the far side): an empty
    mask, which would train nothing about inpainting, is drawn again from the same generator
    (at most ``tries`` draws)."""
    # lazy: the dry run's plan loads this module before torch; numpy and torch are imported when
    # random_mask() runs
    import numpy as np
    import torch

    for _ in range(tries):
        m = _draw(width, height, rng)
        if m.any():
            break
    return torch.from_numpy((m > 0).astype(np.float32))


def _draw(width: int, height: int, rng: random.Random):
    # lazy: the dry run's plan loads this module before torch; numpy is imported when _draw() runs
    import numpy as np

    kind = rng.choices([k for k, _ in KIND_WEIGHTS], weights=[w for _, w in KIND_WEIGHTS])[0]
    if kind == "cloud":
        m = cloud_mask(width, height, rng.uniform(0.1, 0.3), rng)
        if rng.random() < 0.33:
            other = polygon_mask(width, height, 1, rng) if rng.random() < 0.5 \
                else shape_mask(width, height, rng)
            m = np.maximum(m, other)
    elif kind == "polygon":
        m = polygon_mask(width, height, rng.randint(1, 2), rng)
    else:
        m = shape_mask(width, height, rng)
    return m


def cloud_mask(width: int, height: int, coverage: float, rng: random.Random, octaves: int = 4,
               persistence: float = 0.5, base_scale: float = 16.0):
    """fBm noise: each octave a small grid of uniform noise upsampled (bicubic) to the image,
    halving in amplitude and scale; the top ``coverage`` fraction is masked."""
    # lazy: the dry run's plan loads this module before torch; numpy and PIL are imported when
    # cloud_mask() runs
    import numpy as np
    from PIL import Image

    noise: np.ndarray = np.zeros((height, width), dtype=np.float32)
    amplitude, scale = 1.0, base_scale
    g = np.random.default_rng(rng.getrandbits(63))
    for _ in range(octaves):
        small = g.random((max(2, int(height / scale)), max(2, int(width / scale)))).astype(np.float32)
        noise += amplitude * np.asarray(Image.fromarray(small, mode="F").resize((width, height),
                                                                                Image.BICUBIC))
        amplitude *= persistence
        scale *= 2.0
    cutoff = np.quantile(noise, 1.0 - coverage)
    return (noise >= cutoff).astype(np.uint8)


def polygon_mask(width: int, height: int, n_polygons: int, rng: random.Random, n_points: int = 6,
                 min_coverage: float = 0.1, max_coverage: float = 0.6, irregularity: float = 0.4):
    # lazy: the dry run's plan loads this module before torch; numpy and PIL are imported when
    # polygon_mask() runs
    import numpy as np
    from PIL import Image, ImageDraw

    img = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(img)
    min_r = math.sqrt(min_coverage * width * height / math.pi)
    max_r = math.sqrt(max_coverage * width * height / math.pi)
    for _ in range(n_polygons):
        r = rng.uniform(min_r, max_r)
        cx = rng.uniform(r * 0.2, width - r * 0.2)
        cy = rng.uniform(r * 0.2, height - r * 0.2)
        angles = sorted(rng.uniform(0, 2 * math.pi) for _ in range(n_points))
        pts = []
        for a in angles:
            rr = r * rng.uniform(1.0 - irregularity, 1.0)
            pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
        draw.polygon(pts, fill=255)
    return np.asarray(img)


def shape_mask(width: int, height: int, rng: random.Random, min_coverage: float = 0.1,
               max_coverage: float = 0.4):
    # lazy: the dry run's plan loads this module before torch; numpy and PIL are imported when
    # shape_mask() runs
    import numpy as np
    from PIL import Image, ImageDraw

    img = Image.new("L", (width, height), 0)
    w = rng.randint(int(width * min_coverage ** 0.5), int(width * max_coverage ** 0.5))
    h = rng.randint(int(height * min_coverage ** 0.5), int(height * max_coverage ** 0.5))
    x0, y0 = rng.randint(0, width - w), rng.randint(0, height - h)
    box = [x0, y0, x0 + w, y0 + h]
    draw = ImageDraw.Draw(img)
    (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=255)
    return np.asarray(img)
