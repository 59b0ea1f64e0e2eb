"""The one training run shared by train_lora.py, train_dreambooth.py, finetune.py and
train_textual_inversion.py.

Stages: plan (no weights) -> validate -> load -> set-up -> cache -> train (library/run/loop.py) ->
save (library/outputs/checkpoints.py). A ``Run`` holds the options, the plan and training set, and two
declared records (library/run/run_state.py): its ``parts`` (Components, built by the stages here)
and its ``progress``. docs/INTERNALS.md has the path of one run.
"""
from __future__ import annotations

import os
import time

from library.data import debug_dataset
from library.distributed import accelerator, deepspeed_zero
from library.errors import UserError
from library.log import logger, setup_logging
from library.models import family, inpainting, loading
from library.outputs import metadata, output_checks
from library.run.run_state import Components
from library.training import ema, host_memory, losses, offload
from library.training.compile_unet import compile_unet
from library.training.plan import plan_run, print_plan
from library.training.progress import Progress
from library.training.stop_signals import StopSignals


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
        self.stop_signals = None            # stop_signals.StopSignals while training

    # -- stages -------------------------------------------------------------------------------
    def validate(self):
        """Checks that need imports but no weights (library/run/run_checks.py)."""
        # lazy: the plan and the checks before loading come before torch is imported
        from library.run import run_checks

        run_checks.check_before_loading(self.opts, self.method_name, self.plan)

    def load(self):
        # lazy: the plan and the checks before loading come before torch is imported
        from accelerate.utils import set_seed

        from library.data import latent_cache
        from library.training import network_options

        opts, c = self.opts, self.parts
        c.accelerator = acc = accelerator.accelerator_for(opts)
        if acc.num_processes != self.plan.processes:
            # The launcher's WORLD_SIZE and the joined job disagree: recompute so the plan is true.
            self.opts, self.tset, self.plan = plan_run(opts, acc.num_processes)
        if acc.device.type == "cpu":
            # On the CPU the resident set is what fits: freed tensors go back to the system.
            host_memory.return_large_frees()
        set_seed(opts.seed)
        c.bundle = b = loading.load_from_options(opts)
        # base_weights: merged into the model as loaded, before any dtype cast (set-up)
        network_options.merge_base_weights(b, opts, logger)
        # a 9-channel (inpainting) U-Net and train_inpainting must agree; DreamBooth / fine-tune
        # of a 4-channel model with train_inpainting widen its first convolution
        inpainting.prepare_unet(b.unet, opts, self.method_name, logger)
        c.adapter = family.adapter_for(b, max_token_length=opts.max_token_length,
                                       weighted=opts.weighted_captions)
        if opts.no_token_padding and b.family == "sdxl":  # a single file: known only now
            family.check_token_padding(opts, lambda _: b.family)
        b.vae.to(acc.device, dtype=latent_cache.vae_dtype(opts))
        b.vae.eval()
        loading.set_attention(b, opts)
        # model-dependent loss-option errors now, before caching
        c.losses = losses.Losses(opts, b.noise_scheduler, b.v_parameterization)

    def setup_method(self):
        # lazy: the plan and the checks before loading come before torch is imported
        import torch

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
            raise UserError("nothing to train: no trainable parameter has a non-zero learning rate "
                            "(check learning_rate, unet_lr, text_encoder_lr and network_train_*_only)")
        if c.method.network is not None:
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
            # lazy: the plan and the checks before loading come before torch is imported
            from library.training.stepper import fused_mode

            # a fused stepper steps in each gradient's hook: one graph per block, not one for all
            # the U-Net's gradients at once (library/training/compile_unet.py)
            fused = fused_mode(opts)
            if fused:
                logger.info(f"torch_compile with {fused}: the U-Net is compiled block by block, "
                            "so that one block's gradients, not the whole U-Net's, exist at once")
            compile_unet(b.unet, opts.dynamo_backend, logger, per_block=fused is not None)
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
        # lazy: the plan and the checks before loading come before torch is imported
        from library.data import cache_stage

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
        c.frozen = offload.release_after_caching(opts, c, logger)

    def micro_step_loss(self, epoch: int, idx: list[int], loaded_images, n_global: int,
                        step: int | None = None):
        """Sum over this process's samples of weight * loss, divided by the global batch size."""
        return self.parts.batch_loss.training(epoch, idx, loaded_images, n_global, step)

    def train(self):
        # lazy: the plan and the checks before loading come before torch is imported
        from library.run import loop

        loop.train(self)

    def save(self, *, epoch=None, step=None, final=False):
        # lazy: the plan and the checks before loading come before torch is imported
        from library.outputs import checkpoints

        checkpoints.save(self, epoch=epoch, step=step, final=final)


def run(opts, method_name: str) -> Run | None:
    """Plan, then (unless --dry_run) load, train and save. Returns the Run for tests."""
    setup_logging()
    opts = deepspeed_zero.resolve_options(opts)  # an Accelerate DeepSpeed launch config -> the deepspeed options
    processes = accelerator.launched_world_size()
    opts, tset, plan = plan_run(opts, processes)
    r = Run(opts, method_name)
    r.tset, r.plan = tset, plan
    main = int(os.environ.get("RANK", "0")) == 0
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
            path = os.path.join(opts.output_dir, f"{opts.output_name}_debug_dataset.png")
            debug_dataset.write_sheet(tset, plan, opts.seed, path, logger)
            print(f"debug_dataset: wrote {path}; exiting without training", flush=True)
        return None
    if opts.dry_run:
        print_plan(r.plan, main)  # the plan needs no torch: printed first
        r.validate()  # optimizer, network module, combinations: a dry run stops on them too
        # lazy: the plan and the checks before loading come before torch is imported
        from library.training import memory_estimate

        memory_estimate.report(opts, method_name, r.tset, r.plan.processes, main)  # no weights
        return None
    started = time.time()
    r.validate()  # optimizer, network module, combinations: before any folder is made
    lock = output_checks.prepare(opts, method_name, main, logger)  # before any weight loads
    try:
        with lock:
            return _train(r, opts, started, resume)
    finally:
        if r.parts.frozen is not None:
            r.parts.frozen.close()  # spill files of released parts
        if r.parts.strategy is not None:
            r.parts.strategy.close()  # e.g. the DeepSpeed engine (and the process group made for it)


def _train(r: Run, opts, started: float, resume) -> Run:
    r.load()
    c = r.parts
    print_plan(r.plan, c.accelerator.is_main_process)
    r.setup_method()
    r.cache()
    if resume:
        # lazy: the plan and the checks before loading come before torch is imported
        from library.outputs import train_state

        # again: the joined job's plan may differ from the launcher's
        resume = train_state.check_resume(r.opts, r.method_name, r.plan, r.tset, None)
        r.progress = train_state.load_state(r, *resume, logger)

    r.base_metadata = metadata.build_metadata(
        opts=opts, family=c.bundle.family, v_parameterization=c.bundle.v_parameterization,
        adapter=c.method.adapter, num_train_images=r.plan.repeats_total,
        num_reg_images=len(r.tset.reg_items), train_items=r.tset.train_items, started_at=started,
        network_info=c.method.info)

    with StopSignals() as r.stop_signals:  # SIGINT/SIGTERM: stop after a step, write a state
        r.train()
    r.stop_signals = None
    r.save(final=True)
    c.reporter.saves(r.saved, r.progress)
    c.reporter.finish()  # close the TensorBoard log
    p = r.progress
    if p.loss_log and c.accelerator.is_main_process:
        first = sum(p.loss_log[:3]) / min(3, len(p.loss_log))
        last = sum(p.loss_log[-3:]) / min(3, len(p.loss_log))
        print(f"done: steps {p.global_step}, epochs {p.epochs_done}, loss first {first:.4f} "
              f"last {last:.4f}", flush=True)
    return r
