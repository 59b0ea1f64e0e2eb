"""Holds a training process at a chosen step until the test lets it go, so that a test orders two
events (a step of the run, and a command or signal from the test) instead of racing them.

    hold_at(n, until, report_dir=None)
        in this process, at its n-th step collective (library/training/step_sync.gather: once per step
        in every process, after that step's control-file poll, before its stop decision), wait until
        ``until(signals)`` is true (120 s at most); with ``report_dir``, first write this
        process's pid to <report_dir>/waiting (atomically)
    hold_progress_at(n, until)
        the same for a dataset tool (no training steps): after the n-th item of its tqdm bar, the
        bar shown at n; with ``SIGNAL`` it waits until the stop's SIGINT ends it (the tool's own
        KeyboardInterrupt, as for a stop at any other moment)
    SIGNAL / file_exists(path)
        the usual conditions: a SIGINT/SIGTERM reached this process / a file exists
    write_gate_interpreter(path, gates_file) -> path
        an executable "python" for library/ui/jobs.py's Runner (its ``python`` argument): it runs
        the job's entry script (or dataset tool) in process with the holds that ``gates_file``
        (JSON, read when the job starts; the job is known by its log file, <job folder>/log.txt,
        its standard output) lists for that job, ``{"<job id>": [[n, "signal"] | [n, "file", path], ...]}``
        (in every process of an ``accelerate launch``: the launcher starts each through this
        interpreter, ``--no_python``); any other job runs as with the real interpreter

What a hold means for a run of one process: a command written to the control file while it waits
at step n is read at step n + 1's start and taken after step n + 1; a signal that releases it
stops the run after step n (its state is that step's).
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAIT_S = 120


def SIGNAL(signals) -> bool:  # noqa: N802 - a condition, named like the constant it stands for
    return bool(signals is not None and signals.signum)


def file_exists(path: str):
    return lambda signals: os.path.exists(path)


def _wait(until, signals=None) -> None:
    deadline = time.time() + WAIT_S
    while not until(signals) and time.time() < deadline:
        time.sleep(0.01)


def hold_progress_at(n: int, until) -> None:
    from tqdm import std

    real = std.tqdm.__iter__

    def __iter__(self):  # noqa: N807 - tqdm's own method, wrapped
        done = 0
        for item in real(self):
            if done == n:
                self.n = n  # (tqdm's loop updates the shown count only now and then)
                self.refresh()
                _wait(until)
            yield item
            done += 1

    std.tqdm.__iter__ = __iter__


def hold_at(n: int, until, report_dir: str | None = None) -> None:
    from library.training import step_sync

    real, calls = step_sync.gather, []

    def gather(signals, device, loss_sum, **kw):
        calls.append(1)
        if len(calls) == n:
            if report_dir is not None:
                with open(os.path.join(report_dir, "waiting.tmp"), "w") as f:
                    f.write(str(os.getpid()))
                os.replace(os.path.join(report_dir, "waiting.tmp"), os.path.join(report_dir, "waiting"))
            _wait(until, signals)
        return real(signals, device, loss_sum, **kw)

    step_sync.gather = gather


INTERPRETER = """#!{python}
import sys
sys.path.insert(0, {root!r})
from tests.step_gate import run_job
sys.exit(run_job({gates!r}, sys.argv[1:], sys.argv[0]))
"""


def write_gate_interpreter(path: str, gates_file: str) -> str:
    with open(path, "w") as f:
        f.write(INTERPRETER.format(python=sys.executable, root=ROOT, gates=gates_file))
    os.chmod(path, 0o755)
    return path


def _job_id(args: list[str]) -> str | None:
    """The job's id: its log file (the Runner's <job folder>/log.txt is its standard output)."""
    try:
        log = os.readlink("/proc/self/fd/1")
    except OSError:
        return None
    return os.path.basename(os.path.dirname(log)) if os.path.basename(log) == "log.txt" else None


def run_job(gates_file: str, args: list[str], gate: str) -> int:
    """The job's process: ``args`` as the Runner gives them to the interpreter ``gate``."""
    holds = []
    if os.path.exists(gates_file):
        with open(gates_file) as f:
            holds = json.load(f).get(_job_id(args), [])
    if args[0] == "-m" and holds:  # accelerate launch: each process through this interpreter
        script = next(i for i, a in enumerate(args) if a.endswith(".py"))
        args = [*args[:script], "--no_python", gate, *args[script:]]
    if args[0] == "-m" or not holds:
        os.execv(sys.executable, [sys.executable, *args])
    training = "--config" in args  # an entry script; else a dataset tool
    for n, kind, *rest in holds:
        until = SIGNAL if kind == "signal" else file_exists(rest[0])
        (hold_at if training else hold_progress_at)(n, until)
    sys.argv = list(args)
    try:
        runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0
