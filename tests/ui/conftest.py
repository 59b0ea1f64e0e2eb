"""A UI server in process (FastAPI's TestClient) over a job store in the test's folder."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import pytest

from tests.conftest import ROOT
from tests.step_gate import write_gate_interpreter

HOST = "testserver"  # the TestClient's Host


def job_env() -> dict:
    """The jobs' environment: one thread (bit-identical runs), offline, this checkout first."""
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def tiny_config(data: str, out: str, steps: int = 3, **extra) -> str:
    lines = ['pretrained_model_name_or_path = "tiny-sd15"', f'train_data_dir = "{data}"',
             "resolution = 64", f'output_dir = "{out}"', f"max_train_steps = {steps}",
             "cache_latents = true", "network_dim = 4", "learning_rate = 1e-3", "seed = 5"]
    for k, v in extra.items():
        lines.append(f"{k} = {v!r}".replace("'", '"') if isinstance(v, str) else
                     f"{k} = {str(v).lower() if isinstance(v, bool) else v}")
    return "\n".join(lines) + "\n"


def default_sigint() -> None:
    """A job's process inherits how this one treats SIGINT, and a stop is a SIGINT. The real
    server's jobs start with the default (uvicorn catches SIGINT, and a caught signal is reset at
    exec); pytest run as a background job of a non-interactive shell ignores SIGINT, and its jobs
    would ignore a stop until the trainer installs its own handler (a dataset tool: always)."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class UI:
    """``gated``: jobs start through tests/step_gate.py's interpreter, so that ``hold`` can make a
    job wait at a step for the test (a file, or the stop signal) instead of racing it."""

    def __init__(self, tmp, *, token=None, allowed_paths=(), max_body=1 << 20, gated=False):
        from fastapi.testclient import TestClient

        from library.ui.app import Settings, create_app
        from library.ui.jobs import JobStore, Runner

        self.tmp = str(tmp)
        self.db = os.path.join(self.tmp, "jobs.sqlite3")
        self.data_dir = os.path.join(self.tmp, "jobs-files")
        self.gates = os.path.join(self.tmp, "gates.json")
        os.makedirs(self.tmp, exist_ok=True)
        default_sigint()
        python = write_gate_interpreter(os.path.join(self.tmp, "python"), self.gates) if gated \
            else sys.executable
        self.store = JobStore(self.db)
        self.runner = Runner(self.store, self.data_dir, ["cpu"], env=job_env(), python=python)
        self.settings = Settings(data_dir=self.data_dir, token=token, allowed_paths=list(allowed_paths),
                                 allowed_hosts=(HOST,), max_body=max_body)
        self.client = TestClient(create_app(self.settings, self.store, self.runner))

    def hold(self, job_id: int, *holds) -> None:
        """Job ``job_id``, when it starts (a ``gated`` UI), waits at each hold: ``(n, "signal")``
        in its n-th step until the stop signal reaches it, ``(n, "file", path)`` until the file
        exists (tests/step_gate.py)."""
        gates = {}
        if os.path.exists(self.gates):
            with open(self.gates) as f:
                gates = json.load(f)
        gates[str(job_id)] = [list(h) for h in holds]
        with open(self.gates + ".tmp", "w") as f:
            json.dump(gates, f)
        os.replace(self.gates + ".tmp", self.gates)

    def wait(self, job_id: int, until, timeout: float = 180.0) -> dict:
        """Tick the runner until ``until(job view)``; the view."""
        t0 = time.time()
        while True:
            self.runner.tick()
            j = self.client.get(f"/api/jobs/{job_id}").json()
            if until(j):
                return j
            assert time.time() - t0 < timeout, j
            time.sleep(0.1)

    def close(self):
        self.runner.close(stop_jobs=True)
        self.store.close()


@pytest.fixture
def ui(tmp_path):
    u = UI(tmp_path)
    yield u
    u.close()


@pytest.fixture
def gated_ui(tmp_path):
    u = UI(tmp_path, gated=True)
    yield u
    u.close()
