"""What a run reports while it trains: TensorBoard scalars, the validation loss, sample images.

The training loop calls three functions, in every process:

    before_training(run)      sample_at_first
    after_step(run, epoch)    after each optimizer step: validation and samples when due, scalars
    after_epoch(run, epoch)   at the end of each epoch: validation and samples when due, loss/epoch
    finish(run)               after the final save: flush and close the log

Only the main process writes. Tags (sd-scripts' names), each at the global step:

    loss/current      the step's loss: the mean over the global batch, all processes (run.loss_log)
    loss/average      the mean of the last ``steps_per_epoch`` step losses (sd-scripts' moving
                      average: its LossRecorder keeps one slot per step of an epoch)
    loss/epoch        the mean of the epoch's step losses, at the epoch's last step
    loss/validation   the validation loss (library/validation.py)
    sample/<index>    the sample images (library/sampling.py), when sample_prompts is set
    lr/<group>        the learning rate each parameter group trained with in this step; group
                      names from the network's ``prepare_optimizer_params`` descriptions, else
                      unet / textencoder (textencoder1, textencoder2 for SDXL)

The run folder is ``<logging_dir>/<log_prefix><YYYYmmddHHMMSS>/`` (sd-scripts' naming).
"""
from __future__ import annotations

import logging
import os
import time

from library.errors import UserError

logger = logging.getLogger("sdtk")


class TrackingError(UserError):
    pass


def check_options(opts) -> None:
    """Before any weight is loaded: the tracker exists and is installed."""
    from library import sampling, validation

    validation.check_options(opts)
    sampling.check_options(opts)
    if opts.log_with in ("wandb", "all"):
        raise TrackingError(f"log_with: {opts.log_with} is not supported yet; use log_with = "
                            "\"tensorboard\" (or leave it unset) with logging_dir")
    if opts.log_with and not opts.logging_dir:
        raise TrackingError(f"log_with = {opts.log_with} needs logging_dir (the folder of the logs)")
    if opts.logging_dir:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise TrackingError("logging_dir: TensorBoard logging needs the tensorboard package; "
                                "install the tensorboard extra (pip install -e .[tensorboard])") from None


def run_folder(opts, now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d%H%M%S", time.localtime(now))
    return os.path.join(opts.logging_dir, (opts.log_prefix or "") + stamp)


def group_names(run) -> list[str]:
    """One tag name per optimizer parameter group (in the method's group order)."""
    method = run.method
    groups = method.param_groups
    names = getattr(method, "group_names", None)
    if not names or len(names) != len(groups):
        tes = run.bundle.text_encoders
        te_of = {id(p): i for i, te in enumerate(tes) for p in te.parameters()}
        names = []
        for g in groups:
            i = te_of.get(id(g["params"][0]))
            if i is None:
                names.append("unet")
            else:
                names.append("textencoder" if len(tes) == 1 else f"textencoder{i + 1}")
    out, seen = [], {}
    for n in names:  # duplicates (should a module repeat a description) get a suffix
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}{seen[n]}")
    return out


class Tracker:
    def __init__(self, run):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = run_folder(run.opts)
        os.makedirs(self.folder, exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.folder)
        import atexit

        atexit.register(self.close)  # an interrupted run (SIGINT/SIGTERM state) still flushes
        self.names = group_names(run)
        self.base_lrs = [float(g["lr"]) for g in run.method.param_groups]
        logger.info(f"logging to {self.folder}")

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, float(value), step)

    def lrs(self, lr0: float) -> list[float]:
        """Each group's learning rate from the first group's: the schedule (a LambdaLR of the
        step) scales every group's base rate by the same factor."""
        b0 = self.base_lrs[0]
        return [lr0 * b / b0 if b0 else b for b in self.base_lrs]

    def close(self) -> None:
        self.writer.close()


def _tracker(run):
    """The run's Tracker in the main process when logging_dir is set, else None."""
    if "_tracker" not in run.__dict__:
        on = bool(run.opts.logging_dir) and run.accelerator.is_main_process
        run._tracker = Tracker(run) if on else None
    return run._tracker


def before_training(run) -> None:
    """Announce the held-out images; sample_at_first: the samples of the starting weights."""
    n = len(getattr(run.tset, "val_items", []))
    if n and run.accelerator.is_main_process:
        logger.info(f"validation_split {run.opts.validation_split}: {n} image(s) held out for the "
                    f"validation loss, {len(run.tset.train_items)} train")
    if run.opts.sample_at_first and run.opts.sample_prompts:
        _sample(run)


def after_step(run, epoch: int) -> None:
    from library import sampling, validation

    step = run.global_step
    if validation.due(run, step=step):
        _validate(run, "")
    if sampling.due(run, step=step):
        _sample(run)
    t = _tracker(run)
    if t is None:
        return
    window = run.loss_log[-run.plan.steps_per_epoch:]
    t.scalar("loss/current", run.loss_log[-1], step)
    t.scalar("loss/average", sum(window) / len(window), step)
    for name, lr in zip(t.names, t.lrs(run.lr_log[-1])):
        t.scalar(f"lr/{name}", lr, step)


def after_epoch(run, epoch: int) -> None:
    from library import sampling, validation

    if validation.due(run, epoch=epoch) and run.__dict__.get("_validated_at") != run.global_step:
        _validate(run, f", end of epoch {epoch}")
    if sampling.due(run, epoch=epoch) and run.__dict__.get("_sampled_at") != run.global_step:
        _sample(run)
    t = _tracker(run)
    if t is None:
        return
    done = run.plan.steps_per_epoch * (epoch - 1)  # steps before this epoch (loss_log[s-1]: step s)
    losses = run.loss_log[done:run.global_step]
    if losses:
        t.scalar("loss/epoch", sum(losses) / len(losses), run.global_step)
    t.writer.flush()


def _validate(run, label: str) -> None:
    from library import validation

    value = validation.run_validation(run, label)
    run._validated_at = run.global_step
    t = _tracker(run)
    if t is not None:
        t.scalar("loss/validation", value, run.global_step)


def _sample(run) -> None:
    """Every process renders its share; the main process logs all of them (after the barrier)."""
    from library import sampling

    sampling.sample_images(run)
    run._sampled_at = run.global_step
    t = _tracker(run)
    if t is None:
        return
    import numpy as np
    from PIL import Image

    o = run.opts
    for i, p in enumerate(sampling.load_prompts(o.sample_prompts)):
        with Image.open(sampling.image_path(o, run.global_step, i, sampling.prompt_seed(o, p, i))) as im:
            t.writer.add_image(f"sample/{i:02d}", np.asarray(im.convert("RGB")), run.global_step,
                               dataformats="HWC")


def finish(run) -> None:
    t = run.__dict__.pop("_tracker", None)
    if t is not None:
        t.close()
