"""A run's stages after its plan: validate -> load -> set-up -> cache -> train (library/run/loop.py)
-> save (library/outputs/checkpoints.py).

library/run/trainer.py plans the run and checks its names without torch, then hands it here
(``dry_run`` or ``train``); this module imports torch and the parts' modules at its top. A ``Run``
holds the options, the plan and training set, and two declared records (library/run/run_state.py):
its ``parts`` (Components, built once from what the stages here return) and its ``progress``.
docs/INTERNALS.md has the path of one run.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from accelerate.utils import set_seed

from library import accelerator
from library.accelerator import is_main_process
from library.data import cache_stage, latent_cache
from library.distributed import strategy
from library.errors import UserError
from library.log import logger
from library.models import family, flow_family, inpainting, loading, placement
from library.models.families import registry
from library.outputs import class_images, hub, metadata, output_checks, progress_stream, tracking, train_state
from library.outputs.checkpoints import SaveTargets, Saver
from library.run import loop, run_checks
from library.run.run_state import Caches, Components
from library.training import (block_swap, ema, flow_loss, host_memory, model_setup, network_options,
                              offload, partial_text_cache, sampling, validation)
from library.training.batch_loss import BatchLoss, check_multiplier
from library.training.compile_unet import compile_unet
from library.training.methods import make_method
from library.training.plan import plan_run, print_plan
from library.training.progress import Progress
from library.training.stepper import fused_mode
from library.training.stop_signals import StopSignals

if TYPE_CHECKING:  # annotations only
    from accelerate import Accelerator

    from library.config.parse import Options
    from library.data.step_plan import StepPlan
    from library.data.training_data import TrainingSet
    from library.distributed.strategy import Strategy
    from library.models.family import FamilyModel
    from library.models.loading import ModelBundle
    from library.models.placement import Placement
    from library.outputs.progress_stream import ProgressStream
    from library.training.ema import EMA
    from library.training.losses import Losses
    from library.training.methods import Method
    from library.training.offload import Frozen
    from library.training.stepper import Stepper
    from library.training.validation import Validation


@dataclass(frozen=True, slots=True)
class Loaded:
    """What the load stage makes."""

    accelerator: Accelerator
    bundle: ModelBundle
    losses: Losses


@dataclass(frozen=True, slots=True)
class SetUp:
    """What the set-up stage makes."""

    method: Method
    family_model: FamilyModel  # with the method's prompt rewrite
    placement: Placement
    strategy: Strategy
    stepper: Stepper
    params: list[torch.nn.Parameter]
    ema: EMA | None
    validation: Validation
    stream: ProgressStream | None  # progress_file (main process), opened before caching


@dataclass(frozen=True, slots=True)
class Cached:
    """What the cache stage makes."""

    caches: Caches
    frozen: Frozen


class Run:
    """One training run, made by library/run/trainer.py ``run()`` after the plan; its methods are
    the stages, each returning what it makes (``Loaded``, ``SetUp``, ``Cached``), from which the
    run's ``parts`` (Components) are built once. Other modules get the parts they use as parameters and write nothing into a Run."""

    __slots__ = ("opts", "method_name", "tset", "plan", "parts", "progress", "base_metadata",
                 "saved", "stop_signals", "saver", "closing")

    def __init__(self, opts: Options, method_name: str, tset: TrainingSet, plan: StepPlan):
        self.opts = opts
        self.method_name = method_name
        self.tset, self.plan = tset, plan  # plan_run's (Run.load plans again for the joined job)
        self.parts: Components | None = None  # when every stage has made its parts
        self.progress = Progress()          # a resume replaces it with the saved one
        self.base_metadata: dict = {}
        self.saved: list[str] = []          # model files written, in order (the saver's)
        self.stop_signals: StopSignals | None = None  # while training
        self.saver: Saver | None = None
        self.closing: list = []             # what run() closes at the end, as it was made

    # -- stages -------------------------------------------------------------------------------
    def validate(self):
        """Checks that need imports but no weights (library/run/run_checks.py)."""
        self.opts = run_checks.resolve_options(self.opts, self.method_name)
        run_checks.check_before_loading(self.opts, self.method_name, self.plan)

    def load(self) -> Loaded:
        opts = self.opts
        acc = accelerator.accelerator_for(opts)
        if acc.num_processes != self.plan.processes:
            # The launcher's WORLD_SIZE and the joined job disagree: recompute so the plan is true.
            self.opts, self.tset, self.plan = plan_run(opts, acc.num_processes)
        # num_class_images: the reg folders' missing class images, made with the base model before
        # the training model loads (main process; every process waits for them)
        class_images.make_missing(opts, self.tset.class_images, acc, logger)
        if acc.device.type == "cpu":
            # On the CPU the resident set is what fits: freed tensors go back to the system.
            host_memory.return_large_frees()
        set_seed(opts.seed)
        b = flow_family.load_from_options(opts)  # SD's loader, or FLUX.1's / SD3's
        # base_weights: merged into the model as loaded, before any dtype cast (set-up)
        network_options.merge_base_weights(b, opts, logger)
        # a 9-channel (inpainting) U-Net and train_inpainting must agree; DreamBooth / fine-tune
        # of a 4-channel model with train_inpainting widen its first convolution
        if b.flow is None:  # an SD U-Net (FLUX.1's options: flow_loss.check_options)
            inpainting.prepare_unet(b.unet, opts, self.method_name, logger)
        if opts.no_token_padding and not registry.of(b).token_padding_option:  # a single file: known only now
            family.check_token_padding(opts, lambda _: b.family)
        b.vae.to(acc.device, dtype=latent_cache.vae_dtype(opts))
        b.vae.eval()
        if b.flow is None:  # FLUX.1 / SD3 attend with SDPA (sdpa / xformers: flow_loss.check_options)
            loading.set_attention(b, opts)
        # model-dependent loss-option errors now, before caching
        return Loaded(accelerator=acc, bundle=b,
                      losses=flow_loss.losses_for(opts, b))

    def setup_method(self, loaded: Loaded) -> SetUp:
        opts = self.opts
        b, acc = loaded.bundle, loaded.accelerator
        torch.manual_seed(opts.seed)  # network init is part of the seeded run
        method = make_method(self.method_name, opts, b)
        # the dtypes, the parts stored in them, the method's groups, its network stored (the one
        # path of the memory estimate too: library/training/model_setup.py)
        made = model_setup.set_up_method(opts, self.method_name, method, b, _DevicePlacer(opts, acc.device))
        pl, groups = made.placement, made.groups
        # tokenize / encode / U-Net forward of the family; new tokens' N-vector expansion
        family_model = flow_family.family_model_for(b, opts, rewrite=method.prompt_rewrite())
        if opts.enable_scaled_pos_embed:  # SD3 (flow_loss.check_options): every forward uses them
            flow_family.enable_scaled_pos_embed(b.unet, self.tset.resolutions, logger)
        if not any(p.requires_grad for g in groups for p in g["params"]):
            raise UserError("nothing to train: no trainable parameter has a non-zero learning rate "
                            "(check learning_rate, unet_lr, text_encoder_lr and network_train_*_only)")
        if opts.gradient_checkpointing or opts.cpu_offload_checkpointing or opts.unsloth_offload_checkpointing:
            b.unet.enable_gradient_checkpointing()
            if opts.cpu_offload_checkpointing:  # the flow transformers (block_swap.check_options)
                b.unet.cpu_offload_checkpointing = True
            if opts.unsloth_offload_checkpointing:  # Anima (its home's check_sources)
                b.unet.unsloth_offload_checkpointing = True
            if method.train_text_encoder:
                for te in b.text_encoders:
                    (getattr(te, "activation_checkpointing_enable", None)
                     or te.gradient_checkpointing_enable)()  # transformers 5 renamed it
        b.unet.train()
        for te in b.text_encoders:
            te.train(method.train_text_encoder)
        if opts.torch_compile:  # after the network hooks and checkpointing: both are in the graph
            # a fused stepper steps in each gradient's hook: one graph per block, not one for all
            # the U-Net's gradients at once (library/training/compile_unet.py)
            fused = fused_mode(opts)
            if fused:
                logger.info(f"torch_compile with {fused}: the U-Net is compiled block by block, "
                            "so that one block's gradients, not the whole U-Net's, exist at once")
            compile_unet(b.unet, opts.dynamo_backend, logger, per_block=fused is not None)
        # single process, DDP, FSDP or DeepSpeed: chosen once, it wraps or shards the trained
        # modules (groups re-pointed at FSDP's shards) and builds the stepper it needs
        strat = strategy.for_run(opts, acc)
        self.closing.append(strat)  # e.g. the DeepSpeed engine (and the process group made for it)
        strat.prepare(b, method, groups)
        params = method.trainable_parameters()
        stepper = strat.make_stepper(opts, groups, params, self.plan)
        averaged = ema.for_params(opts, params)  # ema_decay: from the initial weights (None when off)
        val = validation.Validation(opts, self.tset)
        check_multiplier(opts, self.tset, method)  # network_multiplier per dataset, DOP
        stream = progress_stream.open_stream(opts, is_main_process())
        return SetUp(method=method, family_model=family_model, placement=pl, strategy=strat,
                     stepper=stepper, params=params, ema=averaged, validation=val, stream=stream)

    def cache(self, loaded: Loaded, setup: SetUp) -> Cached:
        """Latents and, with cache_text_encoder_outputs, text-encoder outputs
        (library/data/cache_stage.py); then the parts no longer needed leave the device."""
        opts, acc, b = self.opts, loaded.accelerator, loaded.bundle
        latents = latent_key = text = None
        partial = False
        if opts.cache_latents or opts.cache_latents_to_disk:
            latents, latent_key = cache_stage.latents(opts, self.tset, acc, b)
        if opts.cache_text_encoder_outputs or opts.cache_text_encoder_outputs_to_disk:
            # FLUX.1 / SD3 with trained CLIP encoders: T5's part only (library/training/partial_text_cache.py)
            partial = partial_text_cache.is_partial(setup.method, b.text_encoders, setup.family_model, logger,
                                                    t5_only=opts.use_t5xxl_cache_only)
            text = cache_stage.text(opts, self.tset, acc, b, setup.family_model, setup.placement,
                                    frozen_only=partial)
        caches = Caches(latents=latents, latent_key=latent_key, text=text, text_partial=partial)
        if caches.latents is not None:
            # before the VAE leaves: the validation latents too
            setup.validation.encode_held_out(b.vae, acc.device, setup.strategy)
        # The VAE (latents cached) and text encoders (outputs cached) leave the device, or on a
        # CPU-only machine their memory (library/training/offload.py); the log says what that saved.
        released = offload.release_after_caching(
            opts, acc.device, b, setup.method, caches, logger,
            partial_encoders=setup.family_model.partial_cache_encoders if partial else ())
        self.closing.append(released)  # spill files of released parts
        return Cached(caches=caches, frozen=released)

    def assemble(self, loaded: Loaded, setup: SetUp, cached: Cached) -> Components:
        """The run's parts, once every stage has made its own: the batch loss and the reporter
        over them."""
        opts = self.opts
        acc, b, fm = loaded.accelerator, loaded.bundle, setup.family_model
        batch_loss = BatchLoss(opts, self.tset, accelerator=acc, bundle=b, family_model=fm,
                               losses=loaded.losses, placement=setup.placement,
                               method=setup.method, strategy=setup.strategy, caches=cached.caches)
        evaluated = validation.Evaluated(accelerator=acc, bundle=b, method=setup.method,
                                         family_model=fm, stepper=setup.stepper,
                                         strategy=setup.strategy)
        validate = functools.partial(
            validation.run_validation, setup.validation, model=evaluated, losses=loaded.losses,
            batch_loss=batch_loss, text_cache=cached.caches.text,
            text_partial=cached.caches.text_partial)
        sample = functools.partial(sampling.sample_images, opts, model=evaluated,
                                   frozen=cached.frozen, placement=setup.placement)
        reporter = tracking.Reporter(opts, self.plan, self.tset, setup.stream, setup.method, b,
                                     validate=validate, sample=sample)
        return Components(
            accelerator=acc, bundle=b, family_model=fm, losses=loaded.losses,
            placement=setup.placement, method=setup.method, strategy=setup.strategy,
            stepper=setup.stepper, params=setup.params, ema=setup.ema, caches=cached.caches,
            validation=setup.validation, frozen=cached.frozen, reporter=reporter,
            batch_loss=batch_loss)

    def micro_step_loss(self, epoch: int, idx: list[int], loaded_images, n_global: int,
                        step: int | None = None):
        """Sum over this process's samples of weight * loss, divided by the global batch size."""
        if self.parts is None:
            raise RuntimeError("micro_step_loss: the run's parts are not assembled yet")
        return self.parts.batch_loss.training(epoch, idx, loaded_images, n_global, step)

    def train(self):
        loop.train(self)

    def save(self, *, epoch=None, step=None, final=False):
        self.saver.save(self.progress, epoch=epoch, step=step, final=final)


class _DevicePlacer:
    """The trainer's way to store a module (model_setup.Placer): ``placement.place`` on the
    device; with blocks_to_swap (FLUX.1 / SD3) the transformer's swapped blocks stay on the host
    and are streamed in (a fused step updates them on the device, inside their backward: copied
    home after)."""

    def __init__(self, opts: Options, device: torch.device):
        self.opts, self.device = opts, device

    def unet(self, module: torch.nn.Module, storage: torch.dtype,
             compute: torch.dtype) -> dict[int, torch.nn.Parameter]:
        n = self.opts.blocks_to_swap
        if not n:
            return self.module(module, storage, compute)
        swap = block_swap.install(module, n, self.device, storage=storage, compute=compute,
                                  write_back=fused_mode(self.opts) is not None)
        logger.info(f"blocks_to_swap {n}: {swap.describe()}")
        return {}

    def module(self, module: torch.nn.Module, storage: torch.dtype,
               compute: torch.dtype) -> dict[int, torch.nn.Parameter]:
        placement.place(module, storage, compute, self.device)
        return {}  # the same Parameters, their data stored anew


def dry_run(r: Run, main: bool) -> None:
    """--dry_run after its printed plan: the checks that need imports (optimizer, network module,
    combinations) stop it too, then the memory estimate (no weights)."""
    r.validate()
    # lazy: fake tensors and bitsandbytes' optimizer types, which a training run does not use
    from library.training import memory_estimate

    memory_estimate.report(r.opts, r.method_name, r.tset, r.plan.processes, main)


def train(r: Run, started: float, resume, hub_api=None) -> Run:
    """Validate, take the output folder's lock, then load, set up, cache, train and save.
    ``hub_api``: the Hugging Face Hub client the saves upload to (library/outputs/hub.py)."""
    r.validate()  # optimizer, network module, combinations: before any folder is made
    opts = r.opts
    lock = output_checks.prepare(opts, r.method_name, is_main_process(), logger)  # before any weight loads
    try:
        with lock:
            return _train(r, opts, started, resume, hub_api)
    finally:
        for part in reversed(r.closing):  # the frozen parts' spill files, then the strategy
            part.close()


def _train(r: Run, opts: Options, started: float, resume, hub_api) -> Run:
    loaded = r.load()
    print_plan(r.plan, is_main_process())
    setup = r.setup_method(loaded)
    cached = r.cache(loaded, setup)
    r.parts = c = r.assemble(loaded, setup, cached)
    named = train_state.named_trainable(c.method, c.bundle)
    if resume:
        # again: the joined job's plan may differ from the launcher's
        path, info = train_state.check_resume(r.opts, r.method_name, r.plan, r.tset, None)
        r.progress = train_state.load_state(
            path, info, logger, accelerator=c.accelerator, named=named, ema=c.ema,
            stepper=c.stepper, strategy=c.strategy, network_dropout=r.opts.network_dropout)
    model = metadata.ModelKind(c.bundle.family, c.bundle.v_parameterization, c.method.adapter,
                               c.bundle.flow.variant if c.bundle.flow is not None else "")
    r.base_metadata = metadata.build_metadata(
        opts=opts, model=model, num_train_images=r.plan.repeats_total,
        num_reg_images=len(r.tset.reg_items), train_items=r.tset.train_items, started_at=started,
        network_info=c.method.info)
    targets = SaveTargets(bundle=c.bundle, method=c.method, params=c.params, named=named,
                          ema=c.ema, frozen=c.frozen)
    r.saver = Saver(r.opts, train_state.RunRecord(r.opts, r.plan, r.tset, r.method_name),
                    r.base_metadata, r.saved, targets=targets, accelerator=c.accelerator,
                    strategy=c.strategy, stepper=c.stepper,
                    uploader=hub.uploader_for(r.opts, hub_api) if is_main_process() else None)
    if r.saver.uploader is not None:
        r.closing.append(r.saver.uploader)  # its uploads finished before the run ends, however
    with StopSignals() as r.stop_signals:  # SIGINT/SIGTERM: stop after a step, write a state
        r.train()
    r.stop_signals = None
    r.save(final=True)
    c.reporter.saves(r.saved, r.progress)
    c.reporter.finish()  # close the TensorBoard log
    p = r.progress
    if p.loss_log and is_main_process():
        first = sum(p.loss_log[:3]) / min(3, len(p.loss_log))
        last = sum(p.loss_log[-3:]) / min(3, len(p.loss_log))
        print(f"done: steps {p.global_step}, epochs {p.epochs_done}, loss first {first:.4f} "
              f"last {last:.4f}", flush=True)
    return r
