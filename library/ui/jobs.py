"""The job queue: jobs and their history in SQLite, and the runner that starts them.

    JobStore(path)          the table of jobs (id, script, config snapshot, processes, state, ...)
    Runner(store, data_dir, devices)
        .tick()             reap ended processes, start the next queued job that fits
        .start() / .close() the same every ``poll_s`` in a thread
        .stop(id) / .control(id, command) / .resume(id)
        .held               the queue is held: running jobs go on, no queued job starts

A dataset tool job (library/ui/tool_jobs.py: ``script`` is the tool's path, ``config`` its
argument list) runs ``python <tool> <args>`` the same way, in the same queue.

A job runs as its own process, started from an argument list (never a shell string): the entry
script with ``--config <job folder>/config.toml`` (the TOML snapshotted at enqueue),
``--progress_file`` and ``--control_file`` in the job folder, or ``accelerate launch`` of it for
several processes, in a new session so that stop (SIGINT) reaches every process of the job. Its
output goes to ``<job folder>/log.txt``. Jobs run one at a time per device set: ``devices`` lists
what the queue may use (GPU indices; ["cpu"]: one job at a time on the CPU), a job of N processes
waits for N free devices, first come first served. A job's state is one of STATES; the progress
stream's ``end`` line and the exit code decide how a run ended. A server restart finds a job that
was running ``interrupted`` (its process, if still alive, is sent SIGTERM: it writes a resumable
state and exits); ``resume`` queues it again with ``--resume latest`` when a state exists.
A held queue (``held``, ``ui.py --hold``, ``POST /api/queue``) takes jobs and starts none of them
until it is released: to line up several runs first, or to keep the devices free for a while.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from typing import IO

from library.accelerator import free_port
from library.ui import tool_jobs

logger = logging.getLogger("sdtk")

STATES = ("queued", "running", "stopping", "stopped", "done", "failed", "interrupted")
FINISHED = ("stopped", "done", "failed", "interrupted")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a job's secret options reach its process as the variables their libraries read (huggingface_hub
# HF_TOKEN, wandb WANDB_API_KEY), never through the stored config (library/ui/checks.py snapshot)
SECRET_ENV = {"huggingface_token": "HF_TOKEN", "wandb_api_key": "WANDB_API_KEY"}

_COLUMNS = ("id", "script", "config", "processes", "state", "position", "created", "started",
            "ended", "exit_code", "error", "output_dir", "output_name", "pid", "resume", "devices")


class JobStore:
    """SQLite, one row per job; every call is one transaction (thread-safe behind a lock)."""

    def __init__(self, path: str):
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                "script TEXT NOT NULL, config TEXT NOT NULL, processes INTEGER NOT NULL, "
                "state TEXT NOT NULL, position REAL NOT NULL, created REAL NOT NULL, "
                "started REAL, ended REAL, exit_code INTEGER, error TEXT, output_dir TEXT, "
                "output_name TEXT, pid INTEGER, resume INTEGER NOT NULL DEFAULT 0, devices TEXT)")

    def _rows(self, sql: str, args=()) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._db.execute(sql, args).fetchall()]

    def add(self, script: str, config: str, processes: int, output_dir: str, output_name: str) -> int:
        with self._lock:
            pos = self._db.execute("SELECT COALESCE(MAX(position), 0) + 1 FROM jobs").fetchone()[0]
            cur = self._db.execute(
                "INSERT INTO jobs (script, config, processes, state, position, created, output_dir, "
                "output_name) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?)",
                (script, config, processes, pos, time.time(), output_dir, output_name))
            if cur.lastrowid is None:
                raise sqlite3.DatabaseError("the job's INSERT made no row")
            return cur.lastrowid

    def get(self, job_id: int) -> dict | None:
        rows = self._rows("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return rows[0] if rows else None

    def require(self, job_id: int) -> dict:
        """The job, or ValueError (the API answers it as a conflict)."""
        job = self.get(job_id)
        if job is None:
            raise ValueError(f"no job {job_id}")
        return job

    def all(self) -> list[dict]:
        return self._rows("SELECT * FROM jobs ORDER BY id")

    def queued(self) -> list[dict]:
        return self._rows("SELECT * FROM jobs WHERE state = 'queued' ORDER BY position, id")

    def in_state(self, *states) -> list[dict]:
        marks = ",".join("?" * len(states))
        return self._rows(f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY id", states)

    def update(self, job_id: int, **fields) -> None:
        assert set(fields) <= set(_COLUMNS), fields
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*fields.values(), job_id))

    def set_state_if(self, job_id: int, old: tuple, **fields) -> bool:
        """Update only when the job's state is one of ``old`` (atomic); True when it was."""
        sets = ", ".join(f"{k} = ?" for k in fields)
        marks = ",".join("?" * len(old))
        with self._lock:
            cur = self._db.execute(f"UPDATE jobs SET {sets} WHERE id = ? AND state IN ({marks})",
                                   (*fields.values(), job_id, *old))
            return cur.rowcount == 1

    def delete_if(self, job_id: int, states: tuple) -> bool:
        """Drop the job when its state is one of ``states`` (atomic); True when it was."""
        marks = ",".join("?" * len(states))
        with self._lock:
            cur = self._db.execute(f"DELETE FROM jobs WHERE id = ? AND state IN ({marks})",
                                   (job_id, *states))
            return cur.rowcount == 1

    def move(self, job_id: int, index: int) -> None:
        """Put a queued job at ``index`` (0 = next) of the queue."""
        order = [j["id"] for j in self.queued() if j["id"] != job_id]
        order.insert(max(0, min(index, len(order))), job_id)
        with self._lock:
            for i, jid in enumerate(order):
                self._db.execute("UPDATE jobs SET position = ? WHERE id = ?", (i + 1, jid))

    def close(self) -> None:
        with self._lock:
            self._db.close()


def job_dir(data_dir: str, job_id: int) -> str:
    return os.path.join(data_dir, "jobs", str(job_id))


def _alive(pid: int | None, marker: str) -> bool:
    """The process exists and its command line names ``marker`` (the job's own folder)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker.encode() in f.read()
    except OSError:
        return False


def last_error(log_path: str) -> str:
    """The run's one-line error (``error: ...``), else the log's last line."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - 65536))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if line.startswith("error: ") or line.startswith("interrupted by"):
            return line
    return next((ln for ln in reversed(lines) if ln.strip()), "")


def read_end(progress_path: str) -> dict | None:
    """The progress stream's ``end`` line, if the run wrote one."""
    try:
        with open(progress_path, "rb") as f:
            f.seek(max(0, os.path.getsize(progress_path) - 8192))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        return ev if ev.get("event") == "end" else None
    return None


class Runner:
    def __init__(self, store: JobStore, data_dir: str, devices: list[str], *,
                 python: str = sys.executable, poll_s: float = 0.25, env: dict | None = None,
                 held: bool = False):
        self.store, self.data_dir, self.devices = store, data_dir, list(devices)
        self.held = held  # no queued job starts while held (set by the API's /api/queue)
        self.python, self.poll_s = python, poll_s
        self.env = dict(os.environ if env is None else env)
        self.procs: dict[int, tuple[subprocess.Popen, list[str], IO]] = {}  # process, devices, log
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._quit = threading.Event()
        self.recover()

    # -- lifecycle ------------------------------------------------------------------------------
    def recover(self) -> list[int]:
        """At start: a job the store holds as running or stopping belongs to a server that died;
        it is ``interrupted``, and a process of it still running is sent SIGTERM (it writes a
        resumable state and exits)."""
        ids = []
        for job in self.store.in_state("running", "stopping"):
            folder = job_dir(self.data_dir, job["id"])
            if _alive(job["pid"], folder):
                try:
                    os.killpg(job["pid"], signal.SIGTERM)
                except OSError:
                    pass
            self.store.update(job["id"], state="interrupted", ended=time.time(),
                              error="the server stopped while the job was running")
            ids.append(job["id"])
        return ids

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="sdtk-runner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._quit.wait(self.poll_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the queue keeps running; the error is logged
                logger.exception("job runner")

    def close(self, stop_jobs: bool = True) -> None:
        self._quit.set()
        if self._thread is not None:
            self._thread.join()
        if stop_jobs:
            with self._lock:
                for jid, (p, _, _) in list(self.procs.items()):
                    self._signal(p, signal.SIGINT)
                for jid, (p, _, _) in list(self.procs.items()):
                    try:
                        p.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        self._signal(p, signal.SIGKILL)
                        p.wait()
                self.tick(start_new=False)

    # -- the queue -----------------------------------------------------------------------------
    def add(self, script: str, config: str, processes: int, output_dir: str, output_name: str,
            secrets: dict[str, str] | None = None) -> int:
        """Queue a job; its ``secrets`` (SECRET_ENV's options) go to a file of its own (0600, in a
        0700 folder outside the job folders the API serves) read at each start, and removed when
        the job is done or deleted; a stopped or failed job keeps them for its resume."""
        with self._lock:  # the loop's tick cannot start the job before its secrets are written
            jid = self.store.add(script, config, processes, output_dir, output_name)
            if secrets:
                folder = os.path.join(self.data_dir, "secrets")
                os.makedirs(folder, mode=0o700, exist_ok=True)
                path = self._secrets_path(jid)
                fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(secrets, f)
                os.replace(path + ".tmp", path)
            return jid

    def _secrets_path(self, jid: int) -> str:
        return os.path.join(self.data_dir, "secrets", f"{jid}.json")

    def _secret_env(self, jid: int) -> dict[str, str]:
        try:
            with open(self._secrets_path(jid), encoding="utf-8") as f:
                return {SECRET_ENV[k]: v for k, v in json.load(f).items() if k in SECRET_ENV}
        except FileNotFoundError:
            return {}

    def forget_secrets(self, jid: int) -> None:
        try:
            os.remove(self._secrets_path(jid))
        except FileNotFoundError:
            pass

    def tick(self, start_new: bool = True) -> None:
        with self._lock:
            for jid, (p, devs, log) in list(self.procs.items()):
                rc = p.poll()
                if rc is not None:
                    log.close()
                    del self.procs[jid]
                    self._finish(jid, rc)
            if not start_new or self.held:
                return
            busy = {d for _, devs, _ in self.procs.values() for d in devs}
            free = [d for d in self.devices if d not in busy]
            queue = self.store.queued()
            if not queue:
                return
            job = queue[0]  # first come first served: a job waiting for devices holds the queue
            need = len(self.devices) if self.devices == ["cpu"] else job["processes"]
            if self.devices == ["cpu"] and self.procs:
                return
            if len(free) < min(need, len(self.devices)):
                return
            self._launch(job, free[:max(1, min(need, len(free)))])

    def command(self, job: dict) -> list[str]:
        """The argument list of a job's process."""
        if tool_jobs.is_tool(job["script"]):
            return tool_jobs.command(self.python, job["script"], job["config"])[0]
        folder = job_dir(self.data_dir, job["id"])
        script = os.path.join(ROOT, f"{job['script']}.py")  # each entry script is <script>.py
        args = [script, "--config", os.path.join(folder, "config.toml"),
                "--progress_file", os.path.join(folder, "progress.jsonl"),
                "--control_file", os.path.join(folder, "control")]
        # lazy: the server starts without torch (the training state's module imports the strategies)
        from library.outputs import train_state

        if job["resume"] and job["output_dir"] and train_state.list_states(job["output_dir"]):
            args += ["--resume", "latest"]
        if job["processes"] == 1:
            return [self.python, *args]
        launcher = ["--multi_gpu", "--num_processes", str(job["processes"]), "--num_machines", "1",
                    "--dynamo_backend", "no", "--main_process_port", str(free_port())]
        if self.devices == ["cpu"]:
            launcher += ["--mixed_precision", "no"]  # the run's own mixed_precision applies
        return [self.python, "-m", "accelerate.commands.launch", *launcher, *args]

    def _launch(self, job: dict, devs: list[str]) -> None:
        # claimed first: a job deleted or cancelled since the queue was read is not started
        if not self.store.set_state_if(job["id"], ("queued",), state="running", pid=None,
                                       started=time.time(), ended=None, exit_code=None, error=None,
                                       devices=",".join(devs)):
            return
        folder = job_dir(self.data_dir, job["id"])
        env = dict(self.env)
        if devs != ["cpu"]:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devs)
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        env.update(self._secret_env(job["id"]))
        log = None
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "config.toml"), "w", encoding="utf-8") as f:
                f.write(job["config"])
            if os.path.exists(os.path.join(folder, "control")):
                os.remove(os.path.join(folder, "control"))  # commands of an earlier attempt
            log = open(os.path.join(folder, "log.txt"), "ab")
            cwd = tool_jobs.command(self.python, job["script"], job["config"])[1] \
                if tool_jobs.is_tool(job["script"]) else None
            p = subprocess.Popen(self.command(job), stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, start_new_session=True, cwd=cwd)
        except OSError as e:
            if log is not None:
                log.close()
            self.store.update(job["id"], state="failed", error=f"cannot start: {e}", ended=time.time())
            return
        self.procs[job["id"]] = (p, devs, log)
        self.store.update(job["id"], pid=p.pid, resume=0)

    def _finish(self, jid: int, rc: int) -> None:
        job = self.store.get(jid)
        if job is None:
            return
        folder = job_dir(self.data_dir, jid)
        end = read_end(os.path.join(folder, "progress.jsonl")) or {}
        if rc == 0 or end.get("status") == "done":
            # (a launcher that got the stop signal as the run finished may exit non-zero)
            state, error = "done", None
        elif rc in (130, 143) or end.get("status") == "stopped" or job["state"] == "stopping":
            # stopped as asked (SIGINT before training began leaves no state: resume starts anew)
            state, error = "stopped", end.get("message") or last_error(os.path.join(folder, "log.txt"))
        else:
            state = "failed"
            error = last_error(os.path.join(folder, "log.txt")) or end.get("message") or f"exit code {rc}"
        self.store.update(jid, state=state, exit_code=rc, error=error, ended=time.time(), pid=None)
        if state == "done":
            self.forget_secrets(jid)

    # -- requests ------------------------------------------------------------------------------
    @staticmethod
    def _signal(p: subprocess.Popen, sig) -> None:
        try:
            os.killpg(p.pid, sig)  # the job's session: accelerate launch and every process
        except OSError:
            pass

    def stop(self, jid: int) -> str:
        """A running job: SIGINT (as Ctrl-C: a resumable state, exit 130); a queued one is
        dropped from the queue (stopped). Returns the new state, or raises ValueError."""
        with self._lock:
            if jid in self.procs and self.store.set_state_if(jid, ("running",), state="stopping"):
                self._signal(self.procs[jid][0], signal.SIGINT)
                return "stopping"
            if self.store.set_state_if(jid, ("queued",), state="stopped", ended=time.time()):
                return "stopped"
            job = self.store.require(jid)
            raise ValueError(f"job {jid} is {job['state']}: only a queued or running job can be stopped")

    def control(self, jid: int, command: str) -> None:
        """save_now / sample_now: appended to the running job's control file (read by its main
        process; with several processes all take it after the same step)."""
        with self._lock:
            job = self.store.require(jid)
            if job["state"] != "running" or jid not in self.procs:
                raise ValueError(f"job {jid} is {job['state']}: {command} needs a running job")
            if tool_jobs.is_tool(job["script"]):
                raise ValueError(f"job {jid} runs {job['script']}, a dataset tool: it has no {command}")
            with open(os.path.join(job_dir(self.data_dir, jid), "control"), "a", encoding="utf-8") as f:
                f.write(json.dumps({"command": command}) + "\n")

    def resume(self, jid: int) -> None:
        if not self.store.set_state_if(jid, ("stopped", "interrupted", "failed"), state="queued",
                                       resume=1, error=None, exit_code=None):
            job = self.store.require(jid)
            raise ValueError(f"job {jid} is {job['state']}: only a stopped, interrupted or failed "
                             "job can be resumed")
