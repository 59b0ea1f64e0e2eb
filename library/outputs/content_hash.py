"""Content hashes for the resume check: the model weights and every image and mask of a run.

A training state records, besides the options and the data fingerprint (paths, sizes, captions),
the sha256 of every file the run's result depends on: each weights file of the model (every
weights file of a diffusers folder, or the single file), of ``vae``, ``network_weights`` and
``base_weights``, and each image and mask file. A resume recomputes them and refuses, naming the
file, when one differs: replacing the weights at the same path, or editing an image without
changing its byte size, is then noticed.

Cost. Images and masks are hashed by ``latent_cache.file_sha256``, the hash the latent cache keys
already hold (once per file per process, so a cached run does not hash twice). Model files are
large (SDXL's fp16 weights are ~6.9 GB): they are hashed once, streamed in 16 MiB chunks, and the
digest is remembered by (absolute path, size, mtime_ns) in a small JSON file under the user's
cache folder, ``$SDTK_HASH_CACHE`` or ``$XDG_CACHE_HOME/sdtk/file-hashes.json`` (default
``~/.cache/sdtk/file-hashes.json``), so that it works for read-only model folders. A file
rewritten in place gets a new mtime and is hashed again. When the cache file cannot be written
the digests are kept for this process only. Built-in models (tiny-*, *-arch) are made from code
and a fixed seed: they have no file; hub models are identified by the hub's own revision.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from typing import TYPE_CHECKING

from library.data.latent_cache import file_sha256
from library.errors import ResumeError
from library.files import atomic_path

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")

CHUNK = 16 << 20
WEIGHT_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")

# in-process memo of model-file digests: (abspath, size, mtime_ns) -> sha256
_memo: dict[tuple[str, int, int], str] = {}
_store_problem_logged = False


def cache_path() -> str:
    """Where model-file digests are remembered between runs (see the module docstring)."""
    explicit = os.environ.get("SDTK_HASH_CACHE")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sdtk", "file-hashes.json")


def _load_store(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # absent, unreadable or garbled: hashes are recomputed, the file rewritten


def _save_store(path: str, data: dict) -> None:
    global _store_problem_logged

    try:
        with atomic_path(path) as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f)
    except OSError as e:  # SaveError is one: a read-only home keeps the digests in memory only
        if not _store_problem_logged:
            logger.warning(f"cannot remember model file hashes in {path} ({e}); they are "
                           "recomputed by every run")
            _store_problem_logged = True


def sha256_file(path: str) -> str:
    """sha256 of a (large) file's bytes, streamed; remembered by (path, size, mtime_ns) in this
    process and in the cache file."""
    full = os.path.realpath(path)
    st = os.stat(full)
    key = (full, st.st_size, st.st_mtime_ns)
    digest = _memo.get(key)
    if digest is not None:
        return digest
    store_file = cache_path()
    store = _load_store(store_file)
    entry = store.get(full)
    if isinstance(entry, dict) and entry.get("size") == st.st_size and \
            entry.get("mtime_ns") == st.st_mtime_ns and isinstance(entry.get("sha256"), str):
        digest = entry["sha256"]
    else:
        h = hashlib.sha256()
        with open(full, "rb") as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                h.update(chunk)
        digest = h.hexdigest()
        store = _load_store(store_file)  # another process may have added entries meanwhile
        store[full] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        _save_store(store_file, store)
    _memo[key] = digest
    return digest


def weight_files(path: str) -> list[str]:
    """The weights files a model path stands for: the file itself, or every weights file under a
    (diffusers) folder, sorted (hidden files and folders, e.g. a latent cache, left out)."""
    if not os.path.isdir(path):
        return [path]
    out = []
    for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.lower().endswith(WEIGHT_SUFFIXES) and not name.startswith("."):
                out.append(os.path.join(dirpath, name))
    return out


def model_inputs(opts: Options) -> list[tuple[str, str]]:
    """(role, path) of every weights input of a run: the model (if it is a path), vae,
    network_weights, base_weights."""
    out = []
    model = opts.pretrained_model_name_or_path
    if model and os.path.exists(os.path.expanduser(model)):  # else a built-in name or a hub id
        out.append(("model", os.path.expanduser(model)))
    if opts.vae:
        out.append(("vae", os.path.expanduser(opts.vae)))
    if opts.network_weights:
        out.append(("network_weights", os.path.expanduser(opts.network_weights)))
    for f in opts.base_weights or []:
        out.append(("base_weights", os.path.expanduser(f)))
    return out


def _digest_or_missing(fn, path: str) -> str:
    try:
        return fn(path)
    except OSError as e:
        return f"unreadable: {e.strerror or e}"


def fingerprint(opts: Options, tset) -> list[list[str]]:
    """[role, absolute path, sha256] of every model file, image and mask of the run."""
    out = []
    for role, path in model_inputs(opts):
        for f in weight_files(path):
            out.append([role, os.path.abspath(f), _digest_or_missing(sha256_file, f)])
    for it in list(tset.train_items) + list(tset.reg_items):
        out.append(["image", os.path.abspath(it.path), _digest_or_missing(file_sha256, it.path)])
        mask = it.mask_path
        if mask:
            out.append(["mask", os.path.abspath(mask), _digest_or_missing(file_sha256, mask)])
    return out


_WHAT = {"model": "model weights file", "vae": "vae file", "network_weights": "network_weights file",
         "base_weights": "base_weights file", "image": "image", "mask": "mask file"}


def check(saved: list | None, opts: Options, tset, state: str, log=None) -> None:
    """Raise ResumeError naming the first file whose content differs from the state's record;
    a state written before content hashes were kept resumes with a warning (``log``)."""
    if saved is None:
        if log is not None:
            log.warning(f"resume: the state in {state} was written before content hashes were "
                        "kept: the content of the model weights and images could not be checked "
                        "(only their paths, sizes and captions)")
        return
    if not isinstance(saved, list) or not all(
            isinstance(e, list) and len(e) == 3 and all(isinstance(x, str) for x in e) and
            e[0] in _WHAT for e in saved):
        raise ResumeError(f"resume: {state} is damaged: the content hashes in its state.json "
                          "are not a list of [role, path, sha256]")
    was = {(r, p): h for r, p, h in saved}
    now = fingerprint(opts, tset)
    now_keys = set()
    for role, path, digest in now:
        now_keys.add((role, path))
        old = was.get((role, path))
        if old is None:
            if role in ("image", "mask"):
                continue  # a new image is named by the data check, which runs first
            raise ResumeError(f"resume: {_WHAT[role]} {path} was not part of the run saved in "
                              f"{state}; a resume continues the same run on the same model")
        if old != digest:
            raise ResumeError(f"resume: the content of {_WHAT[role]} {path} changed since the "
                              f"state in {state} was saved (sha256 {old[:12]}..., now "
                              f"{digest[:12]}...); restore it or start a new run")
    for (role, path) in was:
        if (role, path) not in now_keys and role not in ("image", "mask"):
            raise ResumeError(f"resume: {_WHAT[role]} {path} of the run saved in {state} is "
                              "missing now; a resume continues the same run on the same model")


@contextlib.contextmanager
def forgotten():
    """For tests: no in-process memo of model digests inside the block (the cache file stays)."""
    saved = dict(_memo)
    _memo.clear()
    try:
        yield
    finally:
        _memo.clear()
        _memo.update(saved)
