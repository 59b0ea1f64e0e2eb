"""The cache stage of a run: latents and text-encoder outputs computed once before training.

    latents(opts, tset, acc, b) -> (entries, latent_key)   every image (and its mirror under flip_aug)
    text(opts, tset, acc, b, family_model, placement, frozen_only) -> {caption: output}
                                                      every caption variant, and validation's
                                                      (frozen_only: the frozen encoders' part)
    cached_captions(tset) -> {caption: disk folder}   the captions ``text`` encodes (the memory
                                                      estimate counts them too)

Latents are kept in memory, and with cache_latents_to_disk also on disk: unchanged entries are
loaded without the VAE, and the missing ones are split across processes (library/data/latent_cache.py).
The text-encoder outputs likewise (library/data/text_cache.py). The trainer's cache stage returns the
results as the run's ``caches`` (library/run/run_state.py).
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from library.data import held_out, latent_cache, text_cache
from library.data.latent_cache import latent_slot
from library.models.loading import path_identity

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")


def latents(opts: Options, tset, acc, b) -> tuple[dict, dict]:
    """The latent cache of ``tset``'s images, encoded by the bundle ``b``'s VAE (the processes of
    ``acc`` split it) -> (entries, latent-cache key of each (item, flip) slot)."""
    items = tset.train_items + tset.reg_items
    vae = b.vae
    entries = latent_cache.encode_latents(
        vae, items, batch_size=max(1, opts.vae_batch_size), dtype=vae.dtype,
        device=acc.device, vae_identity=b.vae_identity, log=logger,
        to_disk=opts.cache_latents_to_disk, processes=latent_cache.ProcessShare.of(acc))
    # Keys hash the image bytes: compute each once, not per step. Looked up by what tells
    # two items apart (one image may be in two datasets at different sizes) and the flip.
    key = {latent_slot(it, flipped): latent_cache.item_cache_key(it, flipped, b.vae_identity, vae.dtype)
           for it in items for flipped in ((False, True) if it.flip_aug else (False,))}
    return entries, key


def text(opts: Options, tset, acc, b, family_model, placement, frozen_only: bool = False) -> dict:
    """The text-encoder outputs of every caption variant of ``tset`` (and validation's
    captions), encoded by ``family_model`` in the text encoders' dtype of ``placement``;
    ``frozen_only``: a partial cache, the part of the frozen encoders (library/data/text_cache.py)."""
    wanted = cached_captions(tset)
    identity = text_identity(opts, b, family_model, placement, frozen_only)
    return text_cache.encode_captions(
        family_model, wanted, identity, clip_skip=opts.clip_skip,
        batch_size=opts.text_encoder_batch_size or max(1, opts.vae_batch_size), device=acc.device,
        autocast=acc.autocast,
        to_disk=opts.cache_text_encoder_outputs_to_disk, frozen_only=frozen_only, log=logger)


def cached_captions(tset) -> dict:
    """caption -> disk folder of every caption the text-encoder cache holds: each variant of each
    training and regularisation item's caption, the empty caption where caption dropout uses it,
    and the validation items' captions."""
    wanted: dict = {}
    for it in tset.train_items + tset.reg_items:
        folder = latent_cache.cache_folder(it)
        for cap in tset.caption_variants(it) + ([""] if tset.uses_empty_caption(it) else []):
            wanted.setdefault(cap, folder)
    for it in tset.val_items:  # the validation loss reads its captions from the cache too
        wanted.setdefault(held_out.caption(it), latent_cache.cache_folder(it))
    return wanted


def text_identity(opts: Options, b, family_model, placement, frozen_only: bool = False) -> str:
    """The encoder part of the text-encoder cache's keys (text_cache.encoder_identity)."""
    # float8 with fp8_base: its outputs differ; a partial cache's: the frozen encoder's dtype (an
    # SD3 model without T5 caches zeros: the first encoder's, as a full cache's key)
    held = [i for i in family_model.partial_cache_encoders if i < len(placement.text_encoders)]
    te_dtype = placement.text_encoders[held[0] if frozen_only and held else 0]
    # a partial cache of a separate t5xxl file's outputs does not depend on the main model file
    # (another transformer or fine-tune over the same T5 reuses it)
    return text_cache.encoder_identity(b, te_dtype, opts.clip_skip, opts.max_token_length,
                                       weighted=opts.weighted_captions,
                                       extra=_family_parts(opts, family_model, frozen_only),
                                       with_model=not (frozen_only and opts.t5xxl))


def _family_parts(opts: Options, family_model, frozen_only: bool = False) -> dict:
    """The family model's own key parts and the identities of separate text-encoder files
    (FLUX.1 / SD3's clip_l, clip_g, t5xxl: another T5 file is another encoding). A partial
    cache's key names the encoders it holds (its entries are not a full cache's) and leaves out
    the trained CLIP files: what trains never decides whether the frozen part is reused."""
    parts = dict(family_model.cache_identity(partial=True) if frozen_only else family_model.cache_identity())
    names = ("t5xxl",) if frozen_only else ("clip_l", "clip_g", "t5xxl")
    if frozen_only:
        parts["cached_encoders"] = list(family_model.partial_cache_encoders)
    for name in names:
        value = getattr(opts, name)
        if value:
            parts[name] = path_identity(os.path.expanduser(value))
    return parts
