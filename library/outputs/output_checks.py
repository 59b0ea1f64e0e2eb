"""The folders a run writes, checked before any weight loads; stale temporaries; the output lock.

- ``check_paths``: output_dir, cache_dir and logging_dir are folders that can be created and
  written (a probe file is written and removed), output_name is a plain file name.
- ``check_free_space``: output_dir has room for what one save writes at once (the model file or
  network, plus a training state with save_state), sized from the run's parameter counts.
- stale temporaries (``library.files.remove_stale_temporaries``): the temporary files and folders
  of ``atomic_path`` / ``atomic_dir`` carry the writer's pid; those of a process that no longer
  runs (killed mid-save) are removed.
- ``OutputLock``: ``<output_dir>/.<output_name>.lock`` holds the pid of the run writing those
  files; a second run is refused while that process lives, a dead one's lock is taken over.
- ``prepare``: all of these, in a run's order, before any weight loads.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from typing import TYPE_CHECKING

from library.config.parse import required
from library.errors import UserError
from library.files import pid_alive, remove_stale_temporaries
from library.models import loading

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options


class OutputPathError(UserError):
    """A folder the run would write is not usable (a file, read-only, full), or a bad name."""


class OutputLocked(UserError):
    """Another live run writes the same output_dir/output_name."""


GIB = 1024 ** 3


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 1024 ** 2:.1f} MiB"


# -- folders and names ---------------------------------------------------------------------------
def check_name(output_name) -> None:
    if not output_name or not str(output_name).strip():
        raise OutputPathError("output_name: must not be empty (it names the saved files, "
                              "e.g. --output_name my_lora)")
    seps = [s for s in (os.sep, os.altsep, "/") if s and s in output_name]
    if seps or output_name in (".", ".."):
        raise OutputPathError(f"output_name: {output_name!r} must be a file name without a folder "
                              "(put the folder in output_dir)")


def check_folder(option: str, path: str) -> str:
    """``path`` as a folder this process can write: created if missing, probed with a file."""
    p = os.path.abspath(os.path.expanduser(path))
    if os.path.lexists(p) and not os.path.isdir(p):
        what = "a broken symlink" if os.path.islink(p) and not os.path.exists(p) else "a file"
        raise OutputPathError(f"{option}: {path} is {what}, not a folder")
    try:
        os.makedirs(p, exist_ok=True)
    except OSError as e:
        raise OutputPathError(f"{option}: cannot create the folder {path} "
                              f"({e.strerror or e}{_at(e, p)})") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".sdtk-write-probe-", dir=p)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise OutputPathError(f"{option}: the folder {path} is not writable ({e.strerror or e})") from None
    return p


def _at(e: OSError, p: str) -> str:
    # makedirs fails on the first component that is a file or unwritable: name it when not p
    return f": {e.filename}" if e.filename and os.path.abspath(str(e.filename)) != p else ""


def check_paths(opts: Options) -> None:
    """Every folder the run writes, and the output name (run() calls this before loading)."""
    check_name(opts.output_name)
    for option in ("output_dir", "cache_dir", "logging_dir"):
        value = getattr(opts, option)
        if value:
            check_folder(option, value)


# -- free space ----------------------------------------------------------------------------------
def save_bytes(opts: Options, method_name: str) -> tuple[int, str]:
    """(bytes, what) one save writes at once: the model file (or network), its EMA twin, and with
    save_state a state (trained weights in float32, the EMA copy, the optimizer state). From the
    run's parameter counts (memory_estimate.saved_parameters: the model built on fake tensors)."""
    # lazy: the path checks run before torch is imported
    from library.training import memory_estimate

    saved, trained_shapes = memory_estimate.saved_parameters(opts, method_name)
    dtype_bytes = memory_estimate.save_dtype_bytes(opts)
    model = saved * dtype_bytes
    ema = bool(opts.ema_decay)
    total, parts = model * (2 if ema else 1), [f"model {_size(model)}" + (" x2 with its EMA" if ema else "")]
    if opts.save_state or opts.save_state_on_train_end:
        rule = memory_estimate.optimizer_rule(opts)
        n = sum(_numel(s) for s in trained_shapes)
        state = n * 4 * (2 if ema else 1) + sum(rule.param_bytes(s) for s in trained_shapes)
        # the counts are of the tensors only: the generator, info (loss log, config) and step
        # counter files add to it (measured on tiny-sd15 LoRA with AdamW: 1.3x)
        state = int(state * 1.3)
        total += state
        parts.append(f"state {_size(state)}")
    return total + 1024 * 1024, " + ".join(parts)  # + headers and metadata


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def disk_free(path: str) -> int:
    return shutil.disk_usage(path).free


# float32 bytes of the built-in tiny models' full weights (measured: 16.4, 17.1, 34.4 MiB), rounded up
TINY_MODEL_BYTES = 40 * 1024 ** 2
# what one save can write, in units of the base model's float32 size: the model (a LoRA is smaller
# unless its rank exceeds half the layers' widths), its EMA twin, a state's float32 weights and
# their EMA, and up to four float32 optimizer values per parameter (Prodigy), with room to spare
SAVE_BOUND_FACTOR = 10


def quick_upper_bound(opts: Options) -> int | None:
    """A bound on ``save_bytes`` from the size of the model on disk, without building anything
    (None when unknown: the full-size built-ins, hub ids). A file holds at least one byte per
    parameter (fp8), so four times its size bounds its float32 size."""
    src = loading.resolve_model_source(required(opts.pretrained_model_name_or_path,
                                                "pretrained_model_name_or_path"))
    if src.kind == "builtin":
        tiny = src.location in loading.TINY_BUILTINS or src.location in loading.FLOW_BUILTINS
        base = TINY_MODEL_BYTES if tiny else None
    elif src.kind == "single_file":
        base = 4 * os.path.getsize(src.location)
    elif src.kind == "diffusers":
        base = 4 * sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(src.location)
                       for f in files if f.endswith(loading.WEIGHT_SUFFIXES))
    else:
        base = None
    return None if base is None else SAVE_BOUND_FACTOR * base + 64 * 1024 ** 2


def check_free_space(opts: Options, method_name: str, log) -> None:
    """output_dir has room for one save; the previous file stays until the new one is complete,
    so an overwrite needs the full size too. An estimate that cannot be made is logged, not fatal.
    When the free space exceeds a bound from the model's size on disk, the exact count (which
    builds the model on fake tensors, a second or more) is not needed."""
    # lazy: the path checks run before torch is imported
    from library.training.memory_estimate import EstimateUnavailable

    have = disk_free(os.path.abspath(os.path.expanduser(required(opts.output_dir, "output_dir"))))
    bound = quick_upper_bound(opts)
    if bound is not None and have > bound:
        return
    try:
        need, what = save_bytes(opts, method_name)
    except EstimateUnavailable as e:
        log.info(f"output_dir free space not checked: {e}")
        return
    except UserError:
        raise  # e.g. a model path that does not exist: the same line the loader would give
    except Exception as e:  # noqa: BLE001 - an odd model config: the loader says what is wrong
        log.info(f"output_dir free space not checked: the model's size is unknown "
                 f"({type(e).__name__})")
        return
    if need > have:
        raise OutputPathError(f"output_dir {opts.output_dir}: not enough free space: a save writes "
                              f"{_size(need)} at once ({what}), {_size(have)} is free")


# -- the lock ------------------------------------------------------------------------------------
def lock_path(output_dir: str, output_name: str) -> str:
    return os.path.join(output_dir, f".{output_name}.lock")


class OutputLock:
    """Held by the main process while a run writes ``output_dir/output_name*``."""

    def __init__(self, output_dir: str, output_name: str, log, alive=pid_alive):
        self.path = lock_path(output_dir, output_name)
        self.output_name, self.log, self.alive = output_name, log, alive
        self.held = False

    def __enter__(self):
        mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        for _ in range(3):  # another run may take over or release between our attempts
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(mine)
            self.held = True
            return self
        raise OutputLocked(f"output_dir: cannot take the lock {self.path} (other runs keep taking it)")

    def _take_over_if_stale(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                other = json.load(f)
            pid, host = int(other["pid"]), str(other.get("host", ""))
        except FileNotFoundError:
            return  # released meanwhile: try again
        except (OSError, ValueError, KeyError, TypeError):
            pid, host = None, ""  # unreadable (a writer killed between open and write): stale
        here = socket.gethostname()
        if pid is not None and pid != os.getpid():
            if host and host != here:
                raise OutputLocked(f"output_dir: {self.output_name} is being written by process {pid} "
                                   f"on {host} (lock {self.path}); wait for it, choose another "
                                   "output_name, or remove the lock if that run is gone")
            if self.alive(pid):
                since = time.strftime("%H:%M:%S", time.localtime(float(other.get("started", 0))))
                raise OutputLocked(f"output_dir: {self.output_name} is being written by another run, "
                                   f"process {pid} (since {since}; lock {self.path}); wait for it "
                                   "or choose another output_dir/output_name")
            self.log.warning(f"output lock {self.path} of process {pid}, which no longer runs: taken over")
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def __exit__(self, *exc):
        if self.held:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
            self.held = False
        return False


def prepare(opts: Options, method_name: str, main: bool, log):
    """The folders the run writes (every process: each writes caches or shards), then on the main
    process only the free space, stale temporaries and the output lock (returned, to hold)."""
    check_paths(opts)
    if not main or not opts.output_dir:
        return contextlib.nullcontext()
    check_free_space(opts, method_name, log)
    remove_stale_temporaries(opts.output_dir, log)
    return OutputLock(opts.output_dir, opts.output_name, log)
