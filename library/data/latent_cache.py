"""The latent cache, in memory (``cache_latents``) and on disk (``cache_latents_to_disk``), keyed by content.

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
- On disk an entry is ``<image_dir>/.sdcache/<key>.safetensors`` (or ``cache_dir``): the latents
  plus the key and the size conditioning in the metadata. Reading checks the stored key, the
  shape and finiteness; anything else (truncated, garbled, renamed) is recomputed with a
  warning. Writes go through ``files.atomic_path``. The file name is the key, so no stale file
  can be picked up and two images with the same stem never collide.
- Masked loss: an item with ``alpha_mask`` or a ``mask_path`` caches its mask beside the latents,
  at the latent size (``images.latent_mask``: area average, as the loss would resize it), in
  the same entry (tensor ``mask``). The key then also holds the mask's source: "alpha" (the
  image bytes are already hashed; the colour channels are read uncomposited), or the mask
  file's content hash, so an edited mask recomputes exactly its entries. Items without a mask
  keep the keys they had before masks existed.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from safetensors import safe_open

from library import safetensors_file
from library.data.folders import ImageItem
from library.data.images import latent_mask, load_for_item, prepare_image
from library.errors import NonFiniteStop, first_line
from library.files import atomic_path, remove_stale_temporaries
from library.models.placement import compute_dtype

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1


@dataclass
class LatentEntry:
    latents: torch.Tensor  # (C, h, w) float32 on CPU, scaled by the VAE's scaling factor
    original_size: tuple[int, int]  # (h, w)
    crop_top_left: tuple[int, int]  # (top, left), flip applied
    target_size: tuple[int, int]  # (h, w)
    mask: torch.Tensor | None = None  # (h, w) float32 in [0, 1] at the latent size (masked loss)


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


def mask_source(item) -> str | None:
    """What an item's mask depends on, for the cache key: None (no mask), "alpha", or
    "file:<sha256 of the mask image>"."""
    if item.alpha_mask:
        return "alpha"
    if item.mask_path:
        return "file:" + file_sha256(item.mask_path)
    return None


def cache_key(item: ImageItem | str, bucket: tuple[int, int], resized_size: tuple[int, int],
              flip: bool, vae_identity: str, dtype: torch.dtype | str, crop: str = "center",
              mask: str | None = None) -> str:
    """Content-addressed key: sha256 of the image bytes' hash and every parameter it depends on.

    ``item`` is an ImageItem or an image path. Only the center crop is cacheable (a random crop
    differs per sample); ``crop`` is in the key so that a later mode cannot collide. ``mask``:
    ``mask_source`` of the item (absent from the key when None, so unmasked keys are unchanged).
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
    if mask is not None:
        params["mask"] = mask
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()


def item_cache_key(item: ImageItem, flip: bool, vae_identity: str, dtype: torch.dtype | str) -> str:
    """``cache_key`` with the item's own bucket and resized size (set by BucketManager.assign)."""
    if item.bucket is None or item.resized_size is None:
        raise ValueError(f"{item.path} has no bucket yet: call BucketManager.assign first")
    return cache_key(item, item.bucket, item.resized_size, flip, vae_identity, dtype,
                     mask=mask_source(item))


def vae_dtype(opts: Options) -> torch.dtype:
    """The dtype the VAE encodes in, part of every cache key: float32 with no_half_vae, else the
    mixed-precision dtype. The trainer and tools/cache_latents.py both use it, so keys match."""
    return torch.float32 if opts.no_half_vae else compute_dtype(opts.mixed_precision)


@torch.no_grad()
def encode_pixels(vae, pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> scaled latents (B, C, H/8, W/8): posterior mean x scaling factor."""
    pixels = pixels.to(device=vae.device, dtype=vae.dtype)
    latents = vae.encode(pixels).latent_dist.mode()
    shift = getattr(vae.config, "shift_factor", None)
    if shift is not None:
        latents = latents - shift
    return latents * vae.config.scaling_factor


def cache_folder(item: ImageItem) -> str:
    """Where ``item``'s disk cache entries live: its ``cache_dir`` or ``<image_dir>/.sdcache``."""
    if item.cache_dir:
        return item.cache_dir
    return os.path.join(item.image_dir or os.path.dirname(os.path.abspath(item.path)), ".sdcache")


def entry_path(item: ImageItem, key: str) -> str:
    return os.path.join(cache_folder(item), key + ".safetensors")


def save_entry(path: str, key: str, entry: LatentEntry) -> None:
    """Write one entry atomically (a crash never leaves a half-written file under the key)."""
    meta = {"sdtk.latent_key": key, "sdtk.format": str(CACHE_FORMAT_VERSION),
            "original_size": json.dumps(list(entry.original_size)),
            "crop_top_left": json.dumps(list(entry.crop_top_left)),
            "target_size": json.dumps(list(entry.target_size))}
    tensors = {"latents": entry.latents.contiguous()}
    if entry.mask is not None:
        tensors["mask"] = entry.mask.contiguous()
    with atomic_path(path) as tmp:
        safetensors_file.save(tensors, tmp, metadata=meta)


class CorruptEntry(Exception):
    pass


def load_entry(path: str, key: str, shape: tuple[int, int, int], masked: bool = False) -> LatentEntry:
    """Read and check one entry: the key it was written under, the latent shape, finite values,
    and with ``masked`` a mask of the latent size in [0, 1]. Raises FileNotFoundError when
    absent, CorruptEntry (with the reason) when unusable."""
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            latents = f.get_tensor("latents")
            mask = f.get_tensor("mask").float() if masked else None
        entry = LatentEntry(latents=latents.float(),
                            original_size=tuple(json.loads(meta["original_size"])),
                            crop_top_left=tuple(json.loads(meta["crop_top_left"])),
                            target_size=tuple(json.loads(meta["target_size"])), mask=mask)
    except Exception as e:  # safetensors raises several types for truncated or garbled files
        raise CorruptEntry(first_line(e)) from None
    if meta.get("sdtk.latent_key") != key:
        raise CorruptEntry("it was written for another key")
    if tuple(entry.latents.shape) != tuple(shape):
        raise CorruptEntry(f"latent shape {tuple(entry.latents.shape)}, expected {tuple(shape)}")
    if not torch.isfinite(entry.latents).all():
        raise CorruptEntry("non-finite values")
    if mask is not None and (tuple(mask.shape) != tuple(shape[1:]) or not torch.isfinite(mask).all()
                             or mask.min() < 0 or mask.max() > 1):
        raise CorruptEntry(f"mask of shape {tuple(mask.shape)} or values outside [0, 1]")
    return entry


@dataclass(frozen=True, slots=True)
class ProcessShare:
    """The processes that split a cache between them: this one's ``index`` of ``count``, and
    the ``barrier`` all of them call (None: one process)."""

    index: int = 0
    count: int = 1
    barrier: Callable[[], None] | None = None

    @classmethod
    def of(cls, accelerator) -> "ProcessShare":
        """The processes of an Accelerate ``accelerator``."""
        return cls(accelerator.process_index, accelerator.num_processes, accelerator.wait_for_everyone)


def encode_latents(vae, items: list[ImageItem], batch_size: int, dtype: torch.dtype | str,
                   device: torch.device | str, flip: bool = False, log: logging.Logger = logger,
                   vae_identity: str | None = None, to_disk: bool = False,
                   processes: ProcessShare = ProcessShare()) -> dict[str, LatentEntry]:
    """Encode every distinct item (center crop) into a dict keyed by ``cache_key``.

    Items must have ``bucket``/``resized_size`` set. Batches hold images of one bucket only.
    The mirrored variant is cached too (under its own key) with ``flip`` or for items with
    ``flip_aug``. The VAE is moved to ``device``/``dtype`` and runs under ``torch.no_grad()``.
    ``vae_identity`` defaults to ``vae_fingerprint(vae)`` taken after the dtype cast.

    ``to_disk``: entries are read from ``entry_path`` (``<image_dir>/.sdcache/<key>.safetensors``
    or ``cache_dir``) when present and valid, without running the VAE; missing ones are encoded
    and written atomically; an unreadable, truncated or mismatched file is recomputed with a
    warning naming it. With several ``processes`` (ProcessShare: a barrier all of them call) the
    missing entries are split across processes, each encodes and writes its share, then all
    read the others' files.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if vae.dtype != dtype or vae.device != torch.device(device):
        vae.to(device=device, dtype=dtype)  # only when needed: diffusers warns on every cast
    identity = vae_identity if vae_identity is not None else vae_fingerprint(vae)
    channels = int(getattr(vae.config, "latent_channels", 4))

    wanted: dict[str, tuple[ImageItem, bool]] = {}
    for it in items:
        for flipped in ((False, True) if (flip or it.flip_aug) else (False,)):
            wanted.setdefault(item_cache_key(it, flipped, identity, dtype), (it, flipped))

    def shape_of(it):
        return (channels, it.bucket[1] // 8, it.bucket[0] // 8)

    out: dict[str, LatentEntry] = {}

    def try_load(key) -> bool:
        it, _ = wanted[key]
        path = entry_path(it, key)
        try:
            out[key] = load_entry(path, key, shape_of(it), masked=mask_source(it) is not None)
            return True
        except FileNotFoundError:
            return False
        except CorruptEntry as e:
            log.warning(f"latent cache entry {path} for {it.path} is unusable ({e}): recomputing")
            return False

    if to_disk:  # the temporaries of a run killed mid-write (kill -9, SIGTERM while caching)
        for folder in sorted({cache_folder(it) for it, _ in wanted.values()}):
            remove_stale_temporaries(folder, log)
    missing = [k for k in wanted if not (to_disk and try_load(k))]
    loaded = len(wanted) - len(missing)
    num_processes = processes.count
    # the missing entries split across the processes (on disk only), None: encoded here
    barrier = processes.barrier if to_disk and num_processes > 1 else None
    if barrier is not None:
        barrier()  # every process has listed the missing entries before any is written
        mine = missing[processes.index::num_processes]
    else:
        mine = missing
    n_images = len({wanted[k][0].path for k in mine})
    log.info(f"latent cache: {len(wanted)} entr{'y' if len(wanted) == 1 else 'ies'}"
             + (f", {loaded} loaded from disk" if to_disk else "")
             + f", encoding {len(mine)} ({n_images} image(s))"
             + (f" on this process of {num_processes}" if barrier is not None else ""))
    _encode(vae, [(k, *wanted[k]) for k in mine], batch_size, out, to_disk)
    if barrier is not None:
        barrier()  # every share is on disk
        rest = [k for k in missing if k not in out and not try_load(k)]
        if rest:
            log.warning(f"latent cache: {len(rest)} entr{'y' if len(rest) == 1 else 'ies'} written "
                        "by other processes could not be read: encoding them here")
            _encode(vae, [(k, *wanted[k]) for k in rest], batch_size, out, False)
    return out


def _encode(vae, todo: list, batch_size: int, out: dict, to_disk: bool) -> None:
    """Encode ``todo`` = [(key, item, flipped)] in batches of one bucket and flip into ``out``."""
    groups: dict[tuple, list] = {}
    for key, it, flipped in todo:
        groups.setdefault((tuple(it.bucket), tuple(it.resized_size), flipped), []).append((key, it))
    for (bucket, resized, flipped), entries in sorted(groups.items()):
        for start in range(0, len(entries), batch_size):
            chunk = entries[start:start + batch_size]
            prepared = []
            for _, it in chunk:
                img, mask = load_for_item(it)
                prepared.append(prepare_image(img, bucket, resized, flip=flipped, mask=mask))
            latents = encode_pixels(vae, torch.stack([p.pixels for p in prepared])).float().cpu()
            if not torch.isfinite(latents).all():
                raise NonFiniteStop(f"non-finite latents from the VAE for {chunk[0][1].path} "
                                    f"(batch of {len(chunk)}); try --no_half_vae")
            for (key, it), prep, lat in zip(chunk, prepared, latents):
                mask = None if prep.mask is None else latent_mask(prep.mask, tuple(lat.shape[1:]))
                entry = LatentEntry(latents=lat.clone(), original_size=prep.original_size,
                                    crop_top_left=prep.crop_top_left, target_size=prep.target_size,
                                    mask=mask)
                out[key] = entry
                if to_disk:
                    save_entry(entry_path(it, key), key, entry)



@contextlib.contextmanager
def counting_encodes(vae):
    """Inside: a list that receives the batch size of every ``vae.encode`` call (how many images
    were encoded, for the caching tool's report and the cache tests)."""
    seen: list[int] = []
    real_encode = vae.encode

    def counting(x, *a, **k):
        seen.append(x.shape[0])
        return real_encode(x, *a, **k)

    vae.encode = counting
    try:
        yield seen
    finally:
        del vae.encode


def latent_slot(item, flipped: bool) -> tuple:
    """What tells two latent-cache entries of a run apart: one image may be in two datasets at
    different sizes, each with its flip."""
    return (item.path, tuple(item.bucket), tuple(item.resized_size), bool(flipped),
            bool(item.alpha_mask), item.mask_path)
