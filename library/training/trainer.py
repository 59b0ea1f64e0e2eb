"""The one training run shared by train_lora.py, train_dreambooth.py, finetune.py and
train_textual_inversion.py.

Stages: plan (no weights) -> validate -> load -> set-up -> cache -> train (library/training/loop.py) ->
save (library/outputs/saver.py). A ``Run`` holds the options, the plan and training set, and two
declared records (library/training/run_state.py): its ``parts`` (Components, built by the stages here)
and its ``progress``. docs/INTERNALS.md has the path of one run.
"""
from __future__ import annotations

import logging
import os
import sys
import time

from library.distributed import accelerator as distributed
from library.data import step_plan
from library.training.run_state import Components, Progress
from library.data.training_data import build_training_set

logger = logging.getLogger("sdtk")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (tests and wrappers replace it)."""

    def emit(self, record):
        self.stream = sys.stderr
        super().emit(record)


def setup_logging():
    # Noise from dependencies that says nothing about this run: bitsandbytes' optional 4-bit CPU
    # kernels, and diffusers' float32-modules notice on .to() when the list is empty.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    logging.getLogger("diffusers.models.modeling_utils").addFilter(
        lambda r: "should be kept in float32: []" not in r.getMessage())
    if not logger.handlers:
        h = _StderrHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        logger.addHandler(h)
        # One voice per job: other ranks report only problems.
        logger.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
        logger.propagate = False


def seconds_since_process_start() -> float:
    """Seconds since the entry script imported ``library`` (its first import)."""
    import library

    return time.time() - library.STARTED


def plan_run(opts, processes: int):
    """-> (opts, training set, step plan). The options come back with what the dataset config
    decides (its batch size and resolution): they are frozen, so the run holds the copy."""
    tset = build_training_set(opts, logger)
    resolved = {}
    if tset.batch_size is not None and tset.batch_size != opts.train_batch_size:
        # The dataset config's batch_size (dataset -> [general] -> train_batch_size) is the
        # per-process batch, as sd-scripts; every dataset has the same one (checked).
        logger.info(f"train_batch_size {tset.batch_size} from the dataset config "
                    f"(run option: {opts.train_batch_size})")
        resolved["train_batch_size"] = tset.batch_size
    if opts.resolution is None:
        resolved["resolution"] = tset.resolution  # set by the dataset config; recorded in the metadata
    if resolved:
        opts = opts.replace(**resolved)
    if opts.cache_text_encoder_outputs or opts.cache_text_encoder_outputs_to_disk:
        from library.errors import UserError

        if opts.script == "train_lora" and not opts.network_train_unet_only:
            raise UserError("cache_text_encoder_outputs: the LoRA would train the text encoder "
                            "too; add network_train_unet_only (as sd-scripts requires)")
        if opts.script != "train_lora" and opts.train_text_encoder:
            raise UserError("cache_text_encoder_outputs cannot be combined with train_text_encoder: "
                            "a trained text encoder's outputs change every step")
    plan = step_plan.make_plan(
        bucket_sizes=tset.bucket_sizes(), images=len(tset.train_items),
        repeats_total=tset.repeats_total, reg_images=len(tset.reg_items),
        reg_samples=tset.reg_samples, processes=processes,
        train_batch_size=opts.train_batch_size,
        gradient_accumulation_steps=opts.gradient_accumulation_steps,
        max_train_epochs=opts.max_train_epochs, max_train_steps=opts.max_train_steps,
        lr_warmup_steps=opts.lr_warmup_steps)
    return opts, tset, plan


def print_plan(plan, main: bool):
    if not main:
        return
    print("step plan:", flush=True)
    for line in plan.lines():
        print("  " + line, flush=True)
    for line in step_plan.what_if_lines(plan):
        print("  note: " + line, flush=True)


class Run:
    """One training run; its methods are the stages of ``run()``. Other modules get the parts
    they need as parameters (mostly ``run.parts``) and write nothing into a Run."""

    __slots__ = ("opts", "method_name", "tset", "plan", "parts", "progress", "base_metadata",
                 "saved", "stop_signals")

    def __init__(self, opts, method_name: str):
        self.opts = opts
        self.method_name = method_name
        self.tset = self.plan = None        # plan_run
        self.parts = Components()
        self.progress = Progress()          # a resume replaces it with the saved one
        self.base_metadata: dict = {}
        self.saved: list[str] = []          # model files written, in order
        self.stop_signals = None            # train_state.StopSignals while training

    # -- stages -------------------------------------------------------------------------------
    def validate(self):
        """Checks that need imports but no weights (library/training/run_checks.py)."""
        from library.training import run_checks

        run_checks.check_before_loading(self.opts, self.method_name, self.plan)

    def load(self):
        from accelerate.utils import set_seed

        from library.models import family
        from library.data import latent_cache
        from library.training import losses
        from library.models import loading as models
        from library.training import network_options

        opts, c = self.opts, self.parts
        c.accelerator = acc = distributed.accelerator_for(opts)
        if acc.num_processes != self.plan.processes:
            # The launcher's WORLD_SIZE and the joined job disagree: recompute so the plan is true.
            self.opts, self.tset, self.plan = plan_run(opts, acc.num_processes)
        if acc.device.type == "cpu":
            from library.training import host_memory

            # On the CPU the resident set is what fits: freed tensors go back to the system.
            host_memory.return_large_frees()
        set_seed(opts.seed)
        c.bundle = b = models.load_from_options(opts)
        # base_weights: merged into the model as loaded, before any dtype cast (set-up)
        network_options.merge_base_weights(b, opts, logger)
        c.adapter = family.adapter_for(b, max_token_length=opts.max_token_length,
                                       weighted=opts.weighted_captions)
        if opts.no_token_padding and b.family == "sdxl":  # a single file: known only now
            family.check_token_padding(opts, lambda _: b.family)
        b.vae.to(acc.device, dtype=latent_cache.vae_dtype(opts))
        b.vae.eval()
        models.set_attention(b, opts)
        # model-dependent loss-option errors now, before caching
        c.losses = losses.Losses(opts, b.noise_scheduler, b.v_parameterization)

    def setup_method(self):
        import torch

        from library.training import ema
        from library.models import placement
        from library.distributed import strategy
        from library.outputs import tracking
        from library.training import validation
        from library.training.batch_loss import BatchLoss
        from library.training.methods import make_method

        opts, c = self.opts, self.parts
        b, acc = c.bundle, c.accelerator
        torch.manual_seed(opts.seed)  # network init is part of the seeded run
        c.method = make_method(self.method_name, opts, b)
        # The dtypes of every part (library/models/placement.py, shared with the memory estimate): the
        # trained weights float32, or with full_bf16 / full_fp16 bf16 / fp16 (the stepper updates
        # them in float32 and rounds back); the frozen parts the mixed-precision dtype, or with
        # fp8_base / fp8_base_unet float8. Placed before the network hooks the modules, so its
        # hooks call the fp8 forward; after the load (and any merge of base weights into it).
        c.placement = pl = placement.dtype_placement(opts, self.method_name,
                                                     c.method.train_text_encoder, len(b.text_encoders))
        placement.place(b.unet, pl.unet, pl.compute, acc.device)
        for te, te_dtype in zip(b.text_encoders, pl.text_encoders):
            placement.place(te, te_dtype, pl.compute, acc.device)
        groups = c.method.setup()
        c.adapter.rewrite = c.method.prompt_rewrite()  # new tokens' N-vector expansion
        if not any(p.requires_grad for g in groups for p in g["params"]):
            from library.errors import UserError

            raise UserError("nothing to train: no trainable parameter has a non-zero learning rate "
                            "(check learning_rate, unet_lr, text_encoder_lr and network_train_*_only)")
        if self.method_name == "lora":
            c.method.network.to(acc.device, dtype=pl.network)
        if opts.gradient_checkpointing:
            b.unet.enable_gradient_checkpointing()
            if c.method.train_text_encoder:
                for te in b.text_encoders:
                    (getattr(te, "activation_checkpointing_enable", None)
                     or te.gradient_checkpointing_enable)()  # transformers 5 renamed it
        b.unet.train()
        for te in b.text_encoders:
            te.train(c.method.train_text_encoder)
        if opts.torch_compile:  # after the network hooks and checkpointing: both are in the graph
            from library.training.compile_unet import compile_unet

            compile_unet(b.unet, opts.dynamo_backend, logger)
        # single process, DDP, FSDP or DeepSpeed: chosen once, it wraps or shards the trained
        # modules (groups re-pointed at FSDP's shards) and builds the stepper it needs
        c.strategy = strategy.for_run(opts, acc)
        c.strategy.prepare(c, groups)
        c.params = c.method.trainable_parameters()
        c.stepper = c.strategy.make_stepper(opts, c, groups, self.plan)
        c.ema = ema.for_params(opts, c.params)  # ema_decay: from the initial weights (None when off)
        c.validation = validation.Validation(opts, self.tset)
        c.batch_loss = BatchLoss(opts, self.tset, c)
        c.reporter = tracking.Reporter(opts, self.plan, self.tset, c)

    def cache(self):
        """Latents and, with cache_text_encoder_outputs, text-encoder outputs
        (library/data/cache_stage.py); then the parts no longer needed leave the device."""
        from library.data import cache_stage
        from library.training import offload as frozen

        opts, c = self.opts, self.parts
        if opts.cache_latents or opts.cache_latents_to_disk:
            c.caches.latents, c.caches.latent_key = cache_stage.latents(opts, self.tset, c)
        if opts.cache_text_encoder_outputs or opts.cache_text_encoder_outputs_to_disk:
            c.caches.text = cache_stage.text(opts, self.tset, c)
        if c.caches.latents is not None:
            # before the VAE leaves: the validation latents too
            c.validation.encode_held_out(c.bundle.vae, c.accelerator.device, c.strategy)
        # The VAE (latents cached) and text encoders (outputs cached) leave the device, or on a
        # CPU-only machine their memory (library/training/offload.py); the log says what that saved.
        c.frozen = frozen.release_after_caching(opts, c, logger)

    def micro_step_loss(self, epoch: int, idx: list[int], loaded_images, n_global: int):
        """Sum over this process's samples of weight * loss, divided by the global batch size."""
        return self.parts.batch_loss.training(epoch, idx, loaded_images, n_global)

    def train(self):
        from library.training import loop

        loop.train(self)

    def save(self, *, epoch=None, step=None, final=False):
        from library.outputs import saver

        saver.save(self, epoch=epoch, step=step, final=final)


def _view(record: str, name: str, inner: str | None = None):
    """A read-only view of ``record.name`` for callers (tests, tools)."""
    def get(self):
        v = getattr(getattr(self, record), name)
        return getattr(v, inner) if inner else v
    return property(get, doc=f"run.{record}.{name}" + (f".{inner}" if inner else ""))


for _n in ("accelerator", "bundle", "adapter", "losses", "placement", "method", "strategy",
           "stepper", "params", "ema", "frozen"):
    setattr(Run, _n, _view("parts", _n))
for _n in ("global_step", "samples_seen", "position", "loss_log", "lr_log", "val_log"):
    setattr(Run, _n, _view("progress", _n))
Run.epoch = _view("progress", "epochs_done")
Run.optimizer, Run.scheduler = _view("parts", "stepper", "optimizer"), _view("parts", "stepper", "scheduler")
Run.latents, Run.latent_key = _view("parts", "caches", "latents"), _view("parts", "caches", "latent_key")
Run.text_cache = _view("parts", "caches", "text")


def _check_resume(r: Run, announce: bool = True) -> tuple[str, dict]:
    """The state ``resume`` names, checked against this run (before weights load)."""
    from library.outputs import train_state

    opts, plan = r.opts, r.plan
    path = train_state.resolve(opts.resume, opts.output_dir, logger if announce else None)
    info = train_state.read_info(path)
    saved_method = info.get("method")
    if saved_method and saved_method != r.method_name:  # before the option diff, which would
        from library.cli import METHOD_OF_SCRIPT  # name some option the two scripts set differently

        script = {m: s for s, m in METHOD_OF_SCRIPT.items()}
        raise train_state.ResumeError(
            f"resume: the state in {path} was written by {script.get(saved_method, saved_method)}"
            f".py ({saved_method}), this is {script.get(r.method_name, r.method_name)}.py; resume it "
            "with the script that wrote it")
    train_state.check_resumable(info, path, opts, plan, r.tset)
    from library.outputs import content_hash

    # the content of the model files and images (after the data check has named any new path)
    content_hash.check(info.get("content"), opts, r.tset, path, logger if announce else None)
    if announce and int(os.environ.get("RANK", "0")) == 0:
        print(f"resume: {path}: step {info['global_step']} of {plan.total_steps}, epoch "
              f"{info['epoch']} from its global batch {info['batch'] + 1} of {plan.steps_per_epoch}",
              flush=True)
    return path, info


def run(opts, method_name: str) -> Run | None:
    """Plan, then (unless --dry_run) load, train and save. Returns the Run for tests."""
    setup_logging()
    from library.distributed import deepspeed_zero as zero

    opts = zero.resolve_options(opts)  # an Accelerate DeepSpeed launch config -> the deepspeed options
    processes = distributed.launched_world_size()
    opts, tset, plan = plan_run(opts, processes)
    r = Run(opts, method_name)
    r.tset, r.plan = tset, plan
    main = int(os.environ.get("RANK", "0")) == 0
    resume = None
    if opts.resume:  # checked before any weight loads
        resume = _check_resume(r)
    from library.outputs import output_checks

    output_checks.check_name(opts.output_name)  # a dry run too: "" would write ".safetensors"
    if opts.dry_run:
        print_plan(r.plan, main)  # the plan needs no torch: printed first
        r.validate()  # optimizer, network module, combinations: a dry run stops on them too
        from library.training import memory_estimate

        memory_estimate.report(opts, method_name, r.tset, r.plan.processes, main)  # no weights
        return None
    started = time.time()
    r.validate()  # optimizer, network module, combinations: before any folder is made
    lock = _prepare_outputs(r, method_name, main)  # before any weight loads
    try:
        with lock:
            return _train(r, opts, started, resume)
    finally:
        if r.parts.frozen is not None:
            r.parts.frozen.close()  # spill files of released parts
        if r.parts.strategy is not None:
            r.parts.strategy.close()  # e.g. the DeepSpeed engine (and the process group made for it)


def _prepare_outputs(r: Run, method_name: str, main: bool):
    """The folders the run writes (every process: each writes caches or shards), then on the main
    process only the free space, stale temporaries and the output lock (returned, to hold)."""
    import contextlib

    from library.outputs import output_checks

    opts = r.opts
    output_checks.check_paths(opts)
    if not main or not opts.output_dir:
        return contextlib.nullcontext()
    output_checks.check_free_space(opts, method_name, logger)
    output_checks.remove_stale_temporaries(opts.output_dir, logger)
    return output_checks.OutputLock(opts.output_dir, opts.output_name, logger)


def _train(r: Run, opts, started: float, resume) -> Run:
    r.load()
    c = r.parts
    print_plan(r.plan, c.accelerator.is_main_process)
    r.setup_method()
    r.cache()
    if resume:
        from library.outputs import train_state

        resume = _check_resume(r, announce=False)  # again: the joined job's plan may differ from the launcher's
        r.progress = train_state.load_state(r, *resume, logger)
    from library.outputs import metadata as md

    r.base_metadata = md.build_metadata(
        opts=opts, family=c.bundle.family, v_parameterization=c.bundle.v_parameterization,
        adapter=c.method.adapter, num_train_images=r.plan.repeats_total,
        num_reg_images=len(r.tset.reg_items), train_items=r.tset.train_items, started_at=started,
        network_info=c.method.info)
    from library.outputs.train_state import StopSignals

    with StopSignals() as r.stop_signals:  # SIGINT/SIGTERM: stop after a step, write a state
        r.train()
    r.stop_signals = None
    r.save(final=True)
    c.reporter.finish()  # close the TensorBoard log
    p = r.progress
    if p.loss_log and c.accelerator.is_main_process:
        first = sum(p.loss_log[:3]) / min(3, len(p.loss_log))
        last = sum(p.loss_log[-3:]) / min(3, len(p.loss_log))
        print(f"done: steps {p.global_step}, epochs {p.epochs_done}, loss first {first:.4f} "
              f"last {last:.4f}", flush=True)
    return r
