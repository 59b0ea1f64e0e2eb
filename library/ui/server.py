"""``python ui.py``: options, the token, the job store and runner, then uvicorn.

    main(argv) -> exit code
    default_db() -> the job database's default place: $XDG_DATA_HOME/sdtk/jobs.sqlite3
                    (~/.local/share/sdtk/jobs.sqlite3)
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys

from library.errors import UserError
from library.ui.app import LOOPBACK_HOSTS, Settings, create_app
from library.ui.jobs import JobStore, Runner
from library.ui.workbench import MAX_UPLOAD


def default_db() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "sdtk", "jobs.sqlite3")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ui.py", description="The sdtk web UI and job API.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--listen", action="store_true",
                   help="listen on 0.0.0.0 (every interface); a token is then required")
    p.add_argument("--token", default=None, help="the API token (with --listen: generated and "
                   "printed when not given)")
    p.add_argument("--allowed_paths", nargs="+", default=[], metavar="DIR",
                   help="folders a job may read (data, models) and write (outputs); default: any")
    p.add_argument("--db", default=None, help=f"the job database (default {default_db()})")
    p.add_argument("--gpus", default=None, help="comma-separated GPU indices the queue may use "
                   "(default: every CUDA device; none: one job at a time on the CPU)")
    p.add_argument("--max_body", type=int, default=1 << 20, help="request body limit in bytes")
    p.add_argument("--hold", action="store_true", help="start with the queue held: jobs are "
                   "queued but none starts until the queue is released (POST /api/queue)")
    p.add_argument("--max_upload", type=int, default=MAX_UPLOAD,
                   help="size limit in bytes of an image uploaded on the Dataset page")
    return p


def devices(gpus: str | None) -> list[str]:
    if gpus is not None:
        out = [g.strip() for g in gpus.split(",") if g.strip()]
        if not out or not all(g.isdigit() for g in out):
            raise UserError(f"--gpus {gpus!r}: expected comma-separated GPU indices, e.g. 0,1")
        return out
    # lazy: --help and the UI server's start load this module before torch; torch is imported when
    # devices() runs
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [str(i) for i in range(n)] or ["cpu"]


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        # lazy: optional dependency (uvicorn: pip install -e ".[ui]"), imported when used
        import uvicorn

    except ImportError as e:
        print(f"error: the UI needs the ui extra ({e.name} is missing): pip install -e \".[ui]\"",
              file=sys.stderr)
        return 2
    try:
        host = "0.0.0.0" if a.listen else a.host
        loopback = host in LOOPBACK_HOSTS
        token = a.token
        if not loopback and not token:
            token = secrets.token_urlsafe(24)
            print(f"token: {token}  (send 'Authorization: Bearer <token>', or log in on the page)",
                  flush=True)
        for d in a.allowed_paths:
            if not os.path.isdir(d):
                raise UserError(f"--allowed_paths: {d} is not a folder")
        db = a.db or default_db()
        store = JobStore(db)
        data_dir = os.path.splitext(os.path.abspath(db))[0] + "-files"
        runner = Runner(store, data_dir, devices(a.gpus), held=a.hold)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    settings = Settings(data_dir=data_dir, token=token, allowed_paths=list(a.allowed_paths),
                        allowed_hosts=LOOPBACK_HOSTS if loopback else None, max_body=a.max_body,
                        max_upload=a.max_upload)
    app = create_app(settings, store, runner)
    runner.start()
    print(f"sdtk UI: http://{'127.0.0.1' if host == '0.0.0.0' else host}:{a.port}/  (jobs: {db})",
          flush=True)
    try:
        # open event streams end when their job does: do not wait for them on Ctrl-C
        uvicorn.run(app, host=host, port=a.port, log_level="warning", timeout_graceful_shutdown=3)
    finally:
        runner.close(stop_jobs=True)
        store.close()
    return 0
