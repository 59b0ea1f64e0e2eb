"""What a run reports while it trains: TensorBoard / wandb scalars, the validation loss, sample images.

The training loop calls a ``Reporter(opts, plan, tset, components)``, in every process:

    before_training(progress)          sample_at_first
    after_step(progress)               after each optimizer step: validation and samples when
                                       due, scalars
    after_epoch(progress, epoch)       at the end of each epoch: validation and samples when due,
                                       loss/epoch
    finish()                           after the final save: flush and close the log

Only the main process writes, to each tracker of ``log_with`` (tensorboard: the default with
``logging_dir``; wandb; all = both), the same tags (sd-scripts' names), each at the global step:

    loss/current      the step's loss: the mean over the global batch, all processes (loss_log)
    loss/average      the mean of the last ``steps_per_epoch`` step losses (sd-scripts' moving
                      average: its LossRecorder keeps one slot per step of an epoch)
    loss/epoch        the mean of the epoch's step losses, at the epoch's last step
    loss/validation   the validation loss (library/training/validation.py)
    sample/<index>    the sample images (library/training/sampling.py), when sample_prompts is set
    lr/<group>        the learning rate each parameter group trained with in this step; group
                      names from the network's ``prepare_optimizer_params`` descriptions, else
                      unet / textencoder (textencoder1, textencoder2 for SDXL)
    max_norm/keys_scaled, max_norm/max_key_norm, norm/avg_key_norm
                      with scale_weight_norms: the modules scaled in this step, the largest and
                      the mean ||up @ down * scale|| after scaling (sd-scripts' names)

The run folder is ``<logging_dir>/<log_prefix><YYYYmmddHHMMSS>/`` (sd-scripts' naming). wandb
(an optional dependency, the ``wandb`` extra) writes under that folder when ``logging_dir`` is set
(sd-scripts sets WANDB_DIR to it), else in wandb's default place; the project is
``log_tracker_name`` (sd-scripts' defaults), the run name ``wandb_run_name``, further
``wandb.init`` arguments come from the ``[wandb]`` table of ``log_tracker_config``;
``wandb_api_key`` is put into this process's WANDB_API_KEY (sd-scripts calls ``wandb.login``,
which writes it to ~/.netrc). WANDB_MODE=offline works as usual.
"""
from __future__ import annotations

import atexit
import logging
import os
import time
from typing import TYPE_CHECKING, Callable

import numpy as np
import toml
from PIL import Image

from library.accelerator import is_main_process
from library.config.parse import required
from library.errors import UserError, first_line
from library.outputs import progress_stream
from library.training import sampling, validation
from library.training.network_options import max_norm_scalars

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")


class TrackingError(UserError):
    pass


def check_options(opts: Options) -> None:
    """Before any weight is loaded: the tracker exists and is installed."""
    validation.check_options(opts)
    sampling.check_options(opts)
    if opts.log_with in ("tensorboard", "all") and not opts.logging_dir:
        raise TrackingError(f"log_with = {opts.log_with} needs logging_dir (the folder of the logs)")
    if uses_tensorboard(opts):
        try:
            # lazy: optional dependency (tensorboard: pip install -e ".[tensorboard]"), imported
            # when used
            import tensorboard  # noqa: F401
        except ImportError:
            raise TrackingError("logging_dir: TensorBoard logging needs the tensorboard package; "
                                "install the tensorboard extra (pip install -e .[tensorboard])") from None
    if uses_wandb(opts):
        try:
            # lazy: optional dependency (wandb: pip install -e ".[wandb]"), imported when used
            import wandb  # noqa: F401
        except ImportError:
            raise TrackingError(f"log_with = {opts.log_with}: wandb logging needs the wandb package; "
                                "install the wandb extra (pip install -e .[wandb])") from None
        wandb_init_kwargs(opts)  # a bad log_tracker_config fails now
    else:
        given = opts.given
        for name in ("log_tracker_name", "log_tracker_config", "wandb_run_name", "wandb_api_key"):
            if name in given and getattr(opts, name) is not None:
                logger.warning("option %s has no effect here (log_with is not wandb or all)", name)


def uses_tensorboard(opts: Options) -> bool:
    return bool(opts.logging_dir) and opts.log_with in (None, "tensorboard", "all")


def uses_wandb(opts: Options) -> bool:
    return opts.log_with in ("wandb", "all")


WANDB_PROJECTS = {"train_lora": "network_train", "train_dreambooth": "dreambooth",
                  "finetune": "finetuning", "train_textual_inversion": "textual_inversion"}  # sd-scripts' default log_tracker_name per script


def wandb_init_kwargs(opts: Options) -> dict:
    """The keyword arguments of ``wandb.init`` (without ``dir``): project, name, and the
    ``[wandb]`` table of log_tracker_config (which wins, as sd-scripts' init_kwargs)."""
    kwargs = {"project": opts.log_tracker_name or WANDB_PROJECTS.get(opts.script,
                                                                      "network_train")}
    if opts.wandb_run_name:
        kwargs["name"] = opts.wandb_run_name
    path = opts.log_tracker_config
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                doc = toml.load(f)
        except OSError as e:
            raise TrackingError(f"log_tracker_config: cannot read {path} ({e.strerror})") from None
        except (toml.TomlDecodeError, UnicodeDecodeError) as e:
            raise TrackingError(f"log_tracker_config: {path} is not valid TOML ({first_line(e)})") from None
        table = doc.get("wandb", {})
        if not isinstance(table, dict):
            raise TrackingError(f"log_tracker_config: {path}: [wandb] must be a table of wandb.init "
                                "arguments")
        other = sorted(k for k in doc if k != "wandb")
        if other:
            raise TrackingError(f"log_tracker_config: {path}: unknown table {other[0]!r}; only "
                                "[wandb] (the arguments of wandb.init) is read")
        kwargs.update(table)
    return kwargs


def run_folder(opts: Options, now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d%H%M%S", time.localtime(now))
    return os.path.join(required(opts.logging_dir, "logging_dir"), (opts.log_prefix or "") + stamp)


def group_names(method, bundle) -> list[str]:
    """One tag name per optimizer parameter group (in the method's group order)."""
    groups = method.param_groups
    names = method.group_names  # set by the method's setup(): the module's descriptions, or None
    if not names or len(names) != len(groups):
        tes = bundle.text_encoders
        te_of = {id(p): i for i, te in enumerate(tes) for p in te.parameters()}
        names = []
        for g in groups:
            i = te_of.get(id(g["params"][0]))
            if i is None:
                names.append("unet")
            else:
                names.append("textencoder" if len(tes) == 1 else f"textencoder{i + 1}")
    out: list[str] = []
    seen: dict[str, int] = {}
    for n in names:  # duplicates (should a module repeat a description) get a suffix
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}{seen[n]}")
    return out


class _TensorBoard:
    def __init__(self, folder: str):
        # lazy: from torch.utils.tensorboard import SummaryWriter would add 85 ms of imports
        # (measured) to an SD LoRA run, which does not use it; __init__() does
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=folder)
        logger.info(f"logging to {folder}")

    def scalars(self, values: dict, step: int) -> None:
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, step)

    def image(self, tag: str, array, step: int) -> None:
        self.writer.add_image(tag, array, step, dataformats="HWC")

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, opts: Options, folder: str | None):
        # lazy: optional dependency (wandb: pip install -e ".[wandb]"), imported when used
        import wandb

        if opts.wandb_api_key:
            os.environ["WANDB_API_KEY"] = opts.wandb_api_key  # this process only; never on disk
        kwargs = wandb_init_kwargs(opts)
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
            kwargs.setdefault("dir", folder)
        self.wandb = wandb
        self.wandb_run = wandb.init(**kwargs)
        logger.info(f"logging to wandb project {kwargs['project']}"
                    + (f" ({self.wandb_run.dir})" if getattr(self.wandb_run, "dir", None) else ""))

    def scalars(self, values: dict, step: int) -> None:
        self.wandb_run.log(values, step=step)

    def image(self, tag: str, array, step: int) -> None:
        self.wandb_run.log({tag: self.wandb.Image(array)}, step=step)

    def flush(self) -> None:
        pass  # wandb writes in the background; finish() completes it

    def close(self) -> None:
        self.wandb_run.finish()


class Tracker:
    """The main process's trackers (TensorBoard and/or wandb), written to with the same tags."""

    def __init__(self, opts: Options, method, bundle):
        self.folder = run_folder(opts) if opts.logging_dir else None
        self.backends: list[_TensorBoard | _Wandb] = []
        self._closed = False
        if uses_tensorboard(opts):
            folder = required(self.folder, "logging_dir")
            os.makedirs(folder, exist_ok=True)
            self.backends.append(_TensorBoard(folder))
        if uses_wandb(opts):
            self.backends.append(_Wandb(opts, self.folder))
        atexit.register(self.close)  # an interrupted run (SIGINT/SIGTERM state) still flushes
        self.names = group_names(method, bundle)
        self.base_lrs = [float(g["lr"]) for g in method.param_groups]

    def scalars(self, values: dict, step: int) -> None:
        values = {tag: float(v) for tag, v in values.items()}
        for b in self.backends:
            b.scalars(values, step)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars({tag: value}, step)

    def image(self, tag: str, array, step: int) -> None:
        for b in self.backends:
            b.image(tag, array, step)

    def flush(self) -> None:
        for b in self.backends:
            b.flush()

    def lrs(self, lr0: float) -> list[float]:
        """Each group's learning rate from the first group's: the schedule (a LambdaLR of the
        step) scales every group's base rate by the same factor."""
        b0 = self.base_lrs[0]
        return [lr0 * b / b0 if b0 else b for b in self.base_lrs]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for b in self.backends:
            b.close()


class Reporter:
    """What the loop reports, in every process: validation and samples when due (every
    process), scalars and images to the main process's trackers."""

    def __init__(self, opts: Options, plan, tset, stream: progress_stream.ProgressStream | None, method,
                 bundle, *, validate: Callable, sample: Callable):
        """``stream``: progress_file's (main process; None: none); ``method`` and ``bundle``:
        the trackers' names of the learning rates; ``validate(progress, label) -> loss`` and
        ``sample(step) -> files``: the run's validation and sample images, when due."""
        self.opts, self.plan, self.tset = opts, plan, tset
        self.method, self.bundle = method, bundle
        self._validate_fn, self._sample_fn = validate, sample
        self.tracker: Tracker | None = None
        self._started = False
        self.validated_at: int | None = None  # the step of the last validation / samples
        self.sampled_at: int | None = None
        self.stream = stream
        self._saves_reported = 0
        self._state_reported = None

    def _tracker(self) -> Tracker | None:
        """The main process's Tracker when the run logs anywhere (logging_dir, log_with)."""
        if not self._started:
            self._started = True
            o = self.opts
            if (uses_tensorboard(o) or uses_wandb(o)) and is_main_process():
                self.tracker = Tracker(o, self.method, self.bundle)
        return self.tracker

    def before_training(self, progress) -> None:
        """Start the trackers (so that e.g. a failing wandb.init stops the run before its first
        step); announce the held-out images; sample_at_first: the samples of the starting
        weights."""
        self._tracker()
        if self.stream is not None:
            p = self.plan
            self.stream.event("plan", total_steps=p.total_steps, global_batch=p.global_batch,
                              steps_per_epoch=p.steps_per_epoch, epochs=p.epochs,
                              processes=p.processes, train_batch_size=p.train_batch_size,
                              gradient_accumulation_steps=p.gradient_accumulation_steps,
                              images=p.images, repeats_total=p.repeats_total,
                              start_step=progress.global_step, output_dir=self.opts.output_dir,
                              output_name=self.opts.output_name)
        n = len(self.tset.val_items)
        if n and is_main_process():
            logger.info(f"validation_split {self.opts.validation_split}: {n} image(s) held out for "
                        f"the validation loss, {len(self.tset.train_items)} train")
        if self.opts.sample_at_first and self.opts.sample_prompts:
            self._sample(progress)

    def after_step(self, progress, norm: float | None = None) -> None:
        """``norm``: the step's gradient norm as the step read it (None: not computed)."""
        step = progress.global_step
        if self.stream is not None:  # the host values of this step's one read: no device read
            epoch = progress.position[0] - (progress.position[1] == 0)
            self.stream.event("step", step=step, epoch=epoch, loss=progress.loss_log[-1],
                              lr=progress.lr_log[-1], grad_norm=norm,
                              samples_seen=progress.samples_seen)
        if validation.due(self.opts, self.tset, step=step):
            self._validate(progress, "")
        if sampling.due(self.opts, step=step):
            self._sample(progress)
        t = self._tracker()
        if t is None:
            return
        log = progress.loss_log
        window = log[-self.plan.steps_per_epoch:]
        values = {"loss/current": log[-1], "loss/average": sum(window) / len(window)}
        for name, lr in zip(t.names, t.lrs(progress.lr_log[-1])):
            values[f"lr/{name}"] = lr
        if progress.max_norm_stats is not None:  # scale_weight_norms
            values.update(max_norm_scalars(progress.max_norm_stats))
        t.scalars(values, step)

    def after_epoch(self, progress, epoch: int) -> None:
        step = progress.global_step
        if validation.due(self.opts, self.tset, epoch=epoch) and self.validated_at != step:
            self._validate(progress, f", end of epoch {epoch}")
        if sampling.due(self.opts, epoch=epoch) and self.sampled_at != step:
            self._sample(progress)
        t = self._tracker()
        if t is None:
            return
        done = self.plan.steps_per_epoch * (epoch - 1)  # steps before this epoch (loss_log[s-1]: step s)
        losses = progress.loss_log[done:step]
        if losses:
            t.scalar("loss/epoch", sum(losses) / len(losses), step)
        t.flush()

    def _validate(self, progress, label: str) -> None:
        value = self._validate_fn(progress, label)
        self.validated_at = progress.global_step
        if self.stream is not None:
            self.stream.event("validation", step=progress.global_step, loss=value)
        t = self._tracker()
        if t is not None:
            t.scalar("loss/validation", value, progress.global_step)

    def _sample(self, progress) -> None:
        """Every process renders its share; the main process logs all of them (after the
        barrier)."""
        step = progress.global_step
        self._sample_fn(step)
        self.sampled_at = step
        o = self.opts
        files = [sampling.image_path(o, step, i, sampling.prompt_seed(o, p, i))
                 for i, p in enumerate(sampling.load_prompts(required(o.sample_prompts, "sample_prompts")))]
        if self.stream is not None:
            self.stream.event("samples", step=step, files=files)
        t = self._tracker()
        if t is None:
            return
        for i, path in enumerate(files):
            with Image.open(path) as im:
                t.image(f"sample/{i:02d}", np.asarray(im.convert("RGB")), step)

    def sample_now(self, progress) -> None:
        """The control channel's sample_now: the samples of this step's weights."""
        if self.opts.sample_prompts:
            self._sample(progress)
        else:
            logger.warning("sample_now: no sample_prompts are set; nothing to sample")

    def saves(self, saved: list, progress) -> None:
        """The model files and training state written since the last call, to the stream."""
        if self.stream is None:
            return
        for path in saved[self._saves_reported:]:
            self.stream.event("save", step=progress.global_step, file=path)
        self._saves_reported = len(saved)
        if progress.last_state is not None and progress.last_state != self._state_reported:
            self._state_reported = progress.last_state
            self.stream.event("state", step=progress.last_state[1], folder=progress.last_state[0])

    def nonfinite(self, what: str, step: int, action: str) -> None:
        if self.stream is not None:
            self.stream.event("nonfinite", step=step, what=what, action=action)

    def control(self, command: str, step: int) -> None:
        if self.stream is not None:
            self.stream.event("control", step=step, command=command)

    def finish(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
        self.tracker = None
        if self.stream is not None:
            self.stream.close()
            self.stream = None
