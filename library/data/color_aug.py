"""sd-scripts' ``color_aug`` (train_util.AugHelper.color_aug), without OpenCV.

With probability 0.33 a sample is changed, half of those by a hue shift drawn uniformly in
[-8, 8] on OpenCV's 8-bit hue scale (0-180, i.e. degrees / 2), half by a "gamma" drawn uniformly
in [0.95, 1.05] applied as clip(pixel ** gamma, 0, 255) to the uint8 values. The gamma is applied
to 0-255 values, not to 0-1 values, so it is a brightness change (255 ** 1.05 > 255 clips, 255 **
0.95 = 193); sd-scripts does exactly that, and we reproduce it.

The decisions are drawn from the sample's own generator (``draw(rng)``, rng keyed by seed, epoch
and sample index in training_data.py), never from a process-wide one.

The hue round trip reproduces OpenCV's 8-bit ``cvtColor`` conversions in numpy: H = hue in
degrees / 2 rounded (0..179), S = round(255 * (max - min) / max), V = max; the shifted H is
truncated to an integer (sd-scripts writes the float sum back into the uint8 array), and the
way back computes the float HSV -> RGB of (2 H degrees, S / 255, V / 255) and rounds x 255.
sd-scripts hands its RGB arrays to COLOR_BGR2HSV, i.e. it shifts the hue of the channel-swapped
image; swapping R and B mirrors the hue circle, so its shift of +s is a shift of -s of the true
hue. The shift is drawn symmetrically around 0, so working on the true RGB hue gives the same
distribution of images.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

PROBABILITY = 0.33  # sd-scripts: random.random() <= 0.33
HUE_SHIFT_LIMIT = 8.0  # on the 0-180 scale (16 degrees)
GAMMA_RANGE = (0.95, 1.05)


@dataclass(frozen=True)
class ColorAug:
    kind: str     # "hue" or "gamma"
    value: float  # the hue shift (0-180 scale) or the gamma


def draw(rng: random.Random) -> ColorAug | None:
    """The sample's decision, drawn in sd-scripts' order: apply?, which one?, its amount."""
    if rng.random() > PROBABILITY:
        return None
    if rng.random() > 0.5:
        return ColorAug("hue", rng.uniform(-HUE_SHIFT_LIMIT, HUE_SHIFT_LIMIT))
    return ColorAug("gamma", rng.uniform(*GAMMA_RANGE))


def apply(rgb: np.ndarray, aug: ColorAug | None) -> np.ndarray:
    """(H, W, 3) uint8 RGB -> the augmented (H, W, 3) uint8 image (unchanged for None)."""
    if aug is None:
        return rgb
    if aug.kind == "hue":
        return hue_shift(rgb, aug.value)
    if aug.kind == "gamma":
        return gamma(rgb, aug.value)
    raise ValueError(f"unknown color augmentation {aug.kind!r}")


def gamma(rgb: np.ndarray, g: float) -> np.ndarray:
    # uint8 ** float is float64 in numpy; astype(uint8) truncates, as in sd-scripts
    return np.clip(rgb.astype(np.float64) ** g, 0, 255).astype(np.uint8)


def hue_shift(rgb: np.ndarray, shift: float) -> np.ndarray:
    h, s, v = rgb_to_hsv8(rgb)
    if shift < 0:  # sd-scripts adds 180 + shift for a negative shift, then takes the modulo
        shift = 180 + shift
    h = np.floor((h + shift) % 180)  # the float written back into a uint8 array: truncated
    return hsv8_to_rgb(h, s, v)


def rgb_to_hsv8(rgb: np.ndarray):
    """OpenCV's 8-bit RGB -> HSV: H in 0..179 (degrees / 2), S and V in 0..255 (float arrays of
    integers)."""
    x: np.ndarray = rgb.astype(np.float64)
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    v = x.max(axis=-1)
    diff = v - x.min(axis=-1)
    s = np.where(v > 0, np.floor(diff * 255.0 / np.where(v > 0, v, 1) + 0.5), 0.0)
    d = np.where(diff > 0, diff, 1)
    # hue in sixths of the circle (OpenCV's order of cases: max is R, else G, else B)
    sixths = np.where(v == r, (g - b) / d, np.where(v == g, (b - r) / d + 2, (r - g) / d + 4))
    h = np.floor(sixths * 30.0 + 0.5)
    h = np.where(h < 0, h + 180, h)
    h = np.where(diff > 0, h, 0.0)
    return h, s, v


# OpenCV's HSV2RGB sector table: for each sector, which of (v, p, q, t) gives (b, g, r)
_SECTORS = ((1, 3, 0), (1, 0, 2), (3, 0, 1), (0, 2, 1), (0, 1, 3), (2, 1, 0))


def hsv8_to_rgb(h, s, v) -> np.ndarray:
    """OpenCV's 8-bit HSV -> RGB (H on the 0-180 scale); rounds half to even as cvRound."""
    hh = np.asarray(h, np.float64) * (6.0 / 180.0)
    ss = np.asarray(s, np.float64) / 255.0
    vv = np.asarray(v, np.float64) / 255.0
    hh = np.where(hh >= 6, hh - 6, hh)
    sector = np.floor(hh).astype(np.int64)
    f = hh - sector
    tab = np.stack([vv, vv * (1 - ss), vv * (1 - ss * f), vv * (1 - ss * (1 - f))], axis=-1)
    idx = np.asarray(_SECTORS)[sector]  # (..., 3): indices of b, g, r
    bgr = np.take_along_axis(tab, idx, axis=-1)
    bgr = np.where((ss == 0)[..., None], vv[..., None], bgr)
    out = np.rint(bgr[..., ::-1] * 255.0)
    return np.clip(out, 0, 255).astype(np.uint8)

