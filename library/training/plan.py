"""A run's plan, before any weight loads (a dry run stops after it): the training set
(library/data/training_data.py) and the step plan (library/data/step_plan.py), with the options
the dataset config decides. No torch import."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from library.data import step_plan
from library.data.training_data import build_training_set
from library.log import logger

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options


def plan_run(opts: Options, processes: int):
    """-> (opts, training set, step plan). The options come back with what the dataset config
    decides (its batch size and resolution): they are frozen, so the run holds the copy."""
    tset = build_training_set(opts, logger)
    resolved: dict[str, object] = {}
    if tset.batch_size is not None and tset.batch_size != opts.train_batch_size:
        # The dataset config's batch_size (dataset -> [general] -> train_batch_size) is the
        # per-process batch, as sd-scripts; every dataset has the same one (checked).
        logger.info(f"train_batch_size {tset.batch_size} from the dataset config "
                    f"(run option: {opts.train_batch_size})")
        resolved["train_batch_size"] = tset.batch_size
    if opts.resolution is None:
        resolved["resolution"] = tset.resolution  # set by the dataset config; recorded in the metadata
    if opts.use_t5xxl_cache_only and not opts.cache_text_encoder_outputs:  # as sd-scripts' sd3_train.py
        logger.warning("use_t5xxl_cache_only is enabled, so cache_text_encoder_outputs is also enabled")
        resolved["cache_text_encoder_outputs"] = True
    if resolved:
        opts = opts.replace(**resolved)
    plan = plan_for(opts, tset, processes)
    tset = dataclasses.replace(tset, total_steps=plan.total_steps)  # token_warmup_step's fraction
    return opts, tset, plan


def plan_for(opts: Options, tset, processes: int):
    """The step plan of a planned run's options and training set at ``processes`` processes."""
    return step_plan.make_plan(
        tset.epoch_samples(),
        step_plan.BatchShape(processes, opts.train_batch_size, opts.gradient_accumulation_steps),
        step_plan.RunLength(opts.max_train_epochs, opts.max_train_steps, opts.lr_warmup_steps))


def print_plan(plan, main: bool):
    if not main:
        return
    print("step plan:", flush=True)
    for line in plan.lines():
        print("  " + line, flush=True)
    for line in step_plan.what_if_lines(plan):
        print("  note: " + line, flush=True)
