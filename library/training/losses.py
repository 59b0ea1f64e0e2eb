"""Noise, timesteps and loss variants, under sd-scripts' option names and with its formulas.

    check_options(opts)                 before any weight is loaded (Run.validate)
    L = Losses(opts, noise_scheduler, v)  the run's Losses (built once by the trainer, after the load)
    d = L.draw(latents, generators)     noise and timesteps, one generator per sample
    noisy = L.noisy_latents(latents, d)
    per_sample = L.per_sample_loss(pred, latents, d, mask)   (B,), before the prior-loss weight
                                        (mask: masked loss, (B, 1, h, w) in [0, 1], or None)

Every random draw for a sample comes from that sample's own generator (seeded by seed, epoch and
the sample's position in the epoch), in this fixed order, each only when its option is on:

  1. the noise, (C, H, W) ~ N(0, 1)
  2. the timestep, uniform in [min_timestep, max_timestep)
  3. noise_offset: with noise_offset_random_strength a strength u ~ U[0, 1); then (C, 1, 1) ~ N(0, 1)
  4. multires noise: per level i a factor u ~ U[0, 1) (r = 2 + 2u), then (C, h_i, w_i) ~ N(0, 1)
  5. ip_noise_gamma: with ip_noise_gamma_random_strength a strength u ~ U[0, 1); then (C, H, W) ~ N(0, 1)

Nothing draws from the global RNG, so a sample gets the same noise whatever the batch split, the
process count or the resume point (DESIGN.md, "Step accounting"). With every variant off, 1 and 2
are exactly the draws of the plain trainer.

The formulas are sd-scripts' (library/train_util.py, library/custom_train_functions.py), with these
deliberate differences, each needed for the per-sample contract or fixing a known bug:
- The random strengths of noise_offset_random_strength and ip_noise_gamma_random_strength are drawn
  per sample (sd-scripts: one per batch, so a sample's noise depended on its batch).
- Multires (pyramid) noise is rescaled by the sample's own standard deviation (sd-scripts: the
  whole batch's), and its per-level factor r comes from the sample's generator (sd-scripts:
  Python's global `random`).
- SNR-based weights (min_snr_gamma, scale_v_pred_loss_like_noise_pred, v_pred_like_loss,
  debiased_estimation_loss) use the SNR of the schedule the noise is actually added with, i.e.
  after zero_terminal_snr; sd-scripts computes its SNR table before that fix (kohya-ss/sd-scripts
  issues #1263, #1905). The epsilon min-SNR weight min(SNR, gamma) / SNR is computed as the equal
  min(gamma / SNR, 1), which is also defined (1) at SNR 0.
"""
from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from library.errors import UserError

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")


class LossOptionError(UserError):
    """An impossible combination of noise / loss options; one line naming the options."""


def check_options(opts: Options) -> None:
    """Combinations that fail whatever the model is: errors before any weight is loaded; options
    set explicitly that have no effect in this combination: one warning each."""
    if opts.adaptive_noise_scale is not None and not opts.noise_offset:
        raise LossOptionError("adaptive_noise_scale requires noise_offset (a value above 0)")
    if opts.min_timestep is not None and opts.max_timestep is not None \
            and opts.min_timestep > opts.max_timestep:
        raise LossOptionError(f"min_timestep ({opts.min_timestep}) is larger than max_timestep "
                              f"({opts.max_timestep})")
    if opts.v_pred_like_loss and opts.v_parameterization:
        raise LossOptionError("v_pred_like_loss cannot be used with v_parameterization (it adds a "
                              "v-prediction-like term to an epsilon-prediction loss)")
    given = opts.given

    def unused(name, why):
        if name in given:
            logger.warning("option %s has no effect here (%s)", name, why)

    if not opts.noise_offset:
        unused("noise_offset_random_strength", "noise_offset is not set")
    if not opts.ip_noise_gamma:
        unused("ip_noise_gamma_random_strength", "ip_noise_gamma is not set")
    if not opts.multires_noise_iterations:
        unused("multires_noise_discount", "multires_noise_iterations is not set")
    if opts.loss_type not in ("huber", "smooth_l1"):
        for name in ("huber_c", "huber_scale", "huber_schedule"):
            unused(name, f"loss_type is {opts.loss_type}, not huber or smooth_l1")
    elif opts.huber_schedule == "snr":
        unused("huber_scale", "the snr huber_schedule does not use it, as in sd-scripts")


@dataclass
class Draw:
    """The random part of one micro-batch: (B,C,H,W) target noise, (B,C,H,W) noise actually added
    to the latents (the target noise plus the input perturbation of ip_noise_gamma), (B,) long
    timesteps."""

    noise: torch.Tensor
    input_noise: torch.Tensor
    timesteps: torch.Tensor


class Losses:
    """The noise schedule, noise sampling and loss of one run."""

    def __init__(self, opts: Options, noise_scheduler, v_parameterization: bool):
        self.opts = opts
        self.v_prediction = bool(v_parameterization)
        n = noise_scheduler.config.num_train_timesteps
        self.num_timesteps = n
        self.min_timestep = 0 if opts.min_timestep is None else opts.min_timestep
        self.max_timestep = n if opts.max_timestep is None else opts.max_timestep
        self._check_model(opts, n)
        if opts.zero_terminal_snr:
            # A copy: the model bundle's scheduler stays as loaded (others may read it).
            noise_scheduler = copy.deepcopy(noise_scheduler)
            zero_terminal_snr(noise_scheduler)
        self.scheduler = noise_scheduler
        ac = noise_scheduler.alphas_cumprod.to(torch.float32)
        self.all_snr = (torch.sqrt(ac) / torch.sqrt(1.0 - ac)) ** 2  # sd-scripts' all_snr

    def _check_model(self, opts: Options, n: int) -> None:
        v = self.v_prediction
        if self.min_timestep >= n:
            raise LossOptionError(f"min_timestep ({self.min_timestep}) must be below the model's "
                                  f"{n} training timesteps")
        if self.max_timestep > n:
            raise LossOptionError(f"max_timestep ({self.max_timestep}) is above the model's {n} "
                                  "training timesteps")
        if opts.scale_v_pred_loss_like_noise_pred and not v:
            raise LossOptionError("scale_v_pred_loss_like_noise_pred needs a v-prediction model; "
                                  "this one predicts epsilon (pass --v_parameterization if it is v)")
        if opts.v_pred_like_loss and v:
            raise LossOptionError("v_pred_like_loss cannot be used with a v-prediction model (it adds "
                                  "a v-prediction-like term to an epsilon-prediction loss)")
        if opts.zero_terminal_snr and not v:
            logger.warning("zero_terminal_snr with an epsilon-prediction model: the last timestep "
                           "carries no signal, training will be unexpected (as sd-scripts warns)")
            if self.max_timestep == n and self.min_timestep < n:
                # SNR is exactly 0 at the last timestep: 1/sqrt(SNR) and 1/(SNR/(SNR+1)) are infinite.
                for name in ("debiased_estimation_loss", "v_pred_like_loss"):
                    if getattr(opts, name):
                        raise LossOptionError(
                            f"{name} with zero_terminal_snr on an epsilon-prediction model: its weight "
                            f"is infinite at the last timestep (SNR 0); set max_timestep below {n} or "
                            "train a v-prediction model")

    # -- noise and timesteps ------------------------------------------------------------------
    def draw(self, latents, generators) -> Draw:
        """Noise and timesteps for a micro-batch, sample k drawn only from generators[k]."""
        noise, input_noise, timesteps = [], [], []
        adaptive = self.opts.noise_offset and self.opts.adaptive_noise_scale is not None
        for k, g in enumerate(generators):
            # the latent itself only feeds adaptive_noise_scale (avoid a device sync otherwise)
            n, x, t = self._draw_one(latents[k].detach().float().cpu() if adaptive else None,
                                     tuple(latents.shape[1:]), g)
            noise.append(n)
            input_noise.append(x)
            timesteps.append(t)
        dev = latents.device
        return Draw(torch.stack(noise).to(dev), torch.stack(input_noise).to(dev),
                    torch.tensor(timesteps, dtype=torch.long, device=dev))

    def _draw_one(self, latent, shape, g):
        o = self.opts
        c, h, w = shape
        noise = torch.randn((c, h, w), generator=g)
        if self.min_timestep < self.max_timestep:
            t = int(torch.randint(self.min_timestep, self.max_timestep, (1,), generator=g))
        else:
            t = self.max_timestep  # sd-scripts: min == max trains that one timestep
        if o.noise_offset:
            strength = o.noise_offset
            if o.noise_offset_random_strength:
                strength = float(torch.rand(1, generator=g)) * o.noise_offset
            noise = apply_noise_offset(latent, noise, strength, o.adaptive_noise_scale,
                                       torch.randn((c, 1, 1), generator=g))
        if o.multires_noise_iterations:
            noise = pyramid_noise(noise, o.multires_noise_iterations, o.multires_noise_discount, g)
        input_noise = noise
        if o.ip_noise_gamma:
            strength = o.ip_noise_gamma
            if o.ip_noise_gamma_random_strength:
                strength = float(torch.rand(1, generator=g)) * o.ip_noise_gamma
            input_noise = noise + strength * torch.randn((c, h, w), generator=g)
        return noise, input_noise, t

    def noisy_latents(self, latents, d: Draw):
        return self.scheduler.add_noise(latents, d.input_noise, d.timesteps)

    def target(self, latents, d: Draw):
        if self.v_prediction:
            return self.scheduler.get_velocity(latents, d.noise, d.timesteps)
        return d.noise

    # -- the loss -----------------------------------------------------------------------------
    def huber_threshold(self, timesteps):
        """sd-scripts' get_huber_threshold_if_needed: (B,) or None for l1/l2."""
        o = self.opts
        if o.loss_type not in ("huber", "smooth_l1"):
            return None
        if o.huber_schedule == "constant":
            return torch.full((timesteps.shape[0],), o.huber_c * o.huber_scale, device=timesteps.device)
        if o.huber_schedule == "exponential":
            alpha = -math.log(o.huber_c) / self.num_timesteps
            return torch.exp(-alpha * timesteps) * o.huber_scale
        # snr: huber_c where the noise dominates, rising to 1 where the signal does
        ac = self.scheduler.alphas_cumprod.to(timesteps.device)[timesteps]
        sigmas = ((1.0 - ac) / ac) ** 0.5
        return (1 - o.huber_c) / (1 + sigmas) ** 2 + o.huber_c

    def per_sample_loss(self, pred, latents, d: Draw, mask=None, target=None):
        """(B,) loss of each sample: the elementwise loss (times the mask, with masked loss)
        averaged per sample, then weighted. ``target``: instead of the noise (or velocity), e.g.
        diff_output_preservation's prior prediction in some rows (library/training/batch_loss.py)."""
        target = self.target(latents, d) if target is None else target
        loss = elementwise_loss(pred.float(), target.float(), self.opts.loss_type,
                                self.huber_threshold(d.timesteps))
        if mask is not None:
            loss = apply_masked_loss(loss, mask)
        return self.weight(loss.mean(dim=(1, 2, 3)), d.timesteps)

    def weight(self, loss, timesteps):
        """sd-scripts' post_process_loss, in its order."""
        o = self.opts
        snr = self.all_snr.to(loss.device)[timesteps]
        if o.min_snr_gamma:
            loss = loss * min_snr_weight(snr, o.min_snr_gamma, self.v_prediction)
        if o.scale_v_pred_loss_like_noise_pred:
            loss = loss * snr_scale(snr)
        if o.v_pred_like_loss:
            loss = loss + loss / snr_scale(snr) * o.v_pred_like_loss
        if o.debiased_estimation_loss:
            loss = loss * debiased_weight(snr, self.v_prediction)
        return loss


# -- the formulas, on tensors ---------------------------------------------------------------------

def apply_noise_offset(latent, noise, strength: float, adaptive_noise_scale, offset_noise):
    """noise + offset * N(0,1) per channel; with adaptive_noise_scale the offset grows with the
    channel's |mean| (clamped at 0). latent, noise: (C,H,W); offset_noise: (C,1,1)."""
    offset = strength
    if adaptive_noise_scale is not None:
        mean = torch.abs(latent.mean(dim=(1, 2), keepdim=True))
        offset = torch.clamp(strength + adaptive_noise_scale * mean, min=0.0)
    return noise + offset * offset_noise


def pyramid_noise(noise, iterations: int, discount: float, g):
    """Multi-resolution noise (sd-scripts' pyramid_noise_like) of one sample (C,H,W): noise at
    ever coarser scales (factor r^i, r ~ U[2, 4)) upsampled bilinearly and added with weight
    discount^i, stopping at a 1-pixel side; then rescaled to unit standard deviation."""
    c, h, w = noise.shape
    up = torch.nn.Upsample(size=(h, w), mode="bilinear")
    noise = noise.unsqueeze(0)
    for i in range(iterations):
        r = float(torch.rand(1, generator=g)) * 2 + 2
        hn, wn = max(1, int(h / r**i)), max(1, int(w / r**i))
        noise = noise + up(torch.randn((1, c, hn, wn), generator=g)) * discount**i
        if hn == 1 or wn == 1:
            break
    noise = noise[0]
    return noise / noise.std()


def elementwise_loss(pred, target, loss_type: str, huber_c=None):
    """sd-scripts' conditional_loss with reduction "none"; huber_c: (B,) thresholds."""
    if loss_type == "l2":
        return torch.nn.functional.mse_loss(pred, target, reduction="none")
    if loss_type == "l1":
        return torch.nn.functional.l1_loss(pred, target, reduction="none")
    c = huber_c.view(-1, 1, 1, 1)
    root = torch.sqrt((pred - target) ** 2 + c**2) - c
    if loss_type == "huber":
        return 2 * c * root
    if loss_type == "smooth_l1":
        return 2 * root
    raise ValueError(f"unknown loss_type {loss_type!r}")


def apply_masked_loss(loss, mask):
    """sd-scripts' apply_masked_loss: the mask (B, 1, H, W) or (B, H, W), values in [0, 1], is
    resized to the loss's (h, w) by area averaging and multiplies the elementwise loss (B, C, h, w),
    broadcast over the channels. No renormalisation: the per-sample mean that follows is over
    every element, so a half-masked image contributes about half the loss (as sd-scripts)."""
    mask = mask.to(device=loss.device, dtype=loss.dtype)
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)
    mask = torch.nn.functional.interpolate(mask, size=loss.shape[2:], mode="area")
    return loss * mask


def min_snr_weight(snr, gamma: float, v_prediction: bool):
    """Min-SNR-gamma (Hang et al. 2023): min(SNR, gamma) / SNR for epsilon, / (SNR + 1) for v."""
    if v_prediction:
        return torch.minimum(snr, torch.full_like(snr, gamma)) / (snr + 1)
    return torch.clamp(gamma / snr, max=1.0)


def snr_scale(snr):
    """SNR / (SNR + 1), SNR capped at 1000 (sd-scripts' get_snr_scale)."""
    snr = torch.minimum(snr, torch.full_like(snr, 1000.0))
    return snr / (snr + 1)


def debiased_weight(snr, v_prediction: bool):
    """Debiased estimation (Yu et al. 2024): 1/sqrt(SNR) for epsilon, 1/(SNR + 1) for v; SNR
    capped at 1000."""
    snr = torch.minimum(snr, torch.full_like(snr, 1000.0))
    return 1 / (snr + 1) if v_prediction else 1 / torch.sqrt(snr)


def zero_terminal_snr(scheduler) -> None:
    """Rescale the scheduler's betas so the last timestep has SNR 0 (Lin et al. 2023, Algorithm 1),
    in place: betas, alphas, alphas_cumprod."""
    alphas_bar_sqrt = torch.cumprod(1 - scheduler.betas, 0).sqrt()
    first, last = alphas_bar_sqrt[0].clone(), alphas_bar_sqrt[-1].clone()
    alphas_bar_sqrt = (alphas_bar_sqrt - last) * (first / (first - last))
    alphas_bar = alphas_bar_sqrt**2
    alphas = torch.cat([alphas_bar[0:1], alphas_bar[1:] / alphas_bar[:-1]])
    betas = 1 - alphas
    scheduler.betas = betas
    scheduler.alphas = 1.0 - betas
    scheduler.alphas_cumprod = torch.cumprod(scheduler.alphas, dim=0)
