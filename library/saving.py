"""Atomic writes and sd-scripts' output file names."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str):
    """Yield a temporary path in the same folder; on success it replaces ``path`` in one rename.

    A crash mid-write leaves the previous file untouched (and at worst a stray temp file).
    """
    folder = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        yield tmp
        # mkstemp creates 0600; give the file the mode a plain open() would (UIs under another
        # account must be able to read a model).
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str):
    """Like atomic_path for a folder: build it under a temp name, then swap it in."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=parent)
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700
        old = None
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".", suffix=".old", dir=parent)
            os.rmdir(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


EXTENSIONS = {"safetensors": ".safetensors", "ckpt": ".ckpt", "pt": ".pt"}


def output_file(output_dir: str, output_name: str, ext: str, *, epoch: int | None = None,
                step: int | None = None) -> str:
    """sd-scripts' names: last file, ``-000001`` per epoch, ``-step00000100`` per step."""
    if epoch is not None:
        name = f"{output_name}-{epoch:06d}"
    elif step is not None:
        name = f"{output_name}-step{step:08d}"
    else:
        name = output_name
    return os.path.join(output_dir, name + ext)
