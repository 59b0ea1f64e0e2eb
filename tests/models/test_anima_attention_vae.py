"""Anima's memory options against the plain path on tiny-anima: split_attn (the DiT's
attention per sample) equals the batched attention (float32); vae_chunk_size (every VAE convolution in row
bands, the bands really used) and vae_disable_cache give the unchunked, cached latents and images (float64);
attn_mode's refusals are one line."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from library.models.families.anima import attention, parts, tiny, vae_memory

TOL = 1e-10  # float64: the paths differ only in summation order over a few hundred terms


@pytest.fixture(scope="module")
def model():
    return tiny.build()


def test_split_attn_equals_the_batched_attention(model):
    dit = model["dit"]  # float32: its timestep features are float32 by design (sd-scripts' too)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 8, 12, generator=g)
    sigma = torch.tensor([0.2, 0.5, 0.9])
    ctx = torch.randn(3, 7, dit.config.crossattn_dim, generator=g)
    calls = []
    real = attention.sdpa

    def counting(q, k, v):
        calls.append(q.shape[0])
        return real(q, k, v)

    attention.KERNELS[None] = counting
    try:
        with torch.no_grad():
            whole = dit(x, sigma, ctx)
            attention.configure(dit, None, split=True)
            split = dit(x, sigma, ctx)
    finally:
        attention.KERNELS[None] = real
        attention.configure(dit, None, split=False)
    n = 2 * dit.config.num_blocks  # self- and cross-attention per block
    assert calls == [3] * n + [1] * 3 * n  # batched, then one sample at a time
    # the same kernels on the same rows: at most a different summation order in dot products of
    # 48 keys x 32 channels (a few ulps each), through 2 blocks
    assert (split - whole).abs().max() <= 256 * torch.finfo(torch.float32).eps * whole.abs().max()


def test_attn_mode_kernels_and_refusals():
    assert attention.kernel(None) is None and attention.kernel("torch") is None and attention.kernel("sdpa") is None
    with pytest.raises(attention.AttentionError, match="^attn_mode sageattn: sageattention has no backward pass"):
        attention.kernel("sageattn")
    for mode, package in (("flash", "flash_attn"), ("xformers", "xformers")):
        with pytest.raises(attention.AttentionError, match=f"^attn_mode {mode}: {package}'s kernels run on CUDA only"):
            attention.kernel(mode, cuda=False)


@pytest.fixture
def vae():
    v = tiny.build()["vae"].double()
    yield v
    vae_memory.configure(v, chunk_rows=None, cache=True)


def _band_heights(monkeypatch) -> list[int]:
    """The input heights every Conv2d / Conv3d call sees (after padding)."""
    seen: list[int] = []
    for cls, dim in ((nn.Conv3d, 3), (nn.Conv2d, 2)):
        real = cls._conv_forward

        def spy(self, x, weight, bias, _real=real, _dim=dim):
            seen.append(x.shape[_dim])
            return _real(self, x, weight, bias)

        monkeypatch.setattr(cls, "_conv_forward", spy)
    return seen


def test_vae_chunks_and_no_cache_equal_the_whole_image(vae, monkeypatch):
    g = torch.Generator().manual_seed(1)
    images = torch.rand(2, 3, 64, 48, generator=g, dtype=torch.float64) * 2 - 1
    with torch.no_grad():
        z = parts.encode_images(vae, images)
        x = parts.decode_latents(vae, z)
        seen = _band_heights(monkeypatch)
        vae_memory.configure(vae, chunk_rows=5, cache=True)  # 5 divides none of the heights (64, 32, 16, 8)
        z_chunked = parts.encode_images(vae, images)
        x_chunked = parts.decode_latents(vae, z_chunked)
        assert max(seen) <= 5 + 2 and 66 not in seen  # bands of 5 rows of a 3-row kernel; never the whole image
        vae_memory.configure(vae, chunk_rows=None, cache=False)
        z_nocache = parts.encode_images(vae, images)
        x_nocache = parts.decode_latents(vae, z_nocache)
    assert vae._feat_map is None and vae._enc_feat_map is None  # the cache really was off
    for got in (z_chunked, z_nocache):
        assert (got - z).abs().max() <= TOL * z.abs().max()
    for got in (x_chunked, x_nocache):
        assert (got - x).abs().max() <= TOL * max(float(x.abs().max()), 1.0)
    seen.clear()
    vae_memory.configure(vae, chunk_rows=None, cache=True)
    with torch.no_grad():
        assert torch.equal(parts.encode_images(vae, images), z)  # back to the plain path
    assert 66 in seen  # the first convolution sees the whole padded image again
