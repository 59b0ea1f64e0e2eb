"""In-memory latent cache (``cache_latents``), keyed by content so a disk cache can reuse the keys.

Decisions (one place each):
- Latents are the posterior **mean** (``latent_dist.mode()``), not ``latent_dist.sample()`` as
  sd-scripts caches. The mean is deterministic, so a cached run, an uncached run, a resumed run
  and a run on another process count see the same latents; the sampling noise of a VAE
  posterior is tiny next to the diffusion noise added afterwards.
- ``encode_pixels`` applies the VAE's ``scaling_factor`` (and ``shift_factor`` when the config
  has one). Cached entries are therefore ready for the U-Net; the trainer calls
  ``encode_pixels`` for uncached batches too, so both paths scale in this one function.
- The key is sha256 over the image file's bytes, the bucket, the resize, the crop mode, the
  flip, the VAE identity, the dtype and a format version: an edited image, another bucket or
  resolution, a flip, another VAE or dtype never hits a stale entry.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

import torch

from library.data import ImageItem
from library.images import load_image, prepare_image

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1


@dataclass
class LatentEntry:
    latents: torch.Tensor  # (C, h, w) float32 on CPU, scaled by the VAE's scaling factor
    original_size: tuple[int, int]  # (h, w)
    crop_top_left: tuple[int, int]  # (top, left), flip applied
    target_size: tuple[int, int]  # (h, w)


# (path, mtime_ns, size) -> sha256: hash each file once per process, rehash when it changes.
_file_hashes: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str) -> str:
    st = os.stat(path)
    memo = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
    digest = _file_hashes.get(memo)
    if digest is None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        digest = _file_hashes[memo] = h.hexdigest()
    return digest


def vae_fingerprint(vae: torch.nn.Module) -> str:
    """A hash of the VAE's config and weights (names, shapes, dtypes and bytes).

    Two loads of the same VAE agree; another VAE file or a half-precision copy does not. Costs
    one pass over the weights (a fraction of a second for the SD VAE's 84M parameters).
    """
    h = hashlib.sha256()
    config = getattr(vae, "config", None)
    if config is not None:
        h.update(json.dumps(dict(config), sort_keys=True, default=str).encode())
    for name, t in sorted(vae.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def cache_key(item: ImageItem | str, bucket: tuple[int, int], resized_size: tuple[int, int],
              flip: bool, vae_identity: str, dtype: torch.dtype | str, crop: str = "center") -> str:
    """Content-addressed key: sha256 of the image bytes' hash and every parameter it depends on.

    ``item`` is an ImageItem or an image path. Only the center crop is cacheable (a random crop
    differs per sample); ``crop`` is in the key so that a later mode cannot collide.
    """
    path = item.path if isinstance(item, ImageItem) else item
    params = {
        "v": CACHE_FORMAT_VERSION,
        "image_sha256": file_sha256(path),
        "bucket": [int(bucket[0]), int(bucket[1])],
        "resized_size": [int(resized_size[0]), int(resized_size[1])],
        "crop": crop,
        "flip": bool(flip),
        "vae": vae_identity,
        "dtype": str(dtype).replace("torch.", ""),
    }
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()


def item_cache_key(item: ImageItem, flip: bool, vae_identity: str, dtype: torch.dtype | str) -> str:
    """``cache_key`` with the item's own bucket and resized size (set by BucketManager.assign)."""
    if item.bucket is None or item.resized_size is None:
        raise ValueError(f"{item.path} has no bucket yet: call BucketManager.assign first")
    return cache_key(item, item.bucket, item.resized_size, flip, vae_identity, dtype)


@torch.no_grad()
def encode_pixels(vae, pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> scaled latents (B, C, H/8, W/8): posterior mean x scaling factor."""
    pixels = pixels.to(device=vae.device, dtype=vae.dtype)
    latents = vae.encode(pixels).latent_dist.mode()
    shift = getattr(vae.config, "shift_factor", None)
    if shift is not None:
        latents = latents - shift
    return latents * vae.config.scaling_factor


def encode_latents(vae, items: list[ImageItem], batch_size: int, dtype: torch.dtype | str,
                   device: torch.device | str, flip: bool = False, log: logging.Logger = logger,
                   vae_identity: str | None = None) -> dict[str, LatentEntry]:
    """Encode every distinct item (center crop) into a dict keyed by ``cache_key``.

    Items must have ``bucket``/``resized_size`` set. Batches hold images of one bucket only.
    With ``flip`` the mirrored variant of each image is cached too (under its own key). The VAE
    is moved to ``device``/``dtype`` and runs under ``torch.no_grad()``. ``vae_identity``
    defaults to ``vae_fingerprint(vae)`` taken after the dtype cast.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if vae.dtype != dtype or vae.device != torch.device(device):
        vae.to(device=device, dtype=dtype)  # only when needed: diffusers warns on every cast
    identity = vae_identity if vae_identity is not None else vae_fingerprint(vae)

    # group distinct images by bucket; sorted for a deterministic batch composition
    by_bucket: dict[tuple, dict[str, ImageItem]] = {}
    for it in items:
        key = item_cache_key(it, False, identity, dtype)
        by_bucket.setdefault((tuple(it.bucket), tuple(it.resized_size)), {}).setdefault(key, it)

    out: dict[str, LatentEntry] = {}
    n_images = sum(len(v) for v in by_bucket.values())
    log.info(f"caching latents of {n_images} image(s) in {len(by_bucket)} bucket(s)"
             + (" with flipped variants" if flip else ""))
    for (bucket, resized), keyed in sorted(by_bucket.items()):
        entries = list(keyed.items())
        for start in range(0, len(entries), batch_size):
            chunk = entries[start:start + batch_size]
            prepared = [prepare_image(load_image(it.path), bucket, resized) for _, it in chunk]
            pixels = torch.stack([p.pixels for p in prepared])
            variants = [(False, pixels)] + ([(True, torch.flip(pixels, dims=[3]))] if flip else [])
            for flipped, batch in variants:
                latents = encode_pixels(vae, batch).float().cpu()
                if not torch.isfinite(latents).all():
                    raise RuntimeError(f"non-finite latents from the VAE for {chunk[0][1].path} "
                                       f"(batch of {len(chunk)}); try --no_half_vae")
                for (key, it), prep, lat in zip(chunk, prepared, latents):
                    top, left = prep.crop_top_left
                    if flipped:
                        left = resized[0] - left - bucket[0]
                        key = item_cache_key(it, True, identity, dtype)
                    out[key] = LatentEntry(latents=lat.clone(), original_size=prep.original_size,
                                           crop_top_left=(top, left), target_size=prep.target_size)
    return out
