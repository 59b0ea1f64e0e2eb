"""The JSON API and the pages (FastAPI), over the schema, the checks, the queue and the runner.

    create_app(settings, store, runner) -> FastAPI

Routes (docs/UI.md): GET /api/schema; POST /api/validate, /api/import, /api/login; jobs: POST and
GET /api/jobs, GET /api/jobs/{id}, .../events (server-sent events), .../log, .../files/{name};
POST .../stop, .../save_now, .../sample_now, .../resume, .../move; DELETE /api/jobs/{id}; GET and
POST /api/queue (hold or release the queue). The pages (static/) use only these.

Safety (settings): a token, when set, on every API request (``Authorization: Bearer`` or the
HttpOnly SameSite=Strict cookie that /api/login sets); state-changing requests whose Origin is
another origin, or that a browser marks cross-site, are refused; requests for another Host than
the allowed ones are refused (DNS rebinding of a loopback server); bodies over ``max_body``
bytes are refused; a job's paths must lie inside ``allowed_paths``; files come only from a job's
own output folder.

A job is a training run (``script``, ``config``) or a dataset tool (``tool``, ``args``:
library/ui/tool_jobs.py) in the same queue; the Dataset workbench's routes (/api/fs,
/api/dataset/..., /api/tools) are library/ui/dataset_routes.py, the Generate page's and the
Compare panel's (/api/generate, /api/jobs/{id}/compare, .../images) library/ui/image_routes.py.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import os
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from library.config.options import IMAGE_SCRIPTS, OPTIONS, SECTIONS
from library.errors import UserError
from library.ui import dataset_routes, gui_import, image_routes, paths, tool_jobs, workbench
from library.ui.jobs import FINISHED, JobStore, Runner, job_dir
from library.ui.progress import ProgressReader

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
COOKIE = "sdtk_token"
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class Settings:
    data_dir: str
    token: str | None = None
    allowed_paths: list = field(default_factory=list)
    allowed_hosts: tuple | None = LOOPBACK_HOSTS  # None: any (--listen)
    max_body: int = 1 << 20
    max_upload: int = workbench.MAX_UPLOAD  # an image uploaded to the Dataset page


def _err(status: int, message: str, **extra) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def _json_value(v):
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, float) and v != v:
        return None
    return v


def schema() -> dict:
    """The option table for the scripts the UI runs (train_leco, trained from a prompt file,
    runs from the command line: its own options are left out, and it is not in any "scripts")."""
    return {"scripts": list(IMAGE_SCRIPTS),
            "sections": [{"name": k, "title": v} for k, v in SECTIONS.items()
                         if any(o.section == k and _for_ui(o) for o in OPTIONS)],
            "options": [{"name": o.name, "type": o.type, "default": _json_value(o.default),
                         "help": o.help, "section": o.section,
                         "scripts": [s for s in o.scripts if s in IMAGE_SCRIPTS],
                         "choices": list(o.choices) if o.choices else None,
                         "choices_by_script": ({k: list(v) for k, v in o.choices_by_script.items()}
                                               if o.choices_by_script else None),
                         "min": o.min, "max": o.max, "aliases": list(o.aliases)}
                        for o in OPTIONS if _for_ui(o)]}


def _for_ui(o) -> bool:
    return not o.cli_only and any(s in IMAGE_SCRIPTS for s in o.scripts)


class BodyLimit:
    """Refuses a request body over ``limit`` bytes (413), announced or streamed; ``paths`` gives
    some routes their own limit (uploads)."""

    def __init__(self, app, limit: int, paths: dict | None = None):
        self.app, self.default, self.paths = app, limit, dict(paths or {})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.paths.get(scope.get("path"), self.default)
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                return await _send_413(send, limit)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise _TooLarge()
            return msg

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await _send_413(send, limit)


class _TooLarge(Exception):
    pass


async def _send_413(send, limit: int) -> None:
    body = json.dumps({"error": f"request body over {limit} bytes"}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _checks():
    """library/ui/checks.py, the run's checks (which import torch): loaded by a form's first check."""
    from library.ui import checks  # lazy: the server starts without torch

    return checks


def _host_name(host: str) -> str:
    if host.startswith("["):
        return host[1:host.find("]")]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def create_app(settings: Settings, store: JobStore, runner: Runner) -> FastAPI:
    app = FastAPI(title="sdtk", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=settings.max_body,
                       paths={dataset_routes.UPLOAD_PATH: settings.max_upload})
    readers: dict[int, ProgressReader] = {}
    workbench.prune_thumbnails(os.path.join(settings.data_dir, "thumbs"))

    def authorised(request: Request) -> bool:
        if not settings.token:
            return True
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else request.cookies.get(COOKIE, "")
        return hmac.compare_digest(given.encode(), settings.token.encode())

    @app.middleware("http")
    async def guard(request: Request, call_next):
        host = request.headers.get("host", "")
        if settings.allowed_hosts is not None and _host_name(host) not in settings.allowed_hosts:
            return _err(403, f"host {host!r} refused (the server answers {', '.join(settings.allowed_hosts)})")
        if request.method not in SAFE_METHODS:
            origin = request.headers.get("origin")
            if request.headers.get("sec-fetch-site") == "cross-site" or (
                    origin is not None and origin != f"{request.url.scheme}://{host}"):
                return _err(403, "cross-origin request refused")
        path = request.url.path
        if path.startswith("/api/") and path != "/api/login" and not authorised(request):
            return _err(401, "a token is required (Authorization: Bearer, or log in)")
        return await call_next(request)

    async def body(request: Request) -> dict:
        try:
            data = await request.json()
        except ValueError:
            raise _BadRequest("the body must be a JSON object") from None
        if not isinstance(data, dict):
            raise _BadRequest("the body must be a JSON object")
        return data

    @app.exception_handler(_BadRequest)
    async def bad_request(request, exc):
        return _err(400, str(exc))

    def text_field(data: dict, name: str, default=None) -> str:
        v = data.get(name, default)
        if not isinstance(v, str):
            raise _BadRequest(f"{name}: a string is required")
        return v

    def script_field(data: dict) -> str:
        s = text_field(data, "script", "train_lora")
        if s not in IMAGE_SCRIPTS:
            raise _BadRequest(f"script: unknown script {s!r} (expected one of: {', '.join(IMAGE_SCRIPTS)}; train_leco runs from the command line)")
        return s

    def processes_field(data: dict) -> int:
        n = data.get("processes", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
            raise _BadRequest("processes: an integer from 1 to 64 is required")
        return n

    def job_or_404(job_id: int):
        job = store.get(job_id)
        if job is None:
            raise _NotFound(f"no job {job_id}")
        return job

    @app.exception_handler(_NotFound)
    async def not_found(request, exc):
        return _err(404, str(exc))

    def view(job: dict) -> dict:
        r = readers.get(job["id"])
        if r is None:
            r = readers[job["id"]] = ProgressReader(
                os.path.join(job_dir(settings.data_dir, job["id"]), "progress.jsonl"))
        p = r.update().summary(job["output_dir"])
        if tool_jobs.is_tool(job["script"]):  # a dataset tool: its progress bar in the log
            p.update(tool_jobs.log_progress(os.path.join(job_dir(settings.data_dir, job["id"]), "log.txt")))
            p["run"] = tool_jobs.of_run(job["config"])  # a grid: the run it compares
        return {"id": job["id"], "script": job["script"], "state": job["state"],
                "processes": job["processes"], "created": job["created"], "started": job["started"],
                "ended": job["ended"], "output_dir": job["output_dir"],
                "output_name": job["output_name"], "exit_code": job["exit_code"],
                "error": job["error"], **p}

    # -- pages ---------------------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(os.path.join(STATIC, "index.html"), headers={"cache-control": "no-store"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    # -- API -----------------------------------------------------------------------------------
    @app.post("/api/login")
    async def login(request: Request):
        data = await body(request)
        if not settings.token:
            return {"ok": True, "token_required": False}
        given = text_field(data, "token", "")
        if not hmac.compare_digest(given.encode(), settings.token.encode()):
            return _err(401, "wrong token")
        resp = JSONResponse({"ok": True, "token_required": True})
        resp.set_cookie(COOKIE, settings.token, httponly=True, samesite="strict", path="/")
        return resp

    @app.get("/api/schema")
    def get_schema():
        return schema()

    @app.post("/api/validate")
    async def validate(request: Request):
        data = await body(request)
        script, text = script_field(data), text_field(data, "config")
        processes, memory = processes_field(data), bool(data.get("memory", True))
        return await asyncio.to_thread(_checks().check_config, script, text, processes, memory)

    @app.post("/api/import")
    async def import_(request: Request):
        data = await body(request)
        script, text = script_field(data), text_field(data, "text")
        try:
            config, notes = gui_import.import_config(text, script)
        except UserError as e:
            return _err(422, str(e), errors=[{"option": None, "message": str(e), "suggestion": None}])
        return {"config": config, "notes": notes}

    @app.post("/api/jobs")
    async def create_job(request: Request):
        data = await body(request)
        if "tool" in data:
            return create_tool_job(data)
        script, text, processes = script_field(data), text_field(data, "config"), processes_field(data)
        checks = _checks()
        result = await asyncio.to_thread(checks.check_config, script, text, processes, False)
        if not result["ok"]:
            return JSONResponse({"errors": result["errors"], "warnings": result["warnings"]},
                                status_code=422)
        opts = checks.parse_config(script, text)
        refused = paths.outside_allowed(opts, settings.allowed_paths)
        if refused:
            return JSONResponse({"errors": refused}, status_code=403)
        if runner.devices != ["cpu"] and processes > len(runner.devices):
            return JSONResponse({"errors": [{"option": "processes", "suggestion": None, "message":
                                 f"processes {processes}: the queue has {len(runner.devices)} "
                                 f"device(s) ({', '.join(runner.devices)})"}]}, status_code=422)
        jid = runner.add(script, checks.snapshot(text, opts), processes,
                         os.path.abspath(opts.output_dir), opts.output_name, checks.secrets(opts))
        runner.tick()
        return JSONResponse({"id": jid}, status_code=201)

    def queue_view() -> dict:
        return {"held": runner.held, "queued": [j["id"] for j in store.queued()]}

    @app.get("/api/queue")
    def get_queue():
        return queue_view()

    @app.post("/api/queue")
    async def set_queue(request: Request):
        data = await body(request)
        held = data.get("held")
        if not isinstance(held, bool):
            raise _BadRequest("held: true or false is required")
        runner.held = held
        runner.tick()  # released: the next job starts now
        return queue_view()

    def queue_tool(tool: str, args, output_dir: str = "", extra: dict | None = None,
                   before=None) -> tuple[int, dict]:
        """A tool job queued (the allow-list and the paths checked first; then ``before()``, which
        may write the job's inputs): (201, {"id"}) or (403 / 422, {"errors"})."""
        try:
            config = tool_jobs.check(tool, args, settings.allowed_paths, extra)
            if before is not None:
                before()
        except UserError as e:
            status = 403 if isinstance(e, workbench.Refused) else 422
            return status, {"errors": [{"option": "args", "message": str(e), "suggestion": None}]}
        jid = store.add(tool, config, 1, output_dir, "")
        runner.tick()
        return 201, {"id": jid}

    def create_tool_job(data: dict) -> JSONResponse:
        status, answer = queue_tool(text_field(data, "tool"), data.get("args", []))
        return JSONResponse(answer, status_code=status)

    @app.get("/api/jobs")
    def list_jobs():
        queue = [j["id"] for j in store.queued()]
        out = []
        for j in store.all():
            v = view(j)
            v["queue_index"] = queue.index(j["id"]) if j["id"] in queue else None
            out.append(v)
        return {"jobs": out}

    @app.get("/api/jobs/{job_id}")
    def get_job(job_id: int):
        return view(job_or_404(job_id))

    @app.get("/api/jobs/{job_id}/events")
    async def events(job_id: int, request: Request):
        job_or_404(job_id)
        path = os.path.join(job_dir(settings.data_dir, job_id), "progress.jsonl")
        try:
            start = int(request.headers.get("last-event-id", "0"))
        except ValueError:
            start = 0

        async def stream():
            offset, n, buf = 0, 0, b""
            while True:
                try:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        chunk = f.read()
                except OSError:
                    chunk = b""
                offset += len(chunk)
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    n += 1
                    if n > start and line.strip():
                        yield f"id: {n}\ndata: {line.decode('utf-8', 'replace')}\n\n"
                job = store.get(job_id)
                if job is None or (job["state"] in FINISHED and not chunk):
                    state = job["state"] if job else "deleted"
                    yield f"event: state\ndata: {json.dumps({'state': state})}\n\n"
                    return
                if await request.is_disconnected():
                    return
                await asyncio.sleep(0.25)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"cache-control": "no-store"})

    @app.get("/api/jobs/{job_id}/log")
    def log(job_id: int, lines: int = 200):
        job_or_404(job_id)
        path = os.path.join(job_dir(settings.data_dir, job_id), "log.txt")
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 256 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            text = ""
        # tqdm redraws its bar with carriage returns: keep each line's last state
        tail = [ln.rsplit("\r", 1)[-1] for ln in text.replace("\r\n", "\n").split("\n")]
        return PlainTextResponse("\n".join(tail[-max(1, min(lines, 5000)):]))

    @app.get("/api/jobs/{job_id}/files/{name:path}")
    def files(job_id: int, name: str):
        job = job_or_404(job_id)
        if not job["output_dir"]:  # a dataset tool job: no output folder of its own
            return _err(404, f"job {job_id} has no output folder")
        try:
            path = paths.job_file(job["output_dir"], name)
        except paths.FileRefused as e:
            return _err(403, f"file refused: {e}")
        except FileNotFoundError:
            return _err(404, f"no file {name!r} in job {job_id}'s output folder")
        return FileResponse(path)

    def action(job_id: int, do) -> JSONResponse:
        job_or_404(job_id)
        try:
            do()
        except ValueError as e:
            return _err(409, str(e))
        return JSONResponse(view(job_or_404(job_id)))

    @app.post("/api/jobs/{job_id}/stop")
    def stop(job_id: int):
        return action(job_id, lambda: runner.stop(job_id))

    @app.post("/api/jobs/{job_id}/save_now")
    def save_now(job_id: int):
        return action(job_id, lambda: runner.control(job_id, "save_now"))

    @app.post("/api/jobs/{job_id}/sample_now")
    def sample_now(job_id: int):
        return action(job_id, lambda: runner.control(job_id, "sample_now"))

    @app.post("/api/jobs/{job_id}/resume")
    def resume(job_id: int):
        def do():
            runner.resume(job_id)
            readers.pop(job_id, None)
            runner.tick()
        return action(job_id, do)

    @app.post("/api/jobs/{job_id}/move")
    async def move(job_id: int, request: Request):
        data = await body(request)
        job = job_or_404(job_id)
        index = data.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            raise _BadRequest("index: an integer is required (0 = next in the queue)")
        if job["state"] != "queued":
            return _err(409, f"job {job_id} is {job['state']}: only a queued job can be moved")
        store.move(job_id, index)
        return view(job_or_404(job_id))

    @app.delete("/api/jobs/{job_id}")
    def delete(job_id: int):
        job_or_404(job_id)
        if not store.delete_if(job_id, ("queued",) + FINISHED):
            return _err(409, f"job {job_id} is {job_or_404(job_id)['state']}: stop it first")
        runner.forget_secrets(job_id)
        readers.pop(job_id, None)
        return {"deleted": job_id}

    def check_train_lora(text: str) -> dict:
        return _checks().check_config("train_lora", text, 1, False)

    def run_options(job: dict):
        return _checks().parse_config(job["script"], job["config"])

    dataset_routes.add_routes(app, settings, body, _err, check_train_lora)
    image_routes.add_routes(app, settings, store, body, _err, queue_tool, run_options)
    return app


class _BadRequest(Exception):
    pass


class _NotFound(Exception):
    pass
