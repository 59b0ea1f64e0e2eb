"""Making the class images a run planned (``num_class_images``, library/data/class_images.py):
before the training model loads, the main process renders the missing ones with gen_img's
``Generator`` over the base model (one image per batch, so each equals gen_img's image of the
same prompt, seed and settings), writes each atomically as a PNG with A1111's ``parameters``
text, frees the generator, and every process waits at a barrier, so all see the same set."""
from __future__ import annotations

import gc
import os
import time
from typing import TYPE_CHECKING

import torch

from library.config.options import gen_img_flags
from library.config.parse import required
from library.data.class_images import to_make
from library.errors import UserError, first_line
from library.outputs import gen_options, generation, infotext

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options



def generator_args(opts: Options, outdir: str):
    """gen_img's arguments for the run's base model (float32, one image per batch)."""
    argv = ["--ckpt", required(opts.pretrained_model_name_or_path, "pretrained_model_name_or_path"), "--outdir", outdir, "--prompt", "-",
            "--sampler", opts.class_image_sampler]
    argv += gen_img_flags(opts)  # the run's parts and text settings (its --ckpt: pretrained_model_name_or_path)
    if opts.xformers:
        argv.append("--xformers")
    return gen_options.parse_args(argv)


def jobs(planned: list, defaults: dict, sampler: str) -> list:
    return [gen_options.Job(prompt=c.prompt, negative="", width=c.width, height=c.height,
                            steps=defaults["steps"] if c.steps is None else c.steps,
                            scale=defaults["scale"] if c.scale is None else c.scale,
                            negative_scale=None, guidance=defaults["guidance"], sampler=sampler,
                            seed=c.seed, muls=None, where="num_class_images")
            for c in planned]


def make_missing(opts: Options, planned: list, accelerator, log) -> int:
    """Render the planned class images whose file is missing (main process), then a barrier.
    Returns the number made here."""
    todo = to_make(planned) if accelerator.is_main_process else []
    if todo:
        for folder in sorted({os.path.dirname(c.path) for c in todo}):
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as e:
                raise UserError(f"num_class_images: cannot create {folder}: {first_line(e)}") from None
        log.info(f"num_class_images: generating {len(todo)} class image(s) with the base model "
                 f"({len(planned) - len(todo)} reused)")
        t0 = time.perf_counter()
        gen = generation.Generator(generator_args(opts, os.path.dirname(todo[0].path)))
        for c, job in zip(todo, jobs(todo, gen.defaults, gen.args.sampler)):
            image = gen.render([job])[0]
            infotext.save_png(image, c.path, gen.parameters(job), {
                "prompt": job.prompt, "seed": job.seed, "sampler": job.sampler,
                "steps": job.steps, "scale": job.scale})
        del gen
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.info(f"num_class_images: {len(todo)} made in {time.perf_counter() - t0:.1f} s")
    elif planned and accelerator.is_main_process:
        log.info(f"num_class_images: reusing {len(planned)} class image(s)")
    if planned:
        accelerator.wait_for_everyone()
    return len(todo)

