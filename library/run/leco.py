"""LECO (train_leco.py): concept erasing and sliders trained from prompts only, as sd-scripts'
``train_leco.py`` / ``sdxl_train_leco.py``; the result is an ordinary U-Net LoRA file.

One step (sd-scripts' loop, every draw from a generator keyed by (seed, step)):

1. pick a prompt setting (library/config/leco_prompts.py) and a stop point ``k`` in
   [1, max_denoising_steps - 1]; draw Gaussian noise of the setting's batch and resolution
   (times the sampler's initial sigma, plus ``noise_offset`` per channel);
2. denoise it ``k`` of ``max_denoising_steps`` sampler steps with the network on at the
   setting's multiplier, classifier-free guided (target prompt against the unconditional one,
   ``leco_denoise_guidance_scale``) -> ``x``; without gradient, as the original LECO (sd-scripts
   keeps the graph of these steps; their gradient only moves the starting point of the target);
3. at the timestep ``t`` the full 1000-step schedule reaches at ``k``, the model with the network
   off predicts ``positive``, ``neutral`` and ``unconditional`` on ``x``; the LECO target is
   ``neutral - guidance_scale * (positive - unconditional)`` (erase) or ``+`` (enhance);
4. the model with the network on, on the target prompt, is trained toward it: the mean squared
   error per sample (times min-SNR's weight at ``t`` when set), mean, times the setting's weight.

The noise and sampler are the model's own (its prediction type: a v-prediction model's
"predictions" are v, and the target is formed from them in the same way). One process only.
"""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch
from accelerate.utils import set_seed
from diffusers import DDPMScheduler

from library import accelerator
from library.accelerator import is_main_process
from library.config import leco_prompts
from library.config.parse import required
from library.data.step_plan import derive_seed
from library.errors import UserError
from library.distributed.strategy import SingleProcess
from library.log import logger, setup_logging
from library.models import family, inpainting, loading, placement
from library.models.families import registry
from library.models.family import FamilyModel, TextConditioning
from library.outputs import metadata, output_checks, train_state
from library.outputs.checkpoints import SaveTargets, Saver
from library.run import loop
from library.training import losses, methods, nonfinite, offload, optim, step_sync
from library.training.progress import Progress
from library.training.stepper import make_stepper

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options


class LecoError(UserError, ValueError):
    """An option or combination train_leco cannot honour; one line naming it."""


@dataclasses.dataclass
class LecoRun:
    """What a finished run leaves (for tests): the bundle, the method (its network), the loss
    per step and the files written."""
    bundle: object
    method: object
    losses: list
    saved: list


def check_options(opts: Options) -> None:
    """Before any weight loads."""
    if accelerator.launched_world_size() > 1:
        raise LecoError("train_leco runs as one process (its steps draw prompts, not a dataset to "
                        "shard): launch it without --num_processes / --nproc_per_node")
    if opts.mixed_precision == "fp16":
        raise LecoError("train_leco: mixed_precision fp16 needs loss scaling, which train_leco "
                        "does not have; use bf16 or no")
    if opts.network_train_unet_only is False and "network_train_unet_only" in opts.given:
        raise LecoError("train_leco trains the U-Net only (the text encoders only encode the "
                        "prompts, once): network_train_unet_only = false cannot apply")


def run(opts: Options) -> LecoRun:
    setup_logging(is_main_process())
    started = time.time()
    check_options(opts)
    settings = leco_prompts.read_prompt_file(required(opts.prompts_file, "prompts_file"))
    total = required(opts.max_train_steps, "max_train_steps")  # LECO has no epochs
    warmup = optim.steps_of(opts.lr_warmup_steps, total)
    optim.check_optimizer(opts.optimizer_type, opts.optimizer_args, probe=True,
                          learning_rate=opts.learning_rate)
    optim.check_scheduler(opts, warmup_steps=warmup, total_steps=total)
    # the LoRA of train_lora, on the U-Net only
    opts = dataclasses.replace(opts, network_train_unet_only=True)
    methods.make_method("lora", opts, None)  # network module and its args, before the weights
    logger.info(f"LECO: {len(settings)} prompt setting(s) from {opts.prompts_file}, {total} steps")
    lock = output_checks.prepare(opts, "lora", is_main_process(), logger)
    with lock:
        acc = accelerator.accelerator_for(opts)
        set_seed(opts.seed)
        b = loading.load_from_options(opts)
        if inpainting.is_inpainting(b.unet):
            raise LecoError(f"{opts.pretrained_model_name_or_path} is an inpainting model: LECO "
                            "denoises from noise alone, with no image and mask to condition on")
        loading.set_attention(b, opts)
        family_model = family.family_model_for(b, max_token_length=opts.max_token_length)
        pl = placement.dtype_placement(opts, "lora", False, len(b.text_encoders))
        device = acc.device
        for te, te_dtype in zip(b.text_encoders, pl.text_encoders):
            placement.place(te, te_dtype, pl.compute, device)
        prompts = encode_prompts(family_model, settings, opts.clip_skip, device)
        for te in b.text_encoders:  # the prompts are all they were needed for
            te.to("cpu")
        placement.place(b.unet, pl.unet, pl.compute, device)
        torch.manual_seed(opts.seed)  # network init is part of the seeded run
        method = methods.make_method("lora", opts, b)
        groups = method.setup()
        net = method.network
        net.to(device, dtype=pl.network)
        if opts.gradient_checkpointing:
            b.unet.enable_gradient_checkpointing()
        b.unet.train()
        net.train()
        # the common stepper (one process: nothing to sum), the saver and the metadata writer
        stepper = make_stepper(acc, opts, groups, method.trainable_parameters(),
                               warmup_steps=warmup, total_steps=total, grad_sum=None)
        sampler = make_sampler(b)
        denoiser = Denoiser.of(b, family_model)
        progress = Progress()
        saved: list[str] = []  # the files written, in order
        base_md = metadata.leco_metadata(opts, model=metadata.ModelKind(b.family, b.v_parameterization, "lora"),
                                         network_info=method.info, settings=settings, started_at=started)
        targets = SaveTargets(bundle=b, method=method, params=method.trainable_parameters(),
                              named=train_state.named_trainable(method, b), ema=None,
                              frozen=offload.Frozen(device, keep_on_device=True))  # nothing released
        saver = Saver(opts, None, base_md, saved, targets=targets, accelerator=acc,
                      strategy=SingleProcess(acc), stepper=stepper, epochs=False)
        for step in range(total):
            d = draw(opts, settings, step)
            with acc.autocast():
                loss, _ = leco_loss(b, denoiser, net, sampler, prompts, d, opts)
            # the step's collective and its one read, as in the loop (library/run/loop.py): the
            # guard decides before any update (library/training/nonfinite.py), so a non-finite
            # loss or gradient norm leaves the weights as they were
            pending = step_sync.gather(None, device, step_sync.add_loss(None, loss))
            stepper.backward(loss, loss_finite=pending.loss_finite)
            read = stepper.step(pending.read)
            bad = None if read.finite else f"loss {nonfinite.describe(read.loss)}"
            bad = bad or stepper.nonfinite
            if bad is not None:
                loop.on_nonfinite(bad, None, opts.on_nonfinite, progress, stepper, None, saver)
            progress.global_step += 1
            progress.loss_log.append(read.loss)
            logger.info(f"step {step + 1}/{total}: loss {read.loss:.6f} ({d.setting.action} "
                        f"{d.setting.target!r}, multiplier {d.setting.multiplier})")
            n = opts.save_every_n_steps
            if n and (step + 1) % n == 0 and step + 1 < total:
                saver.save(progress, step=step + 1)
        saver.save(progress, final=True)
    step_losses = progress.loss_log
    print(f"done: steps {total}, loss first {step_losses[0]:.4f} last {step_losses[-1]:.4f}", flush=True)
    return LecoRun(b, method, step_losses, saved)


# -- prompts --------------------------------------------------------------------------------------

def encode_prompts(family_model, settings, clip_skip, device) -> dict:
    """Every distinct prompt of the settings, encoded once: prompt -> TextConditioning (1, ...)."""
    texts = sorted({p for s in settings for p in (s.target, s.positive, s.unconditional, s.neutral)})
    out = {}
    with torch.no_grad():
        for t in texts:
            tokens = [x.to(device) for x in family_model.tokenize([t])]
            out[t] = family_model.encode(tokens, clip_skip)
    return out


def _repeat(cond, n: int):
    return TextConditioning(cond.hidden_states.expand(n, *cond.hidden_states.shape[1:]),
                            None if cond.pooled is None else cond.pooled.expand(n, *cond.pooled.shape[1:]))


# -- one step ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Draw:
    """The random choices of one step (keyed by (seed, step))."""
    setting: leco_prompts.PromptSetting
    stop: int          # denoising steps taken, in [1, max_denoising_steps - 1]
    height: int
    width: int
    noise: torch.Tensor  # (batch, 4, h/8, w/8) float32, before the initial sigma
    offset: torch.Tensor | None  # (batch, 4, 1, 1) noise_offset's per-channel noise
    size_cond: tuple   # SDXL (original h, w, crop top, left, target h, w)
    denoise_seed: int  # the sampler's own noise (DDPM steps add some) during the partial denoising


def draw(opts: Options, settings, step: int) -> Draw:
    """Step ``step``'s choices, as sd-scripts draws them, from one generator keyed by (seed, step)."""
    g = torch.Generator().manual_seed(derive_seed("leco", opts.seed, step))
    s = settings[int(torch.randint(0, len(settings), (1,), generator=g))]
    stop = int(torch.randint(1, opts.max_denoising_steps, (1,), generator=g))
    h, w = s.resolution
    if s.dynamic_resolution and h == w:  # sd-scripts: a random 64-multiple in [res/2, res] each side
        lo, hi = (h // 2) // 64, h // 64
        h = int(torch.randint(lo, hi + 1, (1,), generator=g)) * 64
        w = int(torch.randint(lo, hi + 1, (1,), generator=g)) * 64
    noise = torch.randn((s.batch_size, 4, h // 8, w // 8), generator=g)
    offset = None
    if opts.noise_offset:
        offset = torch.randn((s.batch_size, 4, 1, 1), generator=g)
    size = (h, w, 0, 0, h, w)
    if s.dynamic_crops:  # sd-scripts' get_add_time_ids: a random upscale and crop origin
        scale = float(torch.rand(1, generator=g)) * 2 + 1
        oh, ow = int(h * scale), int(w * scale)
        top = int(torch.randint(0, max(oh - h, 1), (1,), generator=g))
        left = int(torch.randint(0, max(ow - w, 1), (1,), generator=g))
        size = (oh, ow, top, left, h, w)
    return Draw(s, stop, h, w, noise, offset, size, derive_seed("leco-denoise", opts.seed, step))


def make_sampler(bundle):
    """The model's own scheduler (its betas and prediction type), as a DDPM sampler."""
    return DDPMScheduler.from_config(bundle.noise_scheduler.config)


@dataclasses.dataclass(frozen=True)
class Denoiser:
    """The model LECO predicts with: the family model's backbone, and whether it takes SDXL's
    size conditioning (its family's); made once per run (``of``)."""
    family_model: FamilyModel
    size_conditioning: bool

    @classmethod
    def of(cls, bundle, family_model: FamilyModel) -> Denoiser:
        return cls(family_model, registry.of(bundle).size_conditioning)

    def __call__(self, x, t, ctx: TextConditioning, size_cond):
        """The prediction for latents ``x`` (B,...) at timestep ``t`` on ``ctx`` (B, ...)."""
        n = x.shape[0]
        ts = torch.full((n,), int(t), device=x.device, dtype=torch.long)
        sc = None
        if self.size_conditioning:
            sc = torch.tensor([size_cond] * n, dtype=torch.float32, device=x.device)
        return self.family_model.unet_forward(x, ts, ctx, sc)


@dataclasses.dataclass(frozen=True)
class Guidance:
    """Classifier-free guidance of the partial denoising: the text and the unconditional
    prompts' conditioning (1, ...) and the scale (``leco_denoise_guidance_scale``)."""
    cond: TextConditioning
    uncond: TextConditioning
    scale: float


def predict(model: Denoiser, x, t, cond, size_cond):
    """The model's prediction for latents ``x`` (B,...) at timestep ``t`` on ``cond`` (1, ...)."""
    return model(x, t, _repeat(cond, x.shape[0]), size_cond)


def denoise_partway(model: Denoiser, sampler, x, guidance: Guidance, steps: int, stop: int,
                    size_cond, generator=None):
    """``stop`` of ``steps`` sampler steps from ``x``, classifier-free guided (sd-scripts'
    ``diffusion``); ``generator`` (CPU): the noise a stochastic sampler step adds."""
    cond, uncond = guidance.cond, guidance.uncond
    sampler.set_timesteps(steps, device=x.device)
    for t in sampler.timesteps[:stop]:
        both = torch.cat([x, x])
        model_in = sampler.scale_model_input(both, t)
        pair = torch.cat([uncond.hidden_states, cond.hidden_states])
        pooled = None if cond.pooled is None else torch.cat([uncond.pooled, cond.pooled])
        ctx = TextConditioning(pair.repeat_interleave(x.shape[0], 0),
                               None if pooled is None else pooled.repeat_interleave(x.shape[0], 0))
        pred = model(model_in, t, ctx, size_cond)
        p_uncond, p_text = pred.chunk(2)
        guided = p_uncond + guidance.scale * (p_text - p_uncond)
        x = sampler.step(guided, t, x, generator=generator).prev_sample
    return x


def leco_loss(bundle, model: Denoiser, network, sampler, prompts: dict, d: Draw, opts: Options):
    """The step's loss and what it was made of: (loss, parts) with parts = {latents, timestep,
    positive, neutral, unconditional, target, prediction}."""
    s = d.setting
    device = next(bundle.unet.parameters()).device
    dtype = next(bundle.unet.parameters()).dtype
    x = (d.noise.to(device) * sampler.init_noise_sigma)
    if d.offset is not None:
        x = x + opts.noise_offset * d.offset.to(device)
    x = x.to(dtype)
    network.set_multiplier(s.multiplier)
    with torch.no_grad():
        guidance = Guidance(prompts[s.target], prompts[s.unconditional], opts.leco_denoise_guidance_scale)
        x = denoise_partway(model, sampler, x, guidance, opts.max_denoising_steps, d.stop, d.size_cond,
                            torch.Generator().manual_seed(d.denoise_seed))
    sampler.set_timesteps(1000, device=x.device)
    index = int(d.stop * 1000 / opts.max_denoising_steps)
    t = sampler.timesteps[index]
    network.set_multiplier(0.0)
    with torch.no_grad():
        pos = predict(model, x, t, prompts[s.positive], d.size_cond)
        neu = predict(model, x, t, prompts[s.neutral], d.size_cond)
        unc = predict(model, x, t, prompts[s.unconditional], d.size_cond)
    network.set_multiplier(s.multiplier)
    pred = predict(model, x, t, prompts[s.target], d.size_cond)
    target = s.build_target(pos.float(), neu.float(), unc.float())
    loss = torch.nn.functional.mse_loss(pred.float(), target, reduction="none").mean(dim=(1, 2, 3))
    if opts.min_snr_gamma:
        ac = sampler.alphas_cumprod[int(t)].to(torch.float64)
        snr = torch.tensor([float(ac / (1 - ac))], dtype=torch.float32, device=loss.device)
        loss = loss * losses.min_snr_weight(snr, opts.min_snr_gamma, bundle.v_parameterization)
    loss = loss.mean() * s.weight
    parts = dict(latents=x, timestep=int(t), positive=pos, neutral=neu, unconditional=unc,
                 target=target, prediction=pred)
    return loss, parts
