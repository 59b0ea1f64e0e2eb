"""The one training run shared by train_lora.py, train_dreambooth.py, finetune.py and
train_textual_inversion.py: ``run(opts, method_name)``.

Stages: plan (no weights) -> validate -> load -> set-up -> cache -> train (library/run/loop.py) ->
save (library/outputs/checkpoints.py). This module is the part before torch: the plan, the resume
check, the output name, debug_dataset and the dry run's printed plan; then it hands the run to
library/run/stages.py (the ``Run`` and its stages). docs/INTERNALS.md has the path of one run.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from library import accelerator
from library.accelerator import is_main_process
from library.data import debug_dataset
from library.distributed import deepspeed_zero
from library.errors import UserError
from library.log import logger, setup_logging
from library.outputs import hub, output_checks
from library.training.plan import plan_run, print_plan

if TYPE_CHECKING:  # annotations only: the stages import torch, after the plan is printed
    from library.config.parse import Options
    from library.run.stages import Run


def run(opts: Options, method_name: str, hub_api=None) -> Run | None:
    """Plan, then (unless --dry_run) load, train and save. Returns the Run for tests.
    ``hub_api``: the Hugging Face Hub client the run uploads to and resumes from (None:
    huggingface_hub's HfApi with huggingface_token, made when the options ask for the Hub)."""
    setup_logging(is_main_process())
    opts = deepspeed_zero.resolve_options(opts)  # an Accelerate DeepSpeed launch config -> the deepspeed options
    processes = accelerator.launched_world_size()
    if opts.resume and opts.resume_from_huggingface:  # every process: then a local state
        opts = opts.replace(resume=hub.download_state(opts.resume, opts.huggingface_token, hub_api))
    opts, tset, plan = plan_run(opts, processes)
    main = is_main_process()
    resume = None
    if opts.resume:  # checked before any weight loads
        # lazy: the plan and the checks before loading come before torch is imported
        from library.outputs import train_state

        resume = train_state.check_resume(opts, method_name, plan, tset, logger)
    output_checks.check_name(opts.output_name)  # a dry run too: "" would write ".safetensors"
    if opts.debug_dataset:  # sd-scripts: show the dataset, then exit without training
        if main:
            if not opts.output_dir:
                raise UserError("debug_dataset: output_dir is required (the contact sheet is "
                                "written there)")
            if plan.class_images_new:
                raise UserError(f"debug_dataset: {plan.class_images_new} class image(s) of "
                                "num_class_images are not made yet (a training run makes them "
                                "before it loads the model); set num_class_images = 0 to see the rest")
            path = os.path.join(opts.output_dir, f"{opts.output_name}_debug_dataset.png")
            debug_dataset.write_sheet(tset, plan, opts.seed, path, logger)
            print(f"debug_dataset: wrote {path}; exiting without training", flush=True)
        return None
    if opts.dry_run:
        print_plan(plan, main)  # the plan needs no torch: printed first
    started = time.time()
    # lazy: the plan and the checks before loading come before torch is imported
    from library.run import stages

    r = stages.Run(opts, method_name, tset, plan)
    if opts.dry_run:
        stages.dry_run(r, main)
        return None
    return stages.train(r, started, resume, hub_api)
