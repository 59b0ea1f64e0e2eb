"""The MMDiT's position embedding: sin-cos tables, SD3.5's scaled tables per resolution and the
random crop (sd-scripts' ``library/sd3_models.py``, its options ``--enable_scaled_pos_embed`` and
``--pos_emb_random_crop_rate``).

    sincos_table(dim, positions)                    (n^2, dim) table of a square grid
    scaled_table(dim, grid, sample_size)            sd-scripts' get_scaled_2d_sincos_pos_embed
    ScaledPosEmbed(dim, patched_sizes)              the tables of enable_scaled_pos_embed
    crop_offset(seed, rate, size, h, w)             (top, left) of one sample's crop

A table holds, for the patch in row r and column c of an n x n grid, the sin-cos features of the
column's position in its first half and of the row's in the second (SAI's and diffusers' layout).

enable_scaled_pos_embed: for each training resolution's patched latent size s (its latent size
round(sqrt(W x H)) / 8, over the patch size) a table of g = int(1.5 s) patches whose positions are
(i - (g - s) / 2) x 16 / s, so the centre s x s patches span the positions a 16 x 16 grid has;
a latent of h x w patches takes the table of the first size whose area limit (the midpoints
between consecutive sizes' areas, int((1.5 s)^2) for the last) is at least h x w, else the
largest. A latent wider or taller than its table's grid gets a table of its own for max(h, w)
(sd-scripts adds that one to its area list too, so there a later latent's table depends on which
shapes came before; here it depends on the shape alone, so a resumed run computes the same).

pos_emb_random_crop_rate: with this probability a training sample's h x w window of the table is
at a uniformly drawn offset (every top in [0, n - h], every left in [0, n - w]), else the centre
((n - h) // 2, (n - w) // 2). sd-scripts draws once per batch from the global torch generator;
here each sample draws from random.Random of its own seed (derive_seed("pos-crop", seed, epoch,
sample)), so the draws are the same whatever the batch split, process count or resume point.
"""
from __future__ import annotations

import random

import torch

from library.errors import ModelError

POS_EMBED_MAX_RATIO = 1.5  # sd-scripts' MMDiT.POS_EMBED_MAX_RATIO: the table is 1.5 x the latent
SCALED_BASE_SIZE = 16  # sd-scripts' base_size: the centre spans the positions of 16 patches


def sincos_table(dim: int, positions: torch.Tensor) -> torch.Tensor:
    """(n^2, dim) float32 table of the n x n grid whose rows and columns sit at ``positions``
    (n,), computed in float64: per patch (row r, column c) sin | cos of position[c] x omega in the
    first half, of position[r] in the second, omega_k = 10000^(-k / (dim / 4))."""
    n = positions.shape[0]
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    one = torch.outer(positions.to(torch.float64), omega)
    one = torch.cat([one.sin(), one.cos()], dim=1)  # (n, dim/2)
    w_part = one.repeat(n, 1)  # index r * n + c -> c
    h_part = one.repeat_interleave(n, dim=0)  # -> r
    return torch.cat([w_part, h_part], dim=1).float()


def scaled_table(dim: int, grid: int, sample_size: int, base_size: int = SCALED_BASE_SIZE) -> torch.Tensor:
    """sd-scripts' get_scaled_2d_sincos_pos_embed(dim, grid, sample_size=s, base_size=16):
    positions (i - (grid - s) / 2) x base_size / s, i = 0 .. grid - 1."""
    i = torch.arange(grid, dtype=torch.float64)
    return sincos_table(dim, (i - (grid - sample_size) / 2) * (base_size / sample_size))


class ScaledPosEmbed:
    """enable_scaled_pos_embed's tables for the given patched latent sizes (module docstring);
    each is computed once per device and dtype."""

    def __init__(self, dim: int, patched_sizes):
        sizes = sorted(set(int(s) for s in patched_sizes))
        if not sizes or sizes[0] < 1:
            raise ModelError(f"enable_scaled_pos_embed: no usable latent size in {patched_sizes}")
        self.dim = dim
        self.sizes = sizes
        self.limits = [(a * a + b * b) // 2 for a, b in zip(sizes, sizes[1:])]
        self.limits.append(int((sizes[-1] * POS_EMBED_MAX_RATIO) ** 2))
        self._tables: dict = {}

    def size_for(self, h: int, w: int) -> int:
        """The patched size whose table a latent of h x w patches takes."""
        size = next((s for s, limit in zip(self.sizes, self.limits) if h * w <= limit), self.sizes[-1])
        if max(h, w) > self.grid(size):
            size = max(h, w)  # a table of its own (sd-scripts' "too tall or wide")
        return size

    @staticmethod
    def grid(size: int) -> int:
        return int(size * POS_EMBED_MAX_RATIO)

    def table(self, size: int, device, dtype) -> torch.Tensor:
        """(grid^2, dim) table of patched size ``size``."""
        key = (size, str(device), dtype)
        if key not in self._tables:
            self._tables[key] = scaled_table(self.dim, self.grid(size), size).to(device, dtype)
        return self._tables[key]


def crop_offset(seed: int | None, rate: float, size: int, h: int, w: int) -> tuple[int, int]:
    """(top, left) of an h x w window of a size x size table: the centre, or with probability
    ``rate`` (a draw from random.Random(seed); none for rate 0 or no seed) a uniform offset."""
    centre = ((size - h) // 2, (size - w) // 2)
    if seed is None or rate <= 0:
        return centre
    rng = random.Random(seed)
    if rng.random() >= rate:
        return centre
    return rng.randrange(size - h + 1), rng.randrange(size - w + 1)


def window(table: torch.Tensor, size: int, top: int, left: int, h: int, w: int) -> torch.Tensor:
    """(h * w, dim): the h x w patches of a size x size table (rows of ``size`` patches) at
    (top, left)."""
    return table.reshape(size, size, -1)[top:top + h, left:left + w, :].reshape(h * w, -1)

