"""Holds a training process at a chosen step until the test lets it go, so that a test orders two
events (a step of the run, and a command or signal from the test) instead of racing them.

    hold_at(n, until, report_dir=None)
        in this process, at its n-th step read (library/training/step_sync.agree: once per step in
        every process, after that step's control-file poll, before its stop decision), wait until
        ``until(signals)`` is true (120 s at most); with ``report_dir``, first write this
        process's pid to <report_dir>/waiting (atomically)
    SIGNAL / file_exists(path)
        the usual conditions: a SIGINT/SIGTERM reached this process / a file exists
    write_gate_interpreter(path, gates_file) -> path
        an executable "python" for library/ui/jobs.py's Runner (its ``python`` argument): it runs
        the job's entry script in process with the holds that ``gates_file`` (JSON, read when the
        job starts) lists for that job, ``{"<job id>": [[n, "signal"] | [n, "file", path], ...]}``
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


def hold_at(n: int, until, report_dir: str | None = None) -> None:
    from library.training import step_sync

    real, calls = step_sync.agree, []

    def agree(signals, device, loss_sum, norm=None, **kw):
        calls.append(1)
        if len(calls) == n:
            if report_dir is not None:
                with open(os.path.join(report_dir, "waiting.tmp"), "w") as f:
                    f.write(str(os.getpid()))
                os.replace(os.path.join(report_dir, "waiting.tmp"), os.path.join(report_dir, "waiting"))
            deadline = time.time() + WAIT_S
            while not until(signals) and time.time() < deadline:
                time.sleep(0.01)
        return real(signals, device, loss_sum, norm, **kw)

    step_sync.agree = agree


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


def run_job(gates_file: str, args: list[str], gate: str) -> int:
    """The job's process: ``args`` as the Runner gives them to the interpreter ``gate``."""
    holds = []
    if "--config" in args and os.path.exists(gates_file):
        job_id = os.path.basename(os.path.dirname(args[args.index("--config") + 1]))
        with open(gates_file) as f:
            holds = json.load(f).get(job_id, [])
    if args[0] == "-m" and holds:  # accelerate launch: each process through this interpreter
        script = next(i for i, a in enumerate(args) if a.endswith(".py"))
        args = [*args[:script], "--no_python", gate, *args[script:]]
    if args[0] == "-m" or not holds:
        os.execv(sys.executable, [sys.executable, *args])
    for n, kind, *rest in holds:
        hold_at(n, SIGNAL if kind == "signal" else file_exists(rest[0]))
    sys.argv = list(args)
    try:
        runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0
