"""vae_chunk_size / vae_disable_cache (sd-scripts' Anima options) on diffusers' Qwen-Image VAE
(``AutoencoderKLQwenImage``), for latent caching and sample decoding alike.

- ``chunk_rows``: every convolution of the VAE (its causal 3-D ones and the 2-D ones of the
  resamplers) computes its output in bands of that many rows: each band convolves only the padded
  input rows it reads (rows y0 s ... (y1 - 1) s + k of a kernel k, stride s), so the result is the
  whole convolution's, with one band's input live at a time instead of the image's.
- ``cache = False``: the encoder and decoder run without the causal feature cache (the frames
  before the current one). An image is one frame, whose cache is empty anyway: the latents are
  the same (sd-scripts' warning "differs from official behavior" concerns videos).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from library.models.families.anima.model import AnimaModelError


def _banded(conv, xp: torch.Tensor, dim: int, kernel: int, stride: int, rows: int) -> torch.Tensor:
    """``conv`` (no padding) over the padded ``xp`` in bands of ``rows`` output rows along ``dim``."""
    out_h = (xp.shape[dim] - kernel) // stride + 1
    if out_h <= rows:
        return conv(xp)
    out = None
    for y0 in range(0, out_h, rows):
        y1 = min(y0 + rows, out_h)
        band = conv(xp.narrow(dim, y0 * stride, (y1 - 1 - y0) * stride + kernel))
        if out is None:
            shape = list(band.shape)
            shape[dim] = out_h
            out = band.new_empty(shape)
        out.narrow(dim, y0, y1 - y0).copy_(band)
    return out


class ChunkedConv2d(nn.Conv2d):
    """nn.Conv2d whose forward runs in row bands when ``chunk_rows`` is set (zero padding only)."""

    chunk_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.chunk_rows:
            return super().forward(x)
        ph, pw = self.padding  # a tuple: configure refuses "same" / "valid"
        xp = F.pad(x, (pw, pw, ph, ph))
        return _banded(lambda t: F.conv2d(t, self.weight, self.bias, self.stride, 0, self.dilation, self.groups),
                       xp, 2, self.kernel_size[0], self.stride[0], self.chunk_rows)


@functools.cache
def _chunked_causal_class():
    # lazy: diffusers' model classes load slowly (parts.py imports them on first use too)
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    class ChunkedCausalConv3d(QwenImageCausalConv3d):
        """diffusers' causal Conv3d (time padding in front, the cached frames prepended) in row bands."""

        chunk_rows: int | None = None

        def forward(self, x, cache_x=None):
            if not self.chunk_rows:
                return super().forward(x, cache_x)
            padding = list(self._padding)
            if cache_x is not None and self._padding[4] > 0:
                x = torch.cat([cache_x.to(x.device), x], dim=2)
                padding[4] -= cache_x.shape[2]
            return _banded(lambda t: nn.Conv3d.forward(self, t), F.pad(x, padding), 3, self.kernel_size[1],
                           self.stride[1], self.chunk_rows)

    return QwenImageCausalConv3d, ChunkedCausalConv3d


def _no_cache(vae) -> None:
    """clear_cache's replacement: no feature maps, so every convolution sees its frame alone."""
    vae._conv_idx, vae._enc_conv_idx = [0], [0]
    vae._feat_map = vae._enc_feat_map = None


def configure(vae, *, chunk_rows: int | None, cache: bool = True) -> None:
    """Set the VAE's convolutions' row bands (None: whole images) and its feature cache."""
    causal, chunked = _chunked_causal_class()
    for m in vae.modules():
        if isinstance(m, causal):
            m.__class__ = chunked
        elif type(m) is nn.Conv2d:
            if isinstance(m.padding, str) or m.padding_mode != "zeros" or m.dilation != (1, 1):
                raise AnimaModelError(f"vae_chunk_size: the VAE has a Conv2d this chunking does not cover ({m})")
            m.__class__ = ChunkedConv2d
        if isinstance(m, (chunked, ChunkedConv2d)):
            m.chunk_rows = chunk_rows
    if not cache:
        vae.clear_cache = functools.partial(_no_cache, vae)
    elif "clear_cache" in vae.__dict__:
        del vae.clear_cache
