"""The one training loop shared by train_lora.py, train_dreambooth.py, finetune.py and
train_textual_inversion.py.

Stages (each a function): plan (no weights) -> load -> setup method -> cache -> train -> save.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time

from library import distributed, nonfinite, step_plan
from library.training_data import build_training_set

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
    tset = build_training_set(opts, logger)
    if tset.batch_size is not None and tset.batch_size != opts.train_batch_size:
        # The dataset config's batch_size (dataset -> [general] -> train_batch_size) is the
        # per-process batch, as sd-scripts; every dataset has the same one (checked).
        logger.info(f"train_batch_size {tset.batch_size} from the dataset config "
                    f"(run option: {opts.train_batch_size})")
        opts.train_batch_size = tset.batch_size
    if opts.resolution is None:
        opts.resolution = tset.resolution  # set by the dataset config; recorded in the metadata
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
    return tset, plan


def print_plan(plan, main: bool):
    if not main:
        return
    print("step plan:", flush=True)
    for line in plan.lines():
        print("  " + line, flush=True)
    for line in step_plan.what_if_lines(plan):
        print("  note: " + line, flush=True)


class Run:
    """State of one training run; methods are the stages of run()."""

    def __init__(self, opts, method_name: str):
        self.opts = opts
        self.method_name = method_name

    # -- stages -------------------------------------------------------------------------------
    def validate(self):
        """Checks that need imports but no weights: optimizer, scheduler, network module."""
        from library.methods import make_method
        from library.optim import check_optimizer

        check_optimizer(self.opts.optimizer_type, self.opts.optimizer_args, probe=True,
                        learning_rate=self.opts.learning_rate)
        from library.optim import check_scheduler

        check_scheduler(self.opts, warmup_steps=self.plan.warmup_steps,
                        total_steps=self.plan.total_steps)  # lr_scheduler and the lr_* options
        from library.stepper import check_stepper_options

        check_stepper_options(self.opts)  # fused_backward_pass / fused_optimizer_groups combinations
        from library import fsdp

        fsdp.check_options(self.opts)  # fsdp combinations; Accelerate-FSDP launch configs
        from library import zero

        zero.check_options(self.opts)  # deepspeed combinations and optimizer
        from library.losses import check_options as check_loss_options

        check_loss_options(self.opts)  # noise / loss variant combinations
        from library import tracking

        tracking.check_options(self.opts)  # logging_dir / log_with, validation and sample options
        from library import network_options

        network_options.check_options(self.opts)  # dim_from_weights, base_weights, scale_weight_norms
        from library import placement

        placement.check_options(self.opts)  # fp8_base / fp8_base_unet need mixed precision
        from library import metadata

        metadata.check_options(self.opts)  # metadata_thumbnail exists
        from library.compile import check_options as check_compile

        check_compile(self.opts)  # torch_compile / dynamo_backend combinations
        from library import block_lr, family

        family.check_token_padding(self.opts, block_lr.family_before_loading)  # no_token_padding
        nonfinite.check_options(self.opts)  # on_nonfinite; network_weights / base_weights finite
        distributed.accelerator_precision(self.opts)  # fp16 needs CUDA (after the combinations naming it)
        make_method(self.method_name, self.opts, None)  # e.g. nothing to train: fail before loading weights

    def load(self):
        from accelerate.utils import set_seed

        from library import family, latent_cache, models

        opts = self.opts
        self.accelerator = distributed.accelerator_for(opts)
        acc = self.accelerator
        if acc.num_processes != self.plan.processes:
            # The launcher's WORLD_SIZE and the joined job disagree: recompute so the plan is true.
            self.tset, self.plan = plan_run(opts, acc.num_processes)
        if acc.device.type == "cpu":
            from library import host_memory

            # On the CPU the resident set is what fits: freed tensors go back to the system.
            host_memory.return_large_frees()
        set_seed(opts.seed)
        self.bundle = models.load_from_options(opts)
        from library import network_options

        # base_weights: merged into the model as loaded, before any dtype cast (setup_method)
        network_options.merge_base_weights(self.bundle, opts, logger)
        self.adapter = family.adapter_for(self.bundle, max_token_length=self.opts.max_token_length,
                                          weighted=self.opts.weighted_captions)
        if opts.no_token_padding and self.bundle.family == "sdxl":  # a single file: known only now
            family.check_token_padding(opts, lambda _: self.bundle.family)
        b = self.bundle
        b.vae.to(acc.device, dtype=latent_cache.vae_dtype(opts))
        b.vae.eval()
        self.set_attention()
        from library import losses

        losses.for_run(self)  # model-dependent loss-option errors now, before caching

    def set_attention(self):
        """SDPA (default), xformers, or with --sdpa=false the plain math attention."""
        opts, b = self.opts, self.bundle
        if opts.xformers:
            try:
                b.unet.enable_xformers_memory_efficient_attention()
            except Exception as e:  # noqa: BLE001 - diffusers raises several kinds here
                from library.errors import UserError

                raise UserError(f"xformers: cannot enable xformers attention ({e}); "
                                "install the xformers extra or drop --xformers") from None
        elif not opts.sdpa:
            from diffusers.models.attention_processor import AttnProcessor

            b.unet.set_attn_processor(AttnProcessor())
            for te in b.text_encoders:
                te.set_attn_implementation("eager")

    def setup_method(self):
        import torch

        from library.methods import make_method

        opts, b, acc = self.opts, self.bundle, self.accelerator
        torch.manual_seed(opts.seed)  # network init is part of the seeded run
        self.method = make_method(self.method_name, opts, b)
        from library import placement

        # The dtypes of every part (library/placement.py, shared with the memory estimate): the
        # trained weights float32, or with full_bf16 / full_fp16 bf16 / fp16 (the stepper updates
        # them in float32 and rounds back); the frozen parts the mixed-precision dtype, or with
        # fp8_base / fp8_base_unet float8. Placed before the network hooks the modules, so its
        # hooks call the fp8 forward; after the load (and any merge of base weights into it).
        self.placement = placement.dtype_placement(opts, self.method_name, self.method.train_text_encoder,
                                                   len(b.text_encoders))
        pl = self.placement
        placement.place(b.unet, pl.unet, pl.compute, acc.device)
        for te, te_dtype in zip(b.text_encoders, pl.text_encoders):
            placement.place(te, te_dtype, pl.compute, acc.device)
        groups = self.method.setup()
        self.adapter.rewrite = self.method.prompt_rewrite()  # new tokens' N-vector expansion
        if not any(p.requires_grad for g in groups for p in g["params"]):
            from library.errors import UserError

            raise UserError("nothing to train: no trainable parameter has a non-zero learning rate "
                            "(check learning_rate, unet_lr, text_encoder_lr and network_train_*_only)")
        if self.method_name == "lora":
            self.method.network.to(acc.device, dtype=pl.network)
        if opts.gradient_checkpointing:
            b.unet.enable_gradient_checkpointing()
            if self.method.train_text_encoder:
                for te in b.text_encoders:
                    (getattr(te, "activation_checkpointing_enable", None)
                     or te.gradient_checkpointing_enable)()  # transformers 5 renamed it
        b.unet.train()
        for te in b.text_encoders:
            te.train(self.method.train_text_encoder)
        if opts.torch_compile:  # after the network hooks and checkpointing: both are in the graph
            from library.compile import compile_unet

            compile_unet(b.unet, opts.dynamo_backend, logger)
        from library.stepper import make_stepper

        if getattr(opts, "fsdp", False):
            from library import fsdp

            fsdp.shard_run(self, groups)  # U-Net blocks, trained text encoders' layers; groups re-pointed
        self.params = self.method.trainable_parameters()
        if getattr(opts, "deepspeed", False):
            from library import zero

            self.stepper = zero.make_stepper(self, groups)  # ZeRO engine over the trained modules
        else:
            # plain, fused_backward_pass or fused_optimizer_groups: optimizer(s) and scheduler(s)
            self.stepper = make_stepper(acc, opts, groups, self.params,
                                        warmup_steps=self.plan.warmup_steps,
                                        total_steps=self.plan.total_steps)
        self.optimizer, self.scheduler = self.stepper.optimizer, self.stepper.scheduler
        from library import ema

        self.ema = ema.for_run(self)  # ema_decay: from the initial weights (None when off)

    def cache(self):
        """Latents of every image (and its mirror under flip_aug) in memory, and with
        cache_latents_to_disk also on disk: unchanged entries are loaded without the VAE, and the
        missing ones are split across processes. Then, with cache_text_encoder_outputs, the
        text-encoder outputs of every caption variant (library/text_cache.py)."""
        self.latents = None
        self.text_cache = None
        opts = self.opts
        if opts.cache_latents or opts.cache_latents_to_disk:
            self._cache_latents()
        if opts.cache_text_encoder_outputs or opts.cache_text_encoder_outputs_to_disk:
            self._cache_text()
        from library import frozen, validation

        if self.latents is not None:
            validation.encode_held_out(self)  # before the VAE leaves: the validation latents too
        # The VAE (latents cached) and text encoders (outputs cached) leave the device, or on a
        # CPU-only machine their memory (library/frozen.py); the log says what that saved.
        self.frozen = frozen.release_after_caching(self, logger)

    def _cache_latents(self):
        from library import latent_cache

        opts, acc = self.opts, self.accelerator
        items = self.tset.train_items + self.tset.reg_items
        vae = self.bundle.vae
        self.latents = latent_cache.encode_latents(
            vae, items, batch_size=max(1, opts.vae_batch_size), dtype=vae.dtype,
            device=acc.device, vae_identity=self.bundle.vae_identity, log=logger,
            to_disk=opts.cache_latents_to_disk, process_index=acc.process_index,
            num_processes=acc.num_processes, barrier=acc.wait_for_everyone)
        # Keys hash the image bytes: compute each once, not per step. Looked up by what tells
        # two items apart (one image may be in two datasets at different sizes) and the flip.
        self.latent_key = {
            self._latent_slot(it, flipped): latent_cache.item_cache_key(
                it, flipped, self.bundle.vae_identity, vae.dtype)
            for it in items for flipped in ((False, True) if it.flip_aug else (False,))}

    def _cache_text(self):
        from library import latent_cache, text_cache

        opts, acc = self.opts, self.accelerator
        wanted: dict = {}
        for it in self.tset.train_items + self.tset.reg_items:
            folder = latent_cache.cache_folder(it)
            for c in self.tset.caption_variants(it) + ([""] if self.tset.uses_empty_caption(it) else []):
                wanted.setdefault(c, folder)
        from library import validation

        for it in self.tset.val_items:  # the validation loss reads its captions from the cache too
            wanted.setdefault(validation.caption(it), latent_cache.cache_folder(it))
        te_dtype = self.placement.text_encoders[0]  # float8 with fp8_base: its outputs differ
        identity = text_cache.encoder_identity(self.bundle, te_dtype, opts.clip_skip, opts.max_token_length,
                                               weighted=opts.weighted_captions)
        self.text_cache = text_cache.encode_captions(
            self.adapter, wanted, identity, clip_skip=opts.clip_skip,
            batch_size=max(1, opts.vae_batch_size), device=acc.device, autocast=acc.autocast,
            to_disk=opts.cache_text_encoder_outputs_to_disk, log=logger)

    def _text_conditioning(self, idx: list[int], epoch: int):
        """The text conditioning of this process's samples (called under autocast): from the
        text-encoder cache, or encoded now (with gradients when the text encoders train)."""
        import torch

        from library import text_cache

        if getattr(self, "text_cache", None) is not None:
            return text_cache.stack([self.text_cache[self.tset.cached_caption(i, epoch)] for i in idx],
                                    self.accelerator.device)
        captions = [self.tset.caption(i, epoch) for i in idx]  # sample-keyed augmentation
        # no_token_padding: unpadded ids (batch 1, checked before loading); validation and the
        # text-encoder cache always pad
        tokens = [t.to(self.accelerator.device)
                  for t in self.adapter.tokenize(captions, pad=not self.opts.no_token_padding)]
        if self.method.train_text_encoder:
            return self.adapter.encode(tokens, self.opts.clip_skip)
        with torch.no_grad():
            return self.adapter.encode(tokens, self.opts.clip_skip)

    @staticmethod
    def _latent_slot(item, flipped: bool) -> tuple:
        return (item.path, tuple(item.bucket), tuple(item.resized_size), bool(flipped),
                bool(getattr(item, "alpha_mask", False)), getattr(item, "mask_path", None))

    # -- per-step work ------------------------------------------------------------------------
    def _sample_latents(self, idx: list[int], loaded_images, epoch: int):
        """Latents (B,C,h,w) and SDXL size conditioning (B,6) for this process's samples; with
        cached latents the sample's flip for this epoch picks the variant."""
        import torch

        from library import latent_cache

        b, acc = self.bundle, self.accelerator
        lat, size = [], []
        if self.latents is not None:
            for i in idx:
                slot = self._latent_slot(self.tset.samples[i], self.tset.flip(i, epoch))
                e = self.latents[self.latent_key[slot]]
                lat.append(e.latents)
                size.append((*e.original_size, *e.crop_top_left, *e.target_size))
            latents = torch.stack(lat).to(acc.device, dtype=torch.float32)
        else:
            pix = loaded_images.pixels_on(acc.device, b.vae.dtype)  # pinned: non-blocking
            with torch.no_grad():
                latents = latent_cache.encode_pixels(b.vae, pix).to(torch.float32)
            size = [(*p.original_size, *p.crop_top_left, *p.target_size) for p in loaded_images]
        return latents, torch.tensor(size, dtype=torch.float32, device=acc.device)

    def micro_step_loss(self, epoch: int, idx: list[int], loaded_images, n_global: int):
        """Sum over this process's samples of weight * loss, divided by the global batch size."""
        import torch

        from library import losses

        opts, b, acc = self.opts, self.bundle, self.accelerator
        latents, size_cond = self._sample_latents(idx, loaded_images, epoch)
        lossf = losses.for_run(self)
        # Sample-keyed randomness: every draw for a sample (noise, timestep, noise variants) comes
        # from its own generator, whatever the process count, batch split or resume point.
        d = lossf.draw(latents, [torch.Generator().manual_seed(
            step_plan.derive_seed("sample", opts.seed, epoch, i)) for i in idx])
        timesteps = d.timesteps
        noisy = lossf.noisy_latents(latents, d)
        with acc.autocast():
            cond = self._text_conditioning(idx, epoch)  # cached, or encoded now
            pred = self.adapter.unet_forward(noisy.to(self._unet_dtype()), timesteps, cond,
                                             size_cond if b.family == "sdxl" else None)
        mask = self._sample_masks(idx, loaded_images, epoch, latents.shape[2:])  # masked loss
        per_sample = lossf.per_sample_loss(pred, latents, d, mask)  # loss_type, SNR weights (losses.py)
        weights = torch.tensor([opts.prior_loss_weight if self.tset.samples[i].is_reg else 1.0
                                for i in idx], device=acc.device)
        return (per_sample * weights).sum() / n_global

    def _unet_dtype(self):
        return self.placement.input_dtype(self.placement.unet)

    def _sample_masks(self, idx: list[int], loaded_images, epoch: int, latent_hw):
        """Masked loss: (B,1,h,w) masks at the latent size, from the latent cache (stored beside
        each latent variant) or from the loaded images (same resize, crop and flip); ones for an
        image without a mask. None when no image of the run has a mask."""
        import torch

        from library import images

        if not getattr(self.tset, "masked", False):
            return None
        out = []
        if self.latents is not None:
            for i in idx:
                slot = self._latent_slot(self.tset.samples[i], self.tset.flip(i, epoch))
                out.append(self.latents[self.latent_key[slot]].mask)
        else:
            out = [None if p.mask is None else images.latent_mask(p.mask, tuple(latent_hw))
                   for p in loaded_images]
        masks = [torch.ones(tuple(latent_hw)) if m is None else m for m in out]
        return torch.stack(masks).unsqueeze(1).to(self.accelerator.device, dtype=torch.float32)

    # -- the loop -----------------------------------------------------------------------------
    def train(self):
        from tqdm.auto import tqdm

        from library import tracking
        from library.training_data import ImageLoader, loader_workers

        opts, acc, plan = self.opts, self.accelerator, self.plan
        P, rank = acc.num_processes, acc.process_index
        bs, A = opts.train_batch_size, opts.gradient_accumulation_steps
        if getattr(self, "position", None) is None:  # a fresh run; a resume restored these
            self.global_step, self.epoch, self.samples_seen = 0, 0, 0
            self.loss_log: list[float] = []   # per step: the global batch's mean loss (all processes)
            self.lr_log: list[float] = []     # per step: the learning rate of the first param group
            self.position = (1, 0)            # (epoch, index of the next global batch in it)
        signals = getattr(self, "stop_signals", None)
        start_epoch, start_batch = self.position
        tracking.before_training(self)  # validation images held out; sample_at_first
        bar = tqdm(total=plan.total_steps, initial=self.global_step,
                   disable=not acc.is_main_process, desc="steps", dynamic_ncols=True)
        done, stop = False, 0
        images_in = None  # without cached latents: decoded and augmented per step
        if self.latents is None:
            cuda = acc.device.type == "cuda"
            images_in = ImageLoader(self.tset, loader_workers(opts.max_data_loader_n_workers,
                                                              acc.device.type, P),
                                    persistent=opts.persistent_data_loader_workers, pin=cuda)
        for epoch in range(start_epoch, plan.epochs + 1):
            self.method.set_train(epoch)
            batches = step_plan.epoch_batches(self.tset.bucket_of, opts.seed, epoch, plan.global_batch)
            # A resume inside this epoch: the order is keyed by (seed, epoch); skip what was trained.
            skip, n_batches = (start_batch if epoch == start_epoch else 0), len(batches)
            batches = batches[skip:]
            # This process's micro-batches, in order: for each global batch, A micro-steps.
            mine = [gb.micro_batch(a, rank, bs, P) for gb in batches for a in range(A)]
            loader = images_in.epoch(epoch, mine) if images_in is not None else None
            k = 0
            for j, gb in enumerate(batches, start=skip):
                self.method.before_step(self.global_step)  # e.g. stop_text_encoder_training
                loss_sum, step_loss = 0.0, None
                for a in range(A):
                    idx = list(mine[k])
                    images = next(loader) if loader is not None else None
                    k += 1
                    last = a == A - 1
                    zero_weight = False
                    if not idx:
                        if not (last and getattr(self.stepper, "steps_in_backward", False)) and \
                                not getattr(self.stepper, "forward_in_every_process", False):
                            # An empty share of a partial global batch: no forward; this process
                            # contributes zeros to the gradient sum below (which it still joins).
                            continue
                        # The stepper steps inside backward hooks, which fire only in a backward:
                        # a zero-weight backward of one sample of the global batch makes them fire
                        # for the same parameters in the same order as in the other processes.
                        # fsdp: every forward all-gathers weights, so every process runs it.
                        idx, zero_weight = [gb.indices[0]], True
                        if loader is not None:
                            images = images_in.load(epoch, idx)
                    loss = self.micro_step_loss(epoch, idx, images, len(gb.indices))
                    if zero_weight:
                        loss = loss * 0.0
                    loss_sum += float(loss.detach())
                    if last and getattr(self.stepper, "steps_in_backward", False):
                        # its hooks update parameters during this backward: the global batch's
                        # loss is checked first (library/nonfinite.py), alike in every process
                        step_loss = distributed.all_reduce_sum(loss_sum, acc.device)
                        if not math.isfinite(step_loss):
                            break
                    self.stepper.backward(loss, last_micro_step=last)
                if step_loss is None:
                    step_loss = distributed.all_reduce_sum(loss_sum, acc.device)
                step_lr = self.stepper.current_lr()
                bad = None if math.isfinite(step_loss) else f"loss {nonfinite.describe(step_loss)}"
                if bad is None:
                    self.stepper.step()  # every process, every step: it joins the gradient sum
                    bad = getattr(self.stepper, "nonfinite", None)  # a non-finite gradient norm
                if bad is not None:
                    self.on_nonfinite(bad, bar)  # stop (raises) or skip this update
                # scale_weight_norms: after the update (every stepper has finished it here), before
                # the EMA reads the weights
                self.max_norm_stats = self.method.after_step(acc.device)
                if getattr(self, "ema", None) is not None:
                    self.ema.update()
                self.global_step += 1
                self.samples_seen += len(gb.indices)
                self.position = (epoch, j + 1) if j + 1 < n_batches else (epoch + 1, 0)
                if self.global_step == 1:
                    logger.info(f"first step done {seconds_since_process_start():.2f}s after start")
                self.loss_log.append(step_loss)
                self.lr_log.append(step_lr)
                bar.update(1)
                postfix = {}
                if self.max_norm_stats is not None:
                    from library.network_options import max_norm_postfix

                    postfix = max_norm_postfix(self.max_norm_stats)
                bar.set_postfix(**postfix, loss=f"{step_loss:.4f}", lr=f"{step_lr:.2e}")
                tracking.after_step(self, epoch)  # validation and samples when due, TensorBoard scalars
                if opts.save_every_n_steps and self.global_step % opts.save_every_n_steps == 0 \
                        and self.global_step < plan.total_steps:
                    self.save(epoch=None, step=self.global_step)
                # SIGINT/SIGTERM in any process: every process stops after this same step.
                stop = signals.agreed(acc.device) if signals is not None else 0
                if self.global_step >= plan.total_steps:
                    done = True
                    break
                if stop and j + 1 < n_batches:
                    bar.close()
                    self.interrupt(stop)
            self.epoch = epoch
            tracking.after_epoch(self, epoch)  # validation and samples when due, loss/epoch
            if done:
                break
            if opts.save_every_n_epochs and epoch % opts.save_every_n_epochs == 0 and epoch < plan.epochs:
                self.save(epoch=epoch, step=None)
            if stop:  # the signal came in the epoch's last step: after the epoch's saves
                bar.close()
                self.interrupt(stop)
        bar.close()

    def on_nonfinite(self, what: str, bar):
        """A non-finite loss or gradient norm in step global_step + 1, before its update (every
        process alike). ``stop``: write the state of the last good step and raise NonFiniteStop;
        ``skip``: drop the update and warn (library/nonfinite.py)."""
        from library import train_state

        step = self.global_step + 1
        partial = bool(getattr(self.stepper, "partial_update", False))
        if self.opts.on_nonfinite == "skip":
            self.stepper.skip()
            logger.warning(f"non-finite {what} at step {step}: update skipped (on_nonfinite skip)"
                           + ("; some parameters had already been stepped in the backward pass"
                              if partial else ""))
            return
        bar.close()
        msg = f"non-finite {what} at step {step}: training stopped"
        if partial:
            # the hooks had stepped parameters before the bad gradient appeared: no state of
            # step N exists any more; only earlier saves (all checked finite) remain
            raise nonfinite.NonFiniteStop(
                f"{msg}; parameters had already been updated in the backward pass "
                "(fused_backward_pass / fused_optimizer_groups), so no state was written; resume "
                "from an earlier save_state state, e.g. with a lower learning rate or "
                "max_grad_norm")
        path = train_state.state_dir(self.opts.output_dir, self.opts.output_name,
                                     step=self.global_step)
        if getattr(self, "last_state", None) != (path, self.global_step):
            train_state.write_state(self, path, logger)
        raise nonfinite.NonFiniteStop(
            f"{msg} before its update; the state after step {self.global_step} is in {path} "
            f"(continue with --resume {path}; on_nonfinite skip passes over such steps)")

    def interrupt(self, signum: int):
        """Write ``<output_name>-step<N>-state`` (unless this step's state exists) and stop."""
        from library import train_state

        path = train_state.state_dir(self.opts.output_dir, self.opts.output_name,
                                     step=self.global_step)
        if getattr(self, "last_state", None) != (path, self.global_step):
            train_state.write_state(self, path, logger)
        raise train_state.TrainingInterrupted(signum, path, self.global_step)

    def saved_tensors(self) -> list:
        """(name, tensor) of what a save writes that training changes: the trainable parameters
        and the EMA (frozen weights come from the loaded model and stay as loaded)."""
        from library import train_state

        named = train_state.named_trainable(self)
        ema = getattr(self, "ema", None)
        if ema is None:
            return named
        return named + [("ema." + n, e) for (n, _), e in zip(named, ema.shadow)]

    def save(self, *, epoch=None, step=None, final=False):
        # Schedule-free optimizers save their eval iterate; every process switches, so ranks agree.
        with self.stepper.eval_mode():
            self._save(epoch=epoch, step=step, final=final)
        # The training state holds the training iterate (outside eval_mode).
        self.save_states(epoch=epoch, step=step, final=final)

    def save_states(self, *, epoch=None, step=None, final=False):
        """``save_state``: a state next to each model save; ``save_state_on_train_end``: the
        final one. Then sd-scripts' rotation of old models and states."""
        from library import train_state

        opts = self.opts
        if opts.save_state or (final and opts.save_state_on_train_end):
            path = train_state.state_dir(opts.output_dir, opts.output_name, epoch=epoch, step=step)
            train_state.write_state(self, path, logger)
            self.last_state = (path, self.global_step)
        if self.accelerator.is_main_process and not final:
            self._rotate(epoch=epoch, step=step)
        self.accelerator.wait_for_everyone()

    def _rotate(self, *, epoch=None, step=None):
        """sd-scripts' save_last_n_*: drop the model (and state) saved n saves (epochs) or more
        than n steps (steps) before this one."""
        import shutil

        from library import train_state
        from library.saving import output_file

        opts = self.opts
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
            if getattr(self, "ema", None) is not None:
                names.append(opts.output_name + "-ema")  # the EMA saves rotate with the models
            for name in names:
                path = output_file(opts.output_dir, name, self.method.extension(), **old)
                for extra in self.method.companion_files(path):  # pivotal tuning's embeddings
                    if os.path.isfile(extra):
                        os.remove(extra)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.isfile(path):
                    os.remove(path)
                else:
                    continue
                logger.info(f"removed old model {path}")

    def _save(self, *, epoch=None, step=None, final=False):
        from library import metadata as md
        from library.saving import output_file

        acc = self.accelerator
        acc.wait_for_everyone()
        from library import fsdp

        meta = md.step_metadata(self.base_metadata, epoch=epoch or getattr(self, "epoch", 0),
                                step=self.global_step, finished_at=time.time())
        sharded = fsdp.is_sharded(self)
        from library import zero

        # fsdp: every process joins the gather of the full weights; the main process writes them.
        # deepspeed in bf16/fp16: the float32 master weights are saved (a collective too).
        with fsdp.full_weights(self), zero.master_weights(self):
            path = output_file(self.opts.output_dir, self.opts.output_name,
                               self.method.extension(), epoch=epoch, step=step)
            # nothing non-finite is written, and no good file replaced by it (every process)
            nonfinite.check_before_save(self.saved_tensors(), path, acc)
            if acc.is_main_process:
                os.makedirs(self.opts.output_dir, exist_ok=True)
                from library import frozen

                with frozen.available_for_save(self):  # a full model's file holds VAE and TEs
                    self._write_model(path, meta)
                    logger.info(f"saved {path}")
                    self.saved.append(path)
                    if getattr(self, "ema", None) is not None and not sharded:
                        self.ema.save(self, epoch=epoch, step=step, metadata=meta)
        if getattr(self, "ema", None) is not None and sharded:
            self.ema.save(self, epoch=epoch, step=step, metadata=meta)  # every process: a gather
        acc.wait_for_everyone()


    def _write_model(self, path: str, meta: dict):
        """The model file; when it cannot be written (disk full, read-only), into the system temp
        dir instead, and the run ends with one line saying where (library/saving.py)."""
        from library.saving import SaveError, save_elsewhere

        def write(p):
            self.method.save(p, self.opts.save_precision, meta)

        try:
            write(path)
        except SaveError as e:
            raise save_elsewhere(e, write) from None


def _check_resume(r: Run, announce: bool = True) -> tuple[str, dict]:
    """The state ``resume`` names, checked against this run (before weights load)."""
    from library import train_state

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
    from library import content_hash

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
    from library import zero

    zero.resolve_options(opts)  # an Accelerate DeepSpeed launch config -> the deepspeed options
    processes = distributed.launched_world_size()
    r = Run(opts, method_name)
    r.tset, r.plan = plan_run(opts, processes)
    main = int(os.environ.get("RANK", "0")) == 0
    resume = None
    if opts.resume:  # checked before any weight loads
        resume = _check_resume(r)
    from library import output_checks

    output_checks.check_name(opts.output_name)  # a dry run too: "" would write ".safetensors"
    if opts.dry_run:
        print_plan(r.plan, main)  # the plan needs no torch: printed first
        r.validate()  # optimizer, network module, combinations: a dry run stops on them too
        from library import memory_estimate

        memory_estimate.report(opts, method_name, r.tset, r.plan.processes, main)  # no weights
        return None
    started = time.time()
    r.validate()  # optimizer, network module, combinations: before any folder is made
    lock = _prepare_outputs(r, method_name, main)  # before any weight loads
    try:
        with lock:
            return _train(r, opts, started, resume)
    finally:
        if getattr(r, "frozen", None) is not None:
            r.frozen.close()  # spill files of released parts
        close = getattr(getattr(r, "stepper", None), "close", None)
        if callable(close) and getattr(opts, "deepspeed", False):
            close()  # the DeepSpeed engine (and the process group made for it)


def _prepare_outputs(r: Run, method_name: str, main: bool):
    """The folders the run writes (every process: each writes caches or shards), then on the main
    process only the free space, stale temporaries and the output lock (returned, to hold)."""
    import contextlib

    from library import output_checks

    opts = r.opts
    output_checks.check_paths(opts)
    if not main or not opts.output_dir:
        return contextlib.nullcontext()
    output_checks.check_free_space(opts, method_name, logger)
    output_checks.remove_stale_temporaries(opts.output_dir, logger)
    return output_checks.OutputLock(opts.output_dir, opts.output_name, logger)


def _train(r: Run, opts, started: float, resume) -> Run:
    r.load()
    print_plan(r.plan, r.accelerator.is_main_process)
    r.setup_method()
    r.cache()
    if resume:
        from library import train_state

        resume = _check_resume(r, announce=False)  # again: the joined job's plan may differ from the launcher's
        train_state.load_state(r, *resume, logger)
    from library import metadata as md

    r.base_metadata = md.build_metadata(
        opts=opts, family=r.bundle.family, v_parameterization=r.bundle.v_parameterization,
        adapter=r.method.adapter, num_train_images=r.plan.repeats_total,
        num_reg_images=len(r.tset.reg_items), train_items=r.tset.train_items, started_at=started,
        network_info=r.method.info)
    r.saved = []
    from library.train_state import StopSignals

    with StopSignals() as r.stop_signals:  # SIGINT/SIGTERM: stop after a step, write a state
        r.train()
    r.stop_signals = None
    r.save(final=True)
    from library import tracking

    tracking.finish(r)  # close the TensorBoard log
    if r.loss_log and r.accelerator.is_main_process:
        first = sum(r.loss_log[:3]) / min(3, len(r.loss_log))
        last = sum(r.loss_log[-3:]) / min(3, len(r.loss_log))
        print(f"done: steps {r.global_step}, epochs {r.epoch}, loss first {first:.4f} last {last:.4f}",
              flush=True)
    return r
