"""The Dataset workbench's routes (docs/UI.md, "The dataset API") over library/ui/workbench.py.

    add_routes(app, settings, body, err, check)    ``body``: the app's JSON-object reader; ``err``:
                                            its one-line JSON error response; ``check(text)``: a
                                            train_lora TOML's dry-run check (library/ui/checks.py)

A refused path is 403, a stale caption edit or an existing target 409 (the stale answer carries
the caption's current text and hash), any other user error 422; each ``{"error": "<one line>"}``.
"""
from __future__ import annotations

import asyncio
import functools
import os

from fastapi import Request
from fastapi.responses import FileResponse

from library.errors import UserError
from library.ui import tool_jobs, workbench

UPLOAD_PATH = "/api/dataset/upload"


def add_routes(app, settings, body, err, check) -> None:
    allowed = settings.allowed_paths

    def answer(fn):
        """``fn``'s result, or its UserError as the JSON error of its kind."""
        @functools.wraps(fn)
        async def wrapped(*a, **kw):
            try:
                return await fn(*a, **kw)
            except workbench.Refused as e:
                return err(403, str(e))
            except workbench.Stale as e:
                return err(409, str(e), current=e.current, current_hash=e.current_hash)
            except workbench.Exists as e:
                return err(409, str(e))
            except workbench.Undecodable as e:
                return err(422, str(e), reason=e.reason)
            except UserError as e:
                return err(422, str(e))
        return wrapped

    def run(fn, *a, **kw):
        return asyncio.to_thread(fn, *a, **kw)  # file work off the event loop

    @app.get("/api/fs")
    @answer
    async def browse(path: str = ""):
        return await run(workbench.browse, path or None, allowed)

    @app.get("/api/tools")
    async def list_tools():
        return {"tools": tool_jobs.tools()}

    @app.get("/api/dataset")
    @answer
    async def folder(folder: str = "", ext: str = ".caption", tag: str = "", q: str = ""):
        return await run(workbench.folder_view, folder, allowed, ext, tag, q)

    @app.get("/api/dataset/thumb")
    @answer
    async def thumb(path: str = ""):
        out = await run(workbench.thumbnail, path, allowed, os.path.join(settings.data_dir, "thumbs"))
        return FileResponse(out, media_type="image/jpeg", headers={"cache-control": "no-cache"})

    @app.put("/api/dataset/caption")
    @answer
    async def caption(request: Request):
        d = await body(request)
        return await run(workbench.save_caption, d.get("path"), allowed, d.get("ext", ".caption"),
                         d.get("text"), d.get("base_hash"))

    @app.post("/api/dataset/undo")
    @answer
    async def undo(request: Request):
        d = await body(request)
        r = await run(workbench.undo, d.get("folder"), allowed)
        return {"restored": r.changed, "kept": r.kept, "journal": os.path.basename(r.journal)}

    @app.post("/api/dataset/tags")
    @answer
    async def tags(request: Request):
        d = await body(request)
        r = await run(workbench.bulk_tags, d.get("folder"), allowed, d.get("ext", ".caption"),
                      d.get("op"), d.get("tag"), d.get("new", ""), d.get("images"))
        return {"changed": r.changed, "unchanged": r.unchanged}

    @app.post("/api/dataset/concept")
    @answer
    async def concept(request: Request):
        d = await body(request)
        return {"path": await run(workbench.make_concept, d.get("parent"), allowed, d.get("name"),
                                  d.get("repeats"))}

    @app.post("/api/dataset/repeats")
    @answer
    async def repeats(request: Request):
        d = await body(request)
        return {"path": await run(workbench.set_repeats, d.get("folder"), allowed, d.get("repeats"))}

    @app.put(UPLOAD_PATH)
    @answer
    async def upload(request: Request, folder: str = "", name: str = ""):
        data = await request.body()
        return {"path": await run(workbench.upload, folder, allowed, name, data, settings.max_upload)}

    @app.post("/api/dataset/preview")
    @answer
    async def preview(request: Request):
        d = await body(request)
        text = workbench.preview_config(d.get("folder"), allowed, d.get("ext", ".caption"),
                                        d.get("resolution", 512),
                                        os.path.join(settings.data_dir, "preview"))
        r = await run(check, text)
        if not r["dataset"]:
            return err(422, r["errors"][0]["message"] if r["errors"] else "no dataset")
        return {**r["dataset"], "warnings": r["warnings"]}
