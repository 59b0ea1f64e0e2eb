"""The training loop: epochs of global batches, each split into this process's micro-steps.

    train(run)     from ``run.progress`` (a fresh run, or a resume's) to the plan's last step

Per global batch: the method's ``before_step``; for each micro-step the batch loss
(library/training/batch_loss.py) and the stepper's backward; the step (every process, every step: it
joins the gradient sum); the non-finite guard; ``scale_weight_norms`` and the EMA; progress,
reports (library/outputs/tracking.py Reporter), step saves and SIGINT/SIGTERM. What differs between a
single process, DDP, FSDP and DeepSpeed is asked of the strategy (library/distributed/strategy.py):
whether this process runs a micro-step of an empty share (``takes_part``) and the context of each
micro-step (``micro_step``: DDP's ``no_sync`` in all but the last), never read from the options or
from strategy flags. Every stepper gets the step the same way: the step's one collective before
the last backward (its loss flag gates the updates of steppers that update inside the backward),
and ``stepper.step(read)``, in which the stepper makes the step's one host read before it
decides (library/training/step_sync.py).
"""
from __future__ import annotations

import logging
import signal

from tqdm.auto import tqdm

from library.accelerator import is_main_process
from library.data import step_plan
from library.data.training_data import ImageLoader, loader_workers
from library.distributed.strategy import SKIP, ZERO_WEIGHT
from library.errors import NonFiniteStop, TrainingInterrupted
from library.log import seconds_since_process_start
from library.outputs import progress_stream
from library.outputs.checkpoints import Saver
from library.run.run_state import HOOKS, LoopView
from library.training import nonfinite, step_sync
from library.training.network_options import max_norm_postfix

logger = logging.getLogger("sdtk")

# Statistics that stay on the device (scale_weight_norms') are read for the progress bar on the
# run's first step and every BAR_READ_EVERY steps (trackers, when logging, read them every step).
BAR_READ_EVERY = 10


def train(run) -> None:
    opts, c, plan, progress = run.opts, run.parts, run.plan, run.progress
    acc, strategy, stepper = c.accelerator, c.strategy, c.stepper
    P, rank = acc.num_processes, acc.process_index
    bs, A = opts.train_batch_size, opts.gradient_accumulation_steps
    signals = run.stop_signals
    view = LoopView(progress, c)  # what the hooks see
    # control_file (save_now / sample_now / stop): read by the main process at each step's
    # start, agreed by every process in the step's read, run by all after the step
    control = progress_stream.control_channel(opts, is_main_process())
    start_epoch, start_batch = progress.position
    c.reporter.before_training(progress)  # validation images held out; sample_at_first
    bar = tqdm(total=plan.total_steps, initial=progress.global_step,
               disable=not is_main_process(), desc="steps", dynamic_ncols=True)
    done, stop = False, 0
    norm_postfix: dict[str, str] = {}  # scale_weight_norms' bar entries, as last read
    images_in = None  # without cached latents: decoded and augmented per step
    if c.caches.latents is None:
        images_in = ImageLoader(run.tset, loader_workers(opts.max_data_loader_n_workers,
                                                         acc.device.type, P),
                                persistent=opts.persistent_data_loader_workers,
                                pin=acc.device.type == "cuda")
    for epoch in range(start_epoch, plan.epochs + 1):
        c.method.set_train(epoch)
        batches = step_plan.epoch_batches(run.tset.bucket_of, opts.seed, epoch, plan.global_batch)
        # A resume inside this epoch: the order is keyed by (seed, epoch); skip what was trained.
        skip, n_batches = (start_batch if epoch == start_epoch else 0), len(batches)
        batches = batches[skip:]
        # This process's micro-batches, in order: for each global batch, A micro-steps.
        mine = [gb.micro_batch(a, rank, bs, P) for gb in batches for a in range(A)]
        loader = images_in.epoch(epoch, mine) if images_in is not None else None
        k = 0
        for j, gb in enumerate(batches, start=skip):
            c.method.before_step(progress.global_step)  # e.g. stop_text_encoder_training
            loss_sum, pending = None, None  # loss_sum: a device tensor (no host read per micro-step)
            requested = tuple(control.poll())
            for a in range(A):
                idx = list(mine[k])
                images = next(loader) if loader is not None else None
                k += 1
                last = a == A - 1
                # An empty share of a partial global batch: skipped (this process contributes
                # zeros to the gradient sum, which it still joins), or a zero-weight micro-step
                # of one sample of the global batch where the other processes need this one in
                # its collectives (the strategy's takes_part says which)
                part = strategy.takes_part(empty=not idx, last=last)
                if part == SKIP:
                    continue
                zero_weight = part == ZERO_WEIGHT
                if zero_weight:
                    idx = [gb.indices[0]]
                    if images_in is not None:  # (the loader's)
                        images = images_in.load(epoch, idx)
                HOOKS.before_micro_step(view, epoch, idx)
                with strategy.micro_step(last):  # DDP: no_sync() but in the last micro-step
                    loss = c.batch_loss.training(epoch, idx, images, len(gb.indices),
                                                 progress.global_step)
                loss = HOOKS.after_micro_step(view, epoch, idx, loss)
                if zero_weight:
                    loss = loss * 0.0
                loss_sum = step_sync.add_loss(loss_sum, loss)
                loss_finite = None
                if last:
                    # the step's one collective (library/training/step_sync.py): before the
                    # last backward, so that a stepper updating inside it (hooks) gates every
                    # update on the summed loss's finiteness, a device flag, alike in every
                    # process (library/training/nonfinite.py)
                    pending = step_sync.gather(signals, acc.device, loss_sum, requested=requested)
                    loss_finite = pending.loss_finite
                with strategy.micro_step(last):  # the backward of that forward, alike
                    stepper.backward(loss, last_micro_step=last, loss_finite=loss_finite)
            step_lr = stepper.current_lr()
            if pending is None:  # this process's last micro-step was an empty share, skipped
                pending = step_sync.gather(signals, acc.device,
                                           step_sync.zero_loss(acc.device) if loss_sum is None
                                           else loss_sum, requested=requested)
            # every process, every stepper, every step: step() joins the gradient sum and makes,
            # before it decides on any update, the step's one read (the loss, the stepper's
            # gradient norm or flags and the stop signal together), which it returns
            read = stepper.step(pending.read)
            if read is None:
                raise RuntimeError(f"{type(stepper).__name__}.step() made no read of the step")
            bad = None if read.finite else f"loss {nonfinite.describe(read.loss)}"
            bad = bad or stepper.nonfinite  # a non-finite gradient norm
            step_loss = read.loss
            c.batch_loss.end_step()  # a dataset's network_multiplier: back at the run's
            if bad is not None:
                # stop (raises) or skip this update
                on_nonfinite(bad, bar, opts.on_nonfinite, progress, stepper, c.reporter, run.saver)
            # scale_weight_norms: after the update (every stepper has finished it here), before
            # the EMA reads the weights
            progress.max_norm_stats = c.method.after_step(acc.device)
            if c.ema is not None:
                c.ema.update()
            progress.global_step += 1
            progress.samples_seen += len(gb.indices)
            progress.position = (epoch, j + 1) if j + 1 < n_batches else (epoch + 1, 0)
            if progress.global_step == 1:
                logger.info(f"first step done {seconds_since_process_start():.2f}s after start")
            progress.loss_log.append(step_loss)
            progress.lr_log.append(step_lr)
            HOOKS.after_step(view, step_loss, step_lr)
            if progress.max_norm_stats is not None and (
                    not norm_postfix or progress.global_step % BAR_READ_EVERY == 0):
                # device statistics: read for the bar only every BAR_READ_EVERY steps
                norm_postfix = max_norm_postfix(progress.max_norm_stats)
            # the postfix first, without drawing: update() draws the bar once, at most every
            # mininterval (0.1 s), instead of twice per step (a terminal write each)
            bar.set_postfix(**norm_postfix, loss=f"{step_loss:.4f}", lr=f"{step_lr:.2e}", refresh=False)
            bar.update(1)
            # validation and samples when due, scalars, the progress stream (the norm as read)
            c.reporter.after_step(progress, read.norm)
            saved_now = False
            if opts.save_every_n_steps and progress.global_step % opts.save_every_n_steps == 0 \
                    and progress.global_step < plan.total_steps:
                run.saver.save(progress, epoch=None, step=progress.global_step)
                saved_now = True
            # SIGINT/SIGTERM in any process: every process stops after this same step (agreed
            # in the step's read; one arriving after it, e.g. during a save, in the next step's;
            # with one process nothing needs agreeing: after this step)
            stop = read.stop or (signals.signum if signals is not None and P == 1 else 0)
            for command in read.commands:  # every process, the same (agreed in the read)
                c.reporter.control(command, progress.global_step)
                if command == "stop":
                    stop = stop or signal.SIGINT
                elif command == "sample_now":
                    c.reporter.sample_now(progress)
                elif command == "save_now" and not saved_now \
                        and progress.global_step < plan.total_steps:  # the final save follows
                    run.saver.save(progress, epoch=None, step=progress.global_step)
                    saved_now = True
            c.reporter.saves(run.saved, progress)
            if progress.global_step >= plan.total_steps:
                done = True
                break
            if stop and j + 1 < n_batches:
                bar.close()
                interrupt(stop, progress, run.saver)
        progress.epochs_done = epoch
        c.reporter.after_epoch(progress, epoch)  # validation and samples when due, loss/epoch
        if done:
            break
        if opts.save_every_n_epochs and epoch % opts.save_every_n_epochs == 0 and epoch < plan.epochs:
            run.saver.save(progress, epoch=epoch, step=None)
            c.reporter.saves(run.saved, progress)
        if stop:  # the signal came in the epoch's last step: after the epoch's saves
            bar.close()
            interrupt(stop, progress, run.saver)
    bar.close()


def on_nonfinite(what: str, bar, action: str, progress, stepper, reporter, saver: Saver) -> None:
    """A non-finite loss or gradient norm in step global_step + 1, before its update (every
    process alike). ``action`` (on_nonfinite) ``stop``: write the state of the last good step
    and raise NonFiniteStop; ``skip``: drop the update and warn (library/training/nonfinite.py).
    ``bar`` (the progress bar) and ``reporter``: None where the run has none (train_leco)."""
    step = progress.global_step + 1
    partial = stepper.partial_update
    if reporter is not None:
        reporter.nonfinite(what, step, action)
    if action == "skip":
        stepper.skip()
        logger.warning(f"non-finite {what} at step {step}: update skipped (on_nonfinite skip)"
                       + ("; some parameters had already been stepped in the backward pass"
                          if partial else ""))
        return
    if bar is not None:
        bar.close()
    msg = f"non-finite {what} at step {step}: training stopped"
    if partial:
        # the hooks had stepped parameters before the bad gradient appeared: no state of
        # step N exists any more; only earlier saves (all checked finite) remain
        raise NonFiniteStop(
            f"{msg}; parameters had already been updated in the backward pass "
            "(fused_backward_pass / fused_optimizer_groups), so no state was written; resume "
            "from an earlier save_state state, e.g. with a lower learning rate or "
            "max_grad_norm")
    if not saver.keeps_state:  # train_leco
        raise NonFiniteStop(f"{msg} before its update; the files saved before it are kept "
                            "(e.g. lower learning_rate or max_grad_norm)")
    path = saver.state_of_this_step(progress)
    raise NonFiniteStop(
        f"{msg} before its update; the state after step {progress.global_step} is in {path} "
        f"(continue with --resume {path}; on_nonfinite skip passes over such steps)")


def interrupt(signum: int, progress, saver: Saver) -> None:
    """Write ``<output_name>-step<N>-state`` (unless this step's state exists) and stop."""
    path = saver.state_of_this_step(progress)
    raise TrainingInterrupted(signum, path, progress.global_step)
