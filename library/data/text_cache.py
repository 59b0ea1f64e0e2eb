"""Text-encoder output cache (``cache_text_encoder_outputs``, ``..._to_disk``).

What is cached is exactly what the training step would compute: ``family_model.encode`` of the
tokenized caption (SD1/SD2: the hidden states after clip skip; SDXL: both encoders' penultimate
hidden states and text_encoder_2's pooled output; FLUX.1: T5's states, CLIP-L's pooled output and
the T5 attention mask; SD3: the MMDiT's context, CLIP-L|G and T5, and the pooled CLIP-L|G), under
the run's autocast: one tensor per field of the family model's ``conditioning_type``.

Partial (FLUX.1 / SD3 while a CLIP encoder trains and T5 does not: sd-scripts' ``is_partial``):
an entry holds only the frozen encoders' part (``family_model.encode_frozen_part``: FLUX.1's T5
states and mask, SD3's context tokens after CLIP's 77), and ``batch`` runs the trained encoders on
the same captions at each step (``encode_with_frozen_part``). Its key names the cached encoders
and leaves out what only the trained ones read (library/data/cache_stage.py).

Caption augmentation keeps working (beyond sd-scripts, which refuses it): caption dropout uses
one cached encoding of the empty caption, and ``shuffle_caption`` / ``caption_tag_dropout_rate``
use ``text_encoder_cache_variants`` cached variants per caption, one picked per sample and epoch
(``TrainingSet.cached_caption``).

An entry's key is sha256 over the processed caption and the encoder identity (the model's
identity, family, tokenizer vocabularies, dtype, clip_skip, max token length, weighted_captions,
a format version, and what the family model adds: FLUX.1 / SD3's T5 length and attention-mask
options, and the separate clip_l / clip_g / t5xxl files' identities). On disk:
``<image_dir>/.sdcache/te-<key>.safetensors`` (or ``cache_dir``), written atomically; a file that
cannot be read, or holds another key, is recomputed with a warning.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

import torch
from safetensors import safe_open

from library import safetensors_file
from library.errors import first_line
from library.files import atomic_path, remove_stale_temporaries
from library.models.family import CHUNK, TextConditioning, chunk_count

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


def encoder_identity(bundle, dtype, clip_skip, max_token_length: int | None = None,
                     weighted: bool = False, extra: dict | None = None, with_model: bool = True) -> str:
    """``extra``: more parts of the key (the family model's cache_identity, the encoder files);
    empty for the SD families, whose keys stay as they were. ``with_model`` False: the model
    source's identity is left out (a partial cache of a separate t5xxl file's outputs, named in
    ``extra``)."""
    h = hashlib.sha256()
    # max_tokens: the tokens a caption is encoded to, BOS and EOS included (77, 152 or 227)
    parts = {"v": FORMAT_VERSION, "model": bundle.identity if with_model else None, "family": bundle.family,
             "dtype": str(dtype).replace("torch.", ""), "clip_skip": clip_skip,
             "max_tokens": chunk_count(max_token_length) * CHUNK + 2}
    if weighted:  # "(red:1.2)" encodes differently with weighted_captions; unweighted keys unchanged
        parts["weighted_captions"] = True
    if extra:
        parts["family_parts"] = extra
    h.update(json.dumps(parts, sort_keys=True).encode())
    for tok in bundle.tokenizers:
        h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    return h.hexdigest()


def text_key(caption: str, identity: str) -> str:
    return hashlib.sha256(json.dumps([identity, caption]).encode()).hexdigest()


def _path(folder: str, key: str) -> str:
    return os.path.join(folder, f"te-{key}.safetensors")


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _load(path: str, key: str, cls=TextConditioning):
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            values = {n: f.get_tensor(n) if n in names else None for n in _fields(cls)}
    except Exception as e:  # truncated or garbled file
        raise ValueError(first_line(e)) from None
    if meta.get("sdtk.text_key") != key:
        raise ValueError("it was written for another key")
    if values["hidden_states"] is None:
        raise ValueError("no hidden_states")
    if not all(torch.isfinite(v).all() for v in values.values() if v is not None and v.is_floating_point()):
        raise ValueError("non-finite values")
    return cls(**values)


def _save(path: str, key: str, cond: TextConditioning) -> None:
    tensors = {n: getattr(cond, n).contiguous() for n in _fields(type(cond)) if getattr(cond, n) is not None}
    with atomic_path(path) as tmp:
        safetensors_file.save(tensors, tmp, metadata={"sdtk.text_key": key})


def encode_captions(family_model, wanted: dict[str, str | None], identity: str, *, clip_skip,
                    batch_size: int, device, autocast, to_disk: bool, frozen_only: bool = False,
                    log: logging.Logger = logger) -> dict[str, TextConditioning]:
    """``wanted``: caption -> disk folder (None: memory only). -> caption -> (CPU) conditioning
    of one caption (hidden (77, D), or (n*75+2, D) with a long max_token_length; pooled (P,) or
    None); ``frozen_only``: the partial cache's part of it. Encodes only what the disk lacks."""
    out: dict[str, TextConditioning] = {}
    cls = family_model.conditioning_type
    missing = []
    loaded = 0
    if to_disk:  # the temporaries of a run killed mid-write (kill -9, SIGTERM while caching)
        for stale in sorted({f for f in wanted.values() if f is not None}):
            remove_stale_temporaries(stale, log)
    for caption, folder in wanted.items():
        key = text_key(caption, identity)
        if to_disk and folder is not None:
            path = _path(folder, key)
            try:
                out[caption] = _load(path, key, cls)
                loaded += 1
                continue
            except FileNotFoundError:
                pass
            except ValueError as e:
                log.warning(f"text-encoder cache entry {path} is unusable ({e}): recomputing")
        missing.append(caption)
    log.info(f"text-encoder cache{' (frozen encoders only)' if frozen_only else ''}: {len(wanted)} caption(s)"
             + (f", {loaded} loaded from disk" if to_disk else "") + f", encoding {len(missing)}")
    for start in range(0, len(missing), batch_size):
        chunk = missing[start:start + batch_size]
        tokens = [t.to(device) for t in family_model.tokenize(chunk)]
        with torch.no_grad(), autocast():
            cond = family_model.encode_frozen_part(tokens) if frozen_only else family_model.encode(tokens, clip_skip)
        for j, caption in enumerate(chunk):
            one = type(cond)(**{n: None if getattr(cond, n) is None else getattr(cond, n)[j].detach().cpu().clone()
                                for n in _fields(type(cond))})
            out[caption] = one
            folder = wanted[caption]
            if to_disk and folder is not None:
                _save(_path(folder, text_key(caption, identity)), text_key(caption, identity), one)
    return out


def stack(entries: list[TextConditioning], device) -> TextConditioning:
    """One batch of cached entries (each field stacked; a field None in the entries stays None)."""
    cls = type(entries[0])
    return cls(**{n: None if getattr(entries[0], n) is None else
                  torch.stack([getattr(e, n) for e in entries]).to(device) for n in _fields(cls)})


def batch(entries: dict, captions: list[str], device, family_model, partial: bool):
    """The conditioning of ``captions`` from the cache ``entries``: stacked; from a partial cache
    the trained encoders run now on the same captions (under the caller's grad mode and
    autocast) and join the cached part."""
    part = stack([entries[c] for c in captions], device)
    if not partial:
        return part
    tokens = [t.to(device) for t in family_model.tokenize(list(captions))]
    return family_model.encode_with_frozen_part(tokens, part)
