"""Model saves, training states and sd-scripts' rotation of old ones, for a run (library/run/stages.py).

    Saver(opts, record, base_metadata, saved, targets=SaveTargets(...), accelerator=, strategy=,
          stepper=, uploader=, epochs=)
        .save(progress, epoch=, step=, final=)   the model (and its EMA), then the training state;
                                                 each uploaded to the Hub when set (library/outputs/hub.py)
        .save_ema(progress, epoch=, step=, metadata=)
        .state_of_this_step(progress)            the state after the last step (SIGINT, non-finite stop)

Every process calls these (gathers and shard writes are collectives); the main process writes
the model files. How the full weights are gathered (fsdp), or the float32 master weights taken
(deepspeed), is the strategy's ``full_weights`` / ``ema_weights`` (library/distributed/strategy.py).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from library.accelerator import is_main_process
from library.config.parse import required
from library.files import SaveError, output_file, save_elsewhere
from library.outputs import metadata, train_state
from library.outputs.hub import Uploader
from library.outputs.train_state import saved_tensors
from library.training import nonfinite, offload

if TYPE_CHECKING:  # annotations only
    import torch
    from accelerate import Accelerator

    from library.config.parse import Options
    from library.distributed.strategy import Strategy
    from library.models.loading import ModelBundle
    from library.training.ema import EMA
    from library.training.methods import Method
    from library.training.offload import Frozen
    from library.training.stepper import Stepper

logger = logging.getLogger("sdtk")


@dataclass(frozen=True, slots=True)
class SaveTargets:
    """What a model save writes: the trained ``method`` over the model ``bundle``, its ``params``
    and their ``named`` list (train_state.named_trainable: the finite check and the training
    state), the ``ema`` (None: off), and the ``frozen`` parts a full model's file brings back."""

    bundle: ModelBundle
    method: Method
    params: list[torch.nn.Parameter]
    named: list[tuple[str, torch.nn.Parameter]]
    ema: EMA | None
    frozen: Frozen


class Saver:
    """Writes a run's model files and training states: the ``targets`` (SaveTargets), through
    the ``strategy``'s full weights, the ``stepper``'s eval mode and state, the ``accelerator``'s
    barriers. ``record``: what a state records of the run (train_state.RunRecord); ``saved``:
    the list the model files written are appended to; ``uploader`` (main process, hub.Uploader):
    where each saved file (and, with save_state_to_huggingface, each state) is uploaded.
    ``record`` None: a run that keeps no training state (train_leco, which cannot resume);
    ``epochs`` False: a run without epochs (train_leco: no ss_epoch)."""

    def __init__(self, opts: Options, record: train_state.RunRecord | None, base_metadata: dict,
                 saved: list[str], *, targets: SaveTargets, accelerator: Accelerator,
                 strategy: Strategy, stepper: Stepper, uploader: Uploader | None = None,
                 epochs: bool = True):
        self.opts, self.record, self.base_metadata, self.saved = opts, record, base_metadata, saved
        self.uploader, self.epochs = uploader, epochs
        self.accelerator, self.strategy, self.stepper = accelerator, strategy, stepper
        t = targets
        self.bundle, self.method, self.params, self.named = t.bundle, t.method, t.params, t.named
        self.ema, self.frozen = t.ema, t.frozen
        if not opts.output_dir:  # output_checks.prepare requires it before any weight loads
            raise ValueError("Saver: output_dir is not set")
        self.output_dir: str = opts.output_dir

    def save(self, progress, *, epoch=None, step=None, final=False) -> None:
        # Schedule-free optimizers save their eval iterate; every process switches, so ranks agree.
        with self.stepper.eval_mode():
            self._save_model(progress, epoch=epoch, step=step)
        # The training state holds the training iterate (outside eval_mode).
        self._save_states(progress, epoch=epoch, step=step, final=final)

    def _save_model(self, progress, *, epoch=None, step=None) -> None:
        opts, acc = self.opts, self.accelerator
        acc.wait_for_everyone()
        meta = metadata.step_metadata(self.base_metadata,
                                      epoch=(epoch or progress.epochs_done) if self.epochs else None,
                                      step=progress.global_step, finished_at=time.time())
        ext = self.method.extension()
        # fsdp: every process joins the gather of the full weights; the main process writes them.
        # deepspeed in bf16/fp16: the float32 master weights are saved (a collective too).
        with self.strategy.full_weights(self.bundle, self.params):
            path = output_file(self.output_dir, opts.output_name, ext, epoch=epoch, step=step)
            # nothing non-finite is written, and no good file replaced by it (every process)
            nonfinite.check_before_save(saved_tensors(self.named, self.ema), path, acc)
            if is_main_process():
                os.makedirs(self.output_dir, exist_ok=True)
                # a full model's file holds VAE and TEs
                with offload.available_for_save(self.frozen, self.method):
                    self._write_model(path, meta)
                    logger.info(f"saved {path}")
                    self.saved.append(path)
        if is_main_process():  # (the full weights released first)
            self._upload(path, *self.method.companion_files(path))
        if self.ema is not None:
            self.save_ema(epoch=epoch, step=step, metadata=meta)
        acc.wait_for_everyone()

    def save_ema(self, *, epoch=None, step=None, metadata=None) -> str:
        """``<output_name>-ema[-epoch|-step]``: the EMA swapped into the parameters (and gathered:
        every process calls it), written by the main process with the method's save."""
        opts, ema = self.opts, self.ema
        if ema is None:
            raise ValueError("save_ema: the run has no EMA (ema_decay)")
        path = output_file(self.output_dir, opts.output_name + "-ema", self.method.extension(),
                           epoch=epoch, step=step)
        meta = dict(metadata or {})
        if meta:
            meta["sdtk.ema_decay"] = str(ema.decay)
        with self.strategy.ema_weights(ema, self.bundle, self.params):
            if is_main_process():
                with offload.available_for_save(self.frozen, self.method):
                    self._write_model(path, meta, "the EMA weights were")
        if is_main_process():
            logger.info(f"saved {path} (EMA, decay {ema.decay})")
            self.saved.append(path)
            self._upload(path)
        return path

    def _upload(self, *paths: str) -> None:
        """The files just saved (main process), to the Hub when huggingface_repo_id is set."""
        if self.uploader is not None:
            for p in paths:
                if os.path.exists(p):
                    self.uploader.upload(p)

    def _write_model(self, path: str, meta: dict, what: str = "the weights were") -> None:
        """The model (or EMA) file; when it cannot be written (disk full, read-only), into the
        system temp dir instead, and the run ends with one line saying where (library/files.py)."""
        def write(p):
            self.method.save(p, self.opts.save_precision, meta)

        try:
            write(path)
        except SaveError as e:
            raise save_elsewhere(e, write, what) from None

    def _save_states(self, progress, *, epoch=None, step=None, final=False) -> None:
        """``save_state``: a state next to each model save; ``save_state_on_train_end``: the
        final one. Then sd-scripts' rotation of old models and states."""
        opts = self.opts
        if opts.save_state or (final and opts.save_state_on_train_end):
            path = train_state.state_dir(self.output_dir, opts.output_name, epoch=epoch, step=step)
            self.write_state(progress, path)
            progress.last_state = (path, progress.global_step)
            if opts.save_state_to_huggingface and is_main_process():
                self._upload(path)
        if is_main_process() and not final:
            _rotate(opts, self.method, self.ema is not None, epoch=epoch, step=step,
                    uploader=self.uploader)
        self.accelerator.wait_for_everyone()

    def write_state(self, progress, path: str) -> None:
        """The training state of ``progress`` (after its last completed step) into ``path``."""
        if self.record is None:
            raise RuntimeError("this run keeps no training state (Saver.keeps_state)")
        train_state.write_state(path, logger, record=self.record, progress=progress,
                                named=self.named, ema=self.ema, stepper=self.stepper,
                                strategy=self.strategy, accelerator=self.accelerator)

    @property
    def keeps_state(self) -> bool:
        """Whether the run writes training states (train_leco keeps none: it cannot resume)."""
        return self.record is not None

    def state_of_this_step(self, progress) -> str:
        """``<output_name>-step<N>-state`` after the last completed step, written unless a save
        of this step wrote it already; returns its folder."""
        opts = self.opts
        path = train_state.state_dir(self.output_dir, opts.output_name, step=progress.global_step)
        if progress.last_state != (path, progress.global_step):
            self.write_state(progress, path)
        return path


def _rotate(opts: Options, method, with_ema: bool, *, epoch=None, step=None,
            uploader: Uploader | None = None) -> None:
    """sd-scripts' save_last_n_*: drop the model (and state) saved n saves (epochs) or more
    than n steps (steps) before this one (once its upload, if one is in flight, has finished)."""
    output_dir = required(opts.output_dir, "output_dir")
    n_model = opts.save_last_n_epochs if epoch is not None else opts.save_last_n_steps
    n_state = (opts.save_last_n_epochs_state if epoch is not None
               else opts.save_last_n_steps_state) or n_model
    for n, kind in ((n_model, "model"), (n_state, "state")):
        if not n or (kind == "state" and not opts.save_state):
            continue
        if epoch is not None:
            old = {"epoch": epoch - required(opts.save_every_n_epochs, "save_every_n_epochs") * n}
        else:
            no = step - n - 1
            old = {"step": no - no % opts.save_every_n_steps}
        if next(iter(old.values())) <= 0:
            continue
        if kind == "state":
            if uploader is not None:
                uploader.settled(train_state.state_dir(output_dir, opts.output_name, **old))
            train_state.remove_state(train_state.state_dir(output_dir, opts.output_name,
                                                           **old), logger)
            continue
        names = [opts.output_name]
        if with_ema:
            names.append(opts.output_name + "-ema")  # the EMA saves rotate with the models
        for name in names:
            path = output_file(output_dir, name, method.extension(), **old)
            if uploader is not None:
                for p in (path, *method.companion_files(path)):
                    uploader.settled(p)
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
