"""Atomic writes, the removal of killed writers' temporaries, and sd-scripts' output file names
(the bottom layer: used by data, models, networks and outputs alike)."""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile

from library.errors import UserError

# Temporary names carry the writer's pid, so that a later run can tell the leftovers of a killed
# process (remove_stale_temporaries) from a live writer's files.
TEMP_PATTERN = re.compile(r"^\..+\.sdtk(?P<pid>\d+)\.[^.]+\.(?:tmp|old)$")


def _temp_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.sdtk{os.getpid()}."


class SaveError(UserError, OSError):
    """A file could not be written (disk full, read-only, ...); the previous file is intact.
    Also an OSError, so that callers that handled the OS error before still do."""

    def __init__(self, path: str, reason: str, kind: str = "file"):
        self.path, self.reason, self.kind = path, reason, kind
        super().__init__(f"cannot save {path}: {reason}; the previous {kind}, if any, is unchanged")


def io_failure(e: BaseException, folder: str) -> str | None:
    """The OS reason of a failed write, or None when ``e`` is not an I/O failure. safetensors and
    torch.save do not raise OSError: safetensors names the OS error in its message, torch.save
    only says its write failed, so a full disk is recognised by the free space left (measured
    while the partial file still fills it)."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    m = re.search(r"os error (\d+)", str(e))
    if m:
        return os.strerror(int(m.group(1)))
    if type(e).__name__ in ("SafetensorError", "RuntimeError"):
        with contextlib.suppress(OSError):
            if shutil.disk_usage(folder).free < 1024 * 1024:
                return os.strerror(errno.ENOSPC)
    return None


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
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=folder)
        os.close(fd)
    except OSError as e:
        raise SaveError(path, e.strerror or str(e)) from None
    try:
        yield tmp
        # mkstemp creates 0600; give the file the mode a plain open() would (UIs under another
        # account must be able to read a model).
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as e:
        reason = None if isinstance(e, SaveError) else io_failure(e, folder)
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        if reason is not None:
            raise SaveError(path, reason) from None
        raise


@contextlib.contextmanager
def atomic_dir(path: str):
    """Like atomic_path for a folder: build it under a temp name, then swap it in."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=".tmp", dir=parent)
    except OSError as e:
        raise SaveError(path, e.strerror or str(e), "folder") from None
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700
        old = None
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=".old", dir=parent)
            os.rmdir(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        reason = None if isinstance(e, SaveError) else io_failure(e, parent)
        shutil.rmtree(tmp, ignore_errors=True)
        if reason is not None:
            raise SaveError(path, reason, "folder") from None
        raise


def save_elsewhere(err: SaveError, write, what: str = "the weights were",
                   then: str = "") -> SaveError:
    """After ``err``: write the same weights (``write(path)``; a file, or a folder such as a
    training state) into a new folder under the system temp dir, so that a full or read-only
    output_dir does not lose the run. Returns the error to raise, which says where ``what``
    (subject and verb) went (and ``then``, formatted with ``{rescue}``: e.g. how to resume from
    it), or that this failed too."""
    try:
        folder = tempfile.mkdtemp(prefix="sdtk-rescue-")
    except OSError as e:
        return SaveError(err.path, f"{err.reason}; no rescue copy ({e.strerror or e})", err.kind)
    rescue = os.path.join(folder, os.path.basename(err.path))
    try:
        write(rescue)
    except SaveError as e2:
        shutil.rmtree(folder, ignore_errors=True)
        return SaveError(err.path, f"{err.reason}; a rescue copy in {folder} failed too "
                                   f"({e2.reason})", err.kind)
    return SaveError(err.path, f"{err.reason}; {what} written to {rescue} instead"
                               + then.format(rescue=rescue), err.kind)


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


# -- stale temporaries ---------------------------------------------------------------------------
def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(folder: str, log, alive=pid_alive) -> list[str]:
    """Remove the temporaries of files.atomic_path/atomic_dir whose writer no longer runs."""
    if not os.path.isdir(folder):
        return []
    removed = []
    for entry in sorted(os.listdir(folder)):
        m = TEMP_PATTERN.match(entry)
        if not m or alive(int(m.group("pid"))):
            continue
        path = os.path.join(folder, entry)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except FileNotFoundError:
            continue  # removed meanwhile by another run
        removed.append(entry)
    if removed:
        log.info(f"removed {len(removed)} stale temporary file(s) of killed runs in {folder}: "
                 + ", ".join(removed))
    return removed
