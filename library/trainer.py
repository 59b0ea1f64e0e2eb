"""The one training loop shared by train_lora.py, train_dreambooth.py and finetune.py.

Stages (each a function): plan (no weights) -> load -> setup method -> cache -> train -> save.
"""
from __future__ import annotations

import logging
import os
import sys
import time

from library import distributed, step_plan
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
        from library.methods import FullMethod, NetworkMethod
        from library.optim import check_optimizer

        check_optimizer(self.opts.optimizer_type, self.opts.optimizer_args)
        if self.method_name == "lora":
            NetworkMethod(self.opts, None)
        else:
            FullMethod(self.opts, None)  # e.g. nothing to train: fail before loading weights

    def load(self):
        import torch
        from accelerate.utils import set_seed

        from library import family, models

        opts = self.opts
        self.accelerator = distributed.make_accelerator(
            opts.mixed_precision, timeout_s=opts.ddp_timeout * 60 if opts.ddp_timeout else None)
        acc = self.accelerator
        if acc.num_processes != self.plan.processes:
            # The launcher's WORLD_SIZE and the joined job disagree: recompute so the plan is true.
            self.tset, self.plan = plan_run(opts, acc.num_processes)
        set_seed(opts.seed)
        self.bundle = models.load_model_bundle(
            opts.pretrained_model_name_or_path, vae=opts.vae, v2=opts.v2,
            v_parameterization=opts.v_parameterization, tokenizer_path=opts.tokenizer_path,
            allow_pickle=opts.allow_pickle)
        self.adapter = family.adapter_for(self.bundle)
        self.weight_dtype = {"no": torch.float32, "fp16": torch.float16,
                             "bf16": torch.bfloat16}[opts.mixed_precision]
        b = self.bundle
        device = acc.device
        b.vae.to(device, dtype=torch.float32 if opts.no_half_vae else self.weight_dtype)
        b.vae.eval()
        self.set_attention()

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

        from library.methods import FullMethod, NetworkMethod

        opts, b, acc = self.opts, self.bundle, self.accelerator
        torch.manual_seed(opts.seed)  # network init is part of the seeded run
        self.method = NetworkMethod(opts, b) if self.method_name == "lora" else FullMethod(opts, b)
        groups = self.method.setup()
        if not any(p.requires_grad for g in groups for p in g["params"]):
            from library.errors import UserError

            raise UserError("nothing to train: no trainable parameter has a non-zero learning rate "
                            "(check learning_rate, unet_lr, text_encoder_lr and network_train_*_only)")
        trained_dtype = torch.float32
        frozen_dtype = self.weight_dtype
        unet_dtype = trained_dtype if self.method_name != "lora" else frozen_dtype
        b.unet.to(acc.device, dtype=unet_dtype)
        for te in b.text_encoders:
            te_dtype = trained_dtype if (self.method_name != "lora" and self.method.train_text_encoder) else frozen_dtype
            te.to(acc.device, dtype=te_dtype)
        if self.method_name == "lora":
            self.method.network.to(acc.device, dtype=torch.float32)
        if opts.gradient_checkpointing:
            b.unet.enable_gradient_checkpointing()
            if self.method.train_text_encoder:
                for te in b.text_encoders:
                    (getattr(te, "activation_checkpointing_enable", None)
                     or te.gradient_checkpointing_enable)()  # transformers 5 renamed it
        b.unet.train()
        for te in b.text_encoders:
            te.train(self.method.train_text_encoder)
        from library.optim import build_optimizer, build_scheduler

        self.optimizer = build_optimizer(opts.optimizer_type, opts.optimizer_args, groups,
                                         opts.learning_rate)
        self.optimizer = acc.prepare(self.optimizer)
        self.scheduler = build_scheduler(opts.lr_scheduler, self.optimizer.optimizer
                                         if hasattr(self.optimizer, "optimizer") else self.optimizer,
                                         warmup_steps=self.plan.warmup_steps,
                                         total_steps=self.plan.total_steps,
                                         num_cycles=opts.lr_scheduler_num_cycles,
                                         power=opts.lr_scheduler_power)
        self.params = self.method.trainable_parameters()
        from library.stepper import PlainStepper

        self.stepper = PlainStepper(acc, self.optimizer, self.scheduler, self.params,
                                    opts.max_grad_norm)

    def cache(self):
        self.latents = None
        if not self.opts.cache_latents:
            return
        from library import latent_cache

        items = self.tset.train_items + self.tset.reg_items
        vae = self.bundle.vae
        self.latents = latent_cache.encode_latents(
            vae, items, batch_size=max(1, self.opts.vae_batch_size), dtype=vae.dtype,
            device=self.accelerator.device, vae_identity=self.bundle.vae_identity, log=logger)
        # Keys hash the image bytes: compute each once, not per step.
        self.latent_key = {it.path: latent_cache.item_cache_key(it, False, self.bundle.vae_identity,
                                                                vae.dtype) for it in items}

    # -- per-step work ------------------------------------------------------------------------
    def _sample_latents(self, idx: list[int], loaded_images):
        """Latents (B,C,h,w) and SDXL size conditioning (B,6) for this process's samples."""
        import torch

        from library import latent_cache

        b, acc = self.bundle, self.accelerator
        lat, size = [], []
        if self.latents is not None:
            for i in idx:
                e = self.latents[self.latent_key[self.tset.samples[i].path]]
                lat.append(e.latents)
                size.append((*e.original_size, *e.crop_top_left, *e.target_size))
            latents = torch.stack(lat).to(acc.device, dtype=torch.float32)
        else:
            pix = torch.stack([p.pixels for p in loaded_images]).to(acc.device, dtype=b.vae.dtype)
            with torch.no_grad():
                latents = latent_cache.encode_pixels(b.vae, pix).to(torch.float32)
            size = [(*p.original_size, *p.crop_top_left, *p.target_size) for p in loaded_images]
        return latents, torch.tensor(size, dtype=torch.float32, device=acc.device)

    def micro_step_loss(self, epoch: int, idx: list[int], loaded_images, n_global: int):
        """Sum over this process's samples of weight * MSE, divided by the global batch size."""
        import torch


        opts, b, acc = self.opts, self.bundle, self.accelerator
        latents, size_cond = self._sample_latents(idx, loaded_images)
        sched = b.noise_scheduler
        noise, timesteps = [], []
        for i in idx:
            # Sample-keyed randomness: the same sample gets the same noise and timestep whatever
            # the process count, batch split or resume point.
            g = torch.Generator().manual_seed(step_plan.derive_seed("sample", opts.seed, epoch, i))
            noise.append(torch.randn(latents.shape[1:], generator=g))
            timesteps.append(int(torch.randint(0, sched.config.num_train_timesteps, (1,), generator=g)))
        noise = torch.stack(noise).to(acc.device)
        timesteps = torch.tensor(timesteps, device=acc.device, dtype=torch.long)
        noisy = sched.add_noise(latents, noise, timesteps)
        captions = [self.tset.samples[i].caption for i in idx]
        tokens = [t.to(acc.device) for t in self.adapter.tokenize(captions)]
        with acc.autocast():
            if self.method.train_text_encoder:
                cond = self.adapter.encode(tokens, opts.clip_skip)
            else:
                with torch.no_grad():
                    cond = self.adapter.encode(tokens, opts.clip_skip)
            pred = self.adapter.unet_forward(noisy.to(self._unet_dtype()), timesteps, cond,
                                             size_cond if b.family == "sdxl" else None)
        target = sched.get_velocity(latents, noise, timesteps) if b.v_parameterization else noise
        per_sample = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="none")
        per_sample = per_sample.mean(dim=(1, 2, 3))
        weights = torch.tensor([opts.prior_loss_weight if self.tset.samples[i].is_reg else 1.0
                                for i in idx], device=acc.device)
        return (per_sample * weights).sum() / n_global

    def _unet_dtype(self):
        return next(self.bundle.unet.parameters()).dtype

    # -- the loop -----------------------------------------------------------------------------
    def train(self):
        from torch.utils.data import DataLoader
        from tqdm.auto import tqdm

        from library.training_data import MicroBatchImages

        opts, acc, plan = self.opts, self.accelerator, self.plan
        P, rank = acc.num_processes, acc.process_index
        bs, A = opts.train_batch_size, opts.gradient_accumulation_steps
        self.global_step = 0
        self.loss_log: list[float] = []   # per step: the global batch's mean loss (all processes)
        self.lr_log: list[float] = []     # per step: the learning rate of the first param group
        bar = tqdm(total=plan.total_steps, disable=not acc.is_main_process, desc="steps",
                   dynamic_ncols=True)
        done = False
        for epoch in range(1, plan.epochs + 1):
            self.method.set_train(epoch)
            batches = step_plan.epoch_batches(self.tset.bucket_of, opts.seed, epoch, plan.global_batch)
            # This process's micro-batches, in order: for each global batch, A micro-steps.
            mine = [gb.micro_batch(a, rank, bs, P) for gb in batches for a in range(A)]
            loader = None
            if self.latents is None:
                loader = iter(DataLoader(MicroBatchImages(self.tset.samples, mine), batch_size=None,
                                         num_workers=opts.max_data_loader_n_workers,
                                         collate_fn=lambda x: x))
            k = 0
            for gb in batches:
                loss_sum = 0.0
                for a in range(A):
                    idx = list(mine[k])
                    images = next(loader) if loader is not None else None
                    k += 1
                    if not idx:
                        # An empty share of a partial global batch: no forward; this process
                        # contributes zeros to the gradient sum below (which it still joins).
                        continue
                    loss = self.micro_step_loss(epoch, idx, images, len(gb.indices))
                    self.stepper.backward(loss)
                    loss_sum += float(loss.detach())
                step_lr = self.stepper.current_lr()
                self.stepper.step()  # every process, every step: it joins the gradient sum
                self.global_step += 1
                if self.global_step == 1:
                    logger.info(f"first step done {seconds_since_process_start():.2f}s after start")
                step_loss = distributed.all_reduce_sum(loss_sum, acc.device)
                self.loss_log.append(step_loss)
                self.lr_log.append(step_lr)
                bar.update(1)
                bar.set_postfix(loss=f"{step_loss:.4f}", lr=f"{step_lr:.2e}")
                if opts.save_every_n_steps and self.global_step % opts.save_every_n_steps == 0 \
                        and self.global_step < plan.total_steps:
                    self.save(epoch=None, step=self.global_step)
                if self.global_step >= plan.total_steps:
                    done = True
                    break
            self.epoch = epoch
            if done:
                break
            if opts.save_every_n_epochs and epoch % opts.save_every_n_epochs == 0 and epoch < plan.epochs:
                self.save(epoch=epoch, step=None)
        bar.close()

    def save(self, *, epoch=None, step=None, final=False):
        from library import metadata as md
        from library.saving import output_file

        acc = self.accelerator
        acc.wait_for_everyone()
        if acc.is_main_process:
            os.makedirs(self.opts.output_dir, exist_ok=True)
            path = output_file(self.opts.output_dir, self.opts.output_name,
                               self.method.extension(), epoch=epoch, step=step)
            meta = md.step_metadata(self.base_metadata, epoch=epoch or getattr(self, "epoch", 0),
                                    step=self.global_step, finished_at=time.time())
            self.method.save(path, self.opts.save_precision, meta)
            logger.info(f"saved {path}")
            self.saved.append(path)
        acc.wait_for_everyone()


def run(opts, method_name: str) -> Run | None:
    """Plan, then (unless --dry_run) load, train and save. Returns the Run for tests."""
    setup_logging()
    processes = distributed.launched_world_size()
    r = Run(opts, method_name)
    r.tset, r.plan = plan_run(opts, processes)
    main = int(os.environ.get("RANK", "0")) == 0
    if opts.dry_run:
        print_plan(r.plan, main)
        return None
    started = time.time()
    r.validate()
    r.load()
    print_plan(r.plan, r.accelerator.is_main_process)
    r.setup_method()
    r.cache()
    from library import metadata as md

    r.base_metadata = md.build_metadata(
        opts=opts, family=r.bundle.family, v_parameterization=r.bundle.v_parameterization,
        adapter=r.method.adapter, num_train_images=r.plan.repeats_total,
        num_reg_images=len(r.tset.reg_items), train_items=r.tset.train_items, started_at=started,
        network_info=r.method.info)
    r.saved = []
    r.train()
    r.save(final=True)
    if r.loss_log and r.accelerator.is_main_process:
        first = sum(r.loss_log[:3]) / min(3, len(r.loss_log))
        last = sum(r.loss_log[-3:]) / min(3, len(r.loss_log))
        print(f"done: steps {r.global_step}, epochs {r.epoch}, loss first {first:.4f} last {last:.4f}",
              flush=True)
    return r
