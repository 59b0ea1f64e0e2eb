"""Model saves, training states and sd-scripts' rotation of old ones, for a run (library/run/trainer.py).

    save(run, epoch=, step=, final=)    the model (and its EMA), then the training state
    state_of_this_step(run)             the state after the last step (SIGINT, non-finite stop)

Every process calls these (gathers and shard writes are collectives); the main process writes
the model files. How the full weights are gathered (fsdp), or the float32 master weights taken
(deepspeed), is the strategy's ``full_weights`` / ``ema_weights`` (library/distributed/strategy.py).
"""
from __future__ import annotations

import logging
import os
import time

from library.files import SaveError, output_file, save_elsewhere
from library.outputs import metadata, train_state
from library.outputs.train_state import saved_tensors
from library.training import nonfinite, offload

logger = logging.getLogger("sdtk")


def save(run, *, epoch=None, step=None, final=False) -> None:
    # Schedule-free optimizers save their eval iterate; every process switches, so ranks agree.
    with run.parts.stepper.eval_mode():
        _save_model(run, epoch=epoch, step=step)
    # The training state holds the training iterate (outside eval_mode).
    _save_states(run, epoch=epoch, step=step, final=final)


def _save_model(run, *, epoch=None, step=None) -> None:
    opts, c = run.opts, run.parts
    acc = c.accelerator
    acc.wait_for_everyone()
    meta = metadata.step_metadata(run.base_metadata, epoch=epoch or run.progress.epochs_done,
                            step=run.progress.global_step, finished_at=time.time())
    ext = c.method.extension()
    # fsdp: every process joins the gather of the full weights; the main process writes them.
    # deepspeed in bf16/fp16: the float32 master weights are saved (a collective too).
    with c.strategy.full_weights(c):
        path = output_file(opts.output_dir, opts.output_name, ext, epoch=epoch, step=step)
        # nothing non-finite is written, and no good file replaced by it (every process)
        nonfinite.check_before_save(saved_tensors(c), path, acc)
        if acc.is_main_process:
            os.makedirs(opts.output_dir, exist_ok=True)
            with offload.available_for_save(c.frozen, c.method):  # a full model's file holds VAE and TEs
                _write_model(run, path, meta)
                logger.info(f"saved {path}")
                run.saved.append(path)
    if c.ema is not None:
        save_ema(run, epoch=epoch, step=step, metadata=meta)
    acc.wait_for_everyone()


def save_ema(run, *, epoch=None, step=None, metadata=None) -> str:
    """``<output_name>-ema[-epoch|-step]``: the EMA swapped into the parameters (and gathered:
    every process calls it), written by the main process with the method's save."""
    opts, c = run.opts, run.parts
    acc = c.accelerator
    path = output_file(opts.output_dir, opts.output_name + "-ema", c.method.extension(),
                       epoch=epoch, step=step)
    meta = dict(metadata or {})
    if meta:
        meta["sdtk.ema_decay"] = str(c.ema.decay)
    with c.strategy.ema_weights(c):
        if acc.is_main_process:
            with offload.available_for_save(c.frozen, c.method):
                _write_model(run, path, meta, "the EMA weights were")
    if acc.is_main_process:
        logger.info(f"saved {path} (EMA, decay {c.ema.decay})")
        run.saved.append(path)
    return path


def _write_model(run, path: str, meta: dict, what: str = "the weights were") -> None:
    """The model (or EMA) file; when it cannot be written (disk full, read-only), into the
    system temp dir instead, and the run ends with one line saying where (library/files.py)."""
    def write(p):
        run.parts.method.save(p, run.opts.save_precision, meta)

    try:
        write(path)
    except SaveError as e:
        raise save_elsewhere(e, write, what) from None


def _save_states(run, *, epoch=None, step=None, final=False) -> None:
    """``save_state``: a state next to each model save; ``save_state_on_train_end``: the
    final one. Then sd-scripts' rotation of old models and states."""
    opts, acc = run.opts, run.parts.accelerator
    if opts.save_state or (final and opts.save_state_on_train_end):
        path = train_state.state_dir(opts.output_dir, opts.output_name, epoch=epoch, step=step)
        train_state.write_state(run, path, logger)
        run.progress.last_state = (path, run.progress.global_step)
    if acc.is_main_process and not final:
        _rotate(opts, run.parts.method, run.parts.ema is not None, epoch=epoch, step=step)
    acc.wait_for_everyone()


def state_of_this_step(run) -> str:
    """``<output_name>-step<N>-state`` after the last completed step, written unless a save of
    this step wrote it already; returns its folder."""
    opts, progress = run.opts, run.progress
    path = train_state.state_dir(opts.output_dir, opts.output_name, step=progress.global_step)
    if progress.last_state != (path, progress.global_step):
        train_state.write_state(run, path, logger)
    return path


def _rotate(opts, method, with_ema: bool, *, epoch=None, step=None) -> None:
    """sd-scripts' save_last_n_*: drop the model (and state) saved n saves (epochs) or more
    than n steps (steps) before this one."""
    import shutil

    n_model = opts.save_last_n_epochs if epoch is not None else opts.save_last_n_steps
    n_state = (opts.save_last_n_epochs_state if epoch is not None
               else opts.save_last_n_steps_state) or n_model
    for n, kind in ((n_model, "model"), (n_state, "state")):
        if not n or (kind == "state" and not opts.save_state):
            continue
        if epoch is not None:
            old = {"epoch": epoch - opts.save_every_n_epochs * n}
        else:
            no = step - n - 1
            old = {"step": no - no % opts.save_every_n_steps}
        if next(iter(old.values())) <= 0:
            continue
        if kind == "state":
            train_state.remove_state(train_state.state_dir(opts.output_dir, opts.output_name,
                                                           **old), logger)
            continue
        names = [opts.output_name]
        if with_ema:
            names.append(opts.output_name + "-ema")  # the EMA saves rotate with the models
        for name in names:
            path = output_file(opts.output_dir, name, method.extension(), **old)
            for extra in method.companion_files(path):  # pivotal tuning's embeddings
                if os.path.isfile(extra):
                    os.remove(extra)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.isfile(path):
                os.remove(path)
            else:
                continue
            logger.info(f"removed old model {path}")
