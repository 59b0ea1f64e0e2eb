"""A run's progress as JSON lines (``progress_file``) and its control channel (``control_file``).

    ProgressStream(path)             one JSON object per line, appended and flushed (main process):
        .event(name, **fields)       {"event": name, "time": <unix seconds>, **fields}
    ControlChannel(path)             the commands appended to ``control_file`` since the last poll
        .poll() -> [command, ...]    one os.stat per call when nothing was added
    write_end(path, status, exit_code, message, state)
                                     the last line, written by the entry point (library/cli.py)

Events (docs/UI.md has the full list with their fields): ``plan``, ``step`` (step, epoch, loss,
lr, grad_norm, samples_seen), ``save``, ``state``, ``samples``, ``validation``, ``nonfinite``,
``control`` (a command taken), ``end`` (status, exit_code, message). Every value comes from what
the step has already read to the host (library/training/step_sync.py): the stream adds no device
read. The web UI (ui.py) follows the file; so can ``tail -f`` in a shell.

Commands: ``save_now`` (the model, and a state when save_state is set, after this step),
``sample_now`` (the sample images of this step's weights), ``stop`` (a resumable state after this
step, then exit 130, as SIGINT). A line is JSON ``{"command": ...}`` or the bare word. The
main process reads the file at each step's start; with several processes the step's read
(step_sync.gather) carries the commands to every process, which all take them after that step.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING

from library.errors import UserError
from library.training.stop_signals import COMMANDS

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")


class ProgressStreamError(UserError):
    pass


class ProgressStream:
    def __init__(self, path: str):
        self.path = path
        try:
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            self._f = open(path, "a", encoding="utf-8")
        except OSError as e:
            raise ProgressStreamError(f"progress_file: cannot write {path}: {e.strerror}") from None

    def event(self, name: str, **fields) -> None:
        self._f.write(json.dumps({"event": name, "time": round(time.time(), 3), **fields},
                                 allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def open_stream(opts: Options, main: bool) -> ProgressStream | None:
    """The run's stream: the main process's, when ``progress_file`` is set."""
    return ProgressStream(opts.progress_file) if main and opts.progress_file else None


def write_end(path: str, status: str, exit_code: int, message: str = "",
              state: str | None = None) -> None:
    """The stream's last line: ``status`` done / stopped (a resumable ``state`` written) /
    interrupted / failed."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": "end", "time": round(time.time(), 3), "status": status,
                                "exit_code": exit_code, "message": message, "state": state}) + "\n")
    except OSError:
        pass  # the exit code says it too; the run's own error line is already printed


def parse_command(line: str) -> str | None:
    line = line.strip()
    if not line:
        return None
    if line.startswith("{"):
        try:
            line = str(json.loads(line).get("command", ""))
        except (ValueError, AttributeError):
            return None
    return line if line in COMMANDS else None


class ControlChannel:
    """Reads ``control_file`` from its start; afterwards only what was appended."""

    def __init__(self, path: str | None):
        self.path = path
        self._offset = 0
        self._size = -1

    def poll(self) -> list[str]:
        if self.path is None:
            return []
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return []
        if size == self._size:
            return []
        self._size = size
        if size < self._offset:  # replaced by a shorter file: read it from the start
            self._offset = 0
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self._offset += end
        self._size = self._offset if end < len(data) else size
        out = []
        for raw in data[:end].decode("utf-8", "replace").splitlines():
            cmd = parse_command(raw)
            if cmd is None:
                if raw.strip():
                    logger.warning(f"control_file {self.path}: ignored line {raw.strip()[:80]!r} "
                                   f"(expected one of: {', '.join(COMMANDS)})")
                continue
            out.append(cmd)
        return out


def control_channel(opts: Options, main: bool) -> ControlChannel:
    """``control_file``, read by the main process only: the commands it reads go into the step's
    read, which every process agrees on (library/training/step_sync.py), so that all processes
    save, sample or stop after the same step; the others hold an empty channel."""
    return ControlChannel(opts.control_file if main else None)
