"""Text-encoder output cache (``cache_text_encoder_outputs``, ``..._to_disk``).

What is cached is exactly what the training step would compute: ``family_model.encode`` of the
tokenized caption (SD1/SD2: the hidden states after clip skip; SDXL: both encoders' penultimate
hidden states and text_encoder_2's pooled output), under the run's autocast.

Caption augmentation keeps working (beyond sd-scripts, which refuses it): caption dropout uses
one cached encoding of the empty caption, and ``shuffle_caption`` / ``caption_tag_dropout_rate``
use ``text_encoder_cache_variants`` cached variants per caption, one picked per sample and epoch
(``TrainingSet.cached_caption``).

An entry's key is sha256 over the processed caption and the encoder identity (the model's
identity, family, tokenizer vocabularies, dtype, clip_skip, max token length, weighted_captions
and a format version). On disk: ``<image_dir>/.sdcache/te-<key>.safetensors`` (or ``cache_dir``), written
atomically; a file that cannot be read, or holds another key, is recomputed with a warning.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

import torch

from library import safetensors_file
from library.errors import first_line
from library.files import atomic_path, remove_stale_temporaries
from library.models.family import CHUNK, TextConditioning, chunk_count

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


def encoder_identity(bundle, dtype, clip_skip, max_token_length: int | None = None,
                     weighted: bool = False) -> str:
    h = hashlib.sha256()
    # max_tokens: the tokens a caption is encoded to, BOS and EOS included (77, 152 or 227)
    parts = {"v": FORMAT_VERSION, "model": bundle.identity, "family": bundle.family,
             "dtype": str(dtype).replace("torch.", ""), "clip_skip": clip_skip,
             "max_tokens": chunk_count(max_token_length) * CHUNK + 2}
    if weighted:  # "(red:1.2)" encodes differently with weighted_captions; unweighted keys unchanged
        parts["weighted_captions"] = True
    h.update(json.dumps(parts, sort_keys=True).encode())
    for tok in bundle.tokenizers:
        h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    return h.hexdigest()


def text_key(caption: str, identity: str) -> str:
    return hashlib.sha256(json.dumps([identity, caption]).encode()).hexdigest()


def _path(folder: str, key: str) -> str:
    return os.path.join(folder, f"te-{key}.safetensors")


def _load(path: str, key: str):
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            hidden = f.get_tensor("hidden_states")
            pooled = f.get_tensor("pooled") if "pooled" in f.keys() else None
    except Exception as e:  # truncated or garbled file
        raise ValueError(first_line(e)) from None
    if meta.get("sdtk.text_key") != key:
        raise ValueError("it was written for another key")
    if not torch.isfinite(hidden).all():
        raise ValueError("non-finite values")
    return TextConditioning(hidden, pooled)


def _save(path: str, key: str, cond: TextConditioning) -> None:
    tensors = {"hidden_states": cond.hidden_states.contiguous()}
    if cond.pooled is not None:
        tensors["pooled"] = cond.pooled.contiguous()
    with atomic_path(path) as tmp:
        safetensors_file.save(tensors, tmp, metadata={"sdtk.text_key": key})


def encode_captions(family_model, wanted: dict[str, str | None], identity: str, *, clip_skip,
                    batch_size: int, device, autocast, to_disk: bool,
                    log: logging.Logger = logger) -> dict[str, TextConditioning]:
    """``wanted``: caption -> disk folder (None: memory only). -> caption -> (CPU) conditioning
    of one caption (hidden (77, D), or (n*75+2, D) with a long max_token_length; pooled (P,) or
    None). Encodes only what the disk lacks."""
    out: dict[str, TextConditioning] = {}
    missing = []
    loaded = 0
    if to_disk:  # the temporaries of a run killed mid-write (kill -9, SIGTERM while caching)
        for folder in sorted({f for f in wanted.values() if f is not None}):
            remove_stale_temporaries(folder, log)
    for caption, folder in wanted.items():
        key = text_key(caption, identity)
        if to_disk and folder is not None:
            path = _path(folder, key)
            try:
                out[caption] = _load(path, key)
                loaded += 1
                continue
            except FileNotFoundError:
                pass
            except ValueError as e:
                log.warning(f"text-encoder cache entry {path} is unusable ({e}): recomputing")
        missing.append(caption)
    log.info(f"text-encoder cache: {len(wanted)} caption(s)"
             + (f", {loaded} loaded from disk" if to_disk else "") + f", encoding {len(missing)}")
    for start in range(0, len(missing), batch_size):
        chunk = missing[start:start + batch_size]
        tokens = [t.to(device) for t in family_model.tokenize(chunk)]
        with torch.no_grad(), autocast():
            cond = family_model.encode(tokens, clip_skip)
        for j, caption in enumerate(chunk):
            one = TextConditioning(cond.hidden_states[j].detach().cpu().clone(),
                                   None if cond.pooled is None else cond.pooled[j].detach().cpu().clone())
            out[caption] = one
            folder = wanted[caption]
            if to_disk and folder is not None:
                _save(_path(folder, text_key(caption, identity)), text_key(caption, identity), one)
    return out


def stack(entries: list[TextConditioning], device) -> TextConditioning:
    hidden = torch.stack([e.hidden_states for e in entries]).to(device)
    pooled = None
    if entries[0].pooled is not None:
        pooled = torch.stack([e.pooled for e in entries]).to(device)
    return TextConditioning(hidden, pooled)
