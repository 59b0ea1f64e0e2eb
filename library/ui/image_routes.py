"""The Generate page's and the Compare panel's routes (docs/UI.md, "Generate and compare") over
library/ui/image_jobs.py; the jobs are tool jobs in the training queue.

    add_routes(app, settings, store, body, err, queue_tool, run_options)
        ``queue_tool(tool, args, output_dir, extra)``: the app's tool job enqueue (the allow-list,
        the paths check) -> (status, answer); ``run_options(job)``: the Options of a run job's
        config (library/ui/checks.py, off the event loop)

    POST /api/generate {"model", "loras": [{"path", "weight"}], "prompt", "negative_prompt",
                        "seed", "steps", "width", "height", "sampler", "scale", "images", "outdir"}
    POST /api/jobs/{id}/compare {"prompts", "multipliers", "seed", "steps", "width", "height",
                                 "sampler", "scale"}           a finished LoRA run's grid
    GET  /api/jobs/{id}/images   {"images": [{"name", "parameters"}], "grid"}

201 ``{"id", "outdir"}``; a refused path 403, a run that is not finished 409, any other user
error 422, each ``{"error": "<one line>"}``.
"""
from __future__ import annotations

import asyncio
import os

from fastapi import Request
from fastapi.responses import JSONResponse

from library.config import method_kinds
from library.config.options import METHOD_OF_SCRIPT
from library.errors import UserError
from library.ui import image_jobs, tool_jobs, workbench
from library.ui.jobs import FINISHED


def add_routes(app, settings, store, body, err, queue_tool, run_options) -> None:
    allowed = settings.allowed_paths
    default_parent = "generated" if allowed else os.path.join(settings.data_dir, "generated")

    def queue(job: image_jobs.ImageJob, extra: dict | None = None):
        status, answer = queue_tool(job.tool, job.args, job.outdir, extra, lambda: image_jobs.write_prompts(job))
        if status == 201:
            answer["outdir"] = job.outdir
        return status, answer

    def refused(e: UserError):
        return err(403 if isinstance(e, workbench.Refused) else 422, str(e))

    def respond(status: int, answer: dict):
        if status == 201:
            return JSONResponse(answer, status_code=201)
        return err(status, answer["errors"][0]["message"])

    @app.post("/api/generate")
    async def generate(request: Request):
        d = await body(request)
        try:
            job = image_jobs.generate_job(d, allowed, default_parent)
        except UserError as e:
            return refused(e)
        return respond(*queue(job))

    @app.post("/api/jobs/{job_id}/compare")
    async def compare(job_id: int, request: Request):
        d = await body(request)
        run = store.get(job_id)
        if run is None:
            return err(404, f"no job {job_id}")
        if tool_jobs.is_tool(run["script"]):
            return err(409, f"job {job_id} is a tool job ({run['script']}), not a training run")
        if not method_kinds.get(METHOD_OF_SCRIPT[run["script"]]).trains_network:
            return err(422, f"job {job_id} ({run['script']}) saves models, not LoRA files: "
                            "the grid compares a LoRA run's saved files")
        if run["state"] not in FINISHED:
            return err(409, f"job {job_id} is {run['state']}: compare its files once it has finished")
        try:
            opts = await asyncio.to_thread(run_options, run)
            job = image_jobs.compare_job(d, image_jobs.run_model(opts, run["output_dir"], run["output_name"]))
        except UserError as e:
            return refused(e)
        return respond(*queue(job, {"run": job_id}))

    @app.get("/api/jobs/{job_id}/images")
    async def images(job_id: int):
        job = store.get(job_id)
        if job is None:
            return err(404, f"no job {job_id}")
        if not job["output_dir"]:
            return err(404, f"job {job_id} has no output folder")
        return await asyncio.to_thread(image_jobs.images, job["output_dir"])
