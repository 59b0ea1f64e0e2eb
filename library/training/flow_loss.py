"""The losses of a flow-matching family (FLUX.1), behind the interface the batch loss calls on
library/training/losses.py's ``Losses``: ``draw`` (per-sample noise, then the sample's noise
level, each from the sample's own generator), ``noisy_latents`` (x_t = (1 - sigma) x0 + sigma
noise), ``per_sample_loss`` (prediction and target by model_prediction_type, the elementwise
loss, masks, the scheme's per-sample weight). The formulas are library/training/flow_matching.py's.

    losses = losses_for(opts, bundle)      FlowLosses for FLUX.1, the DDPM Losses otherwise
"""
from __future__ import annotations

from dataclasses import dataclass

from library.training import flow_matching
from library.training import losses as ddpm_losses


@dataclass
class FlowDraw(ddpm_losses.Draw):
    """Draw plus the (B,) float32 noise levels; ``timesteps`` is the model's timestep input."""

    sigmas: object = None


def losses_for(opts, bundle):
    """The run's losses: flow matching for a FLUX.1 bundle, else the DDPM noise schedule's."""
    if bundle.family in ("flux", "sd3"):
        from library.models.flow_family import flow_options

        return FlowLosses(opts, flow_options(opts, bundle.family))
    return ddpm_losses.Losses(opts, bundle.noise_scheduler, bundle.v_parameterization)


class FlowLosses:
    """Noise levels, noisy input and loss of one flow-matching run (FlowOptions ``flow``)."""

    v_prediction = False

    def __init__(self, opts, flow: flow_matching.FlowOptions):
        flow_matching.check_flow_options(flow)
        self.opts = opts
        self.flow = flow

    def draw(self, latents, generators) -> FlowDraw:
        """Sample k's noise (randn of its latent's shape) and then its noise level, both from
        generators[k] only (noise before the level, as losses.py orders noise before timestep)."""
        import torch

        c, h, w = latents.shape[1:]
        noise = torch.stack([torch.randn((c, h, w), generator=g) for g in generators])
        t = flow_matching.sample_timesteps(self.flow, generators, (h, w))
        dev = latents.device
        noise = noise.to(dev)
        return FlowDraw(noise, noise, t.model_timesteps.to(dev), t.sigmas.to(dev))

    def noisy_latents(self, latents, d: FlowDraw):
        return flow_matching.noisy_input(latents, d.input_noise, d.sigmas)

    def target(self, latents, d: FlowDraw):
        """What a raw prediction is compared with: the velocity noise - x0."""
        return flow_matching.flow_target(latents, d.noise)

    def per_sample_loss(self, pred, latents, d: FlowDraw, mask=None, target=None):
        """(B,) loss of each sample: prediction and target by model_prediction_type, the
        elementwise loss (times the mask), averaged per sample, times the scheme's weight."""
        noisy = self.noisy_latents(latents, d)
        p, t, weight = flow_matching.prediction_and_target(self.flow, pred.float(), noisy.float(),
                                                           latents.float(), d.noise.float(), d.sigmas)
        if target is not None:
            t = target
        loss = ddpm_losses.elementwise_loss(p, t.float(), self.opts.loss_type)
        if mask is not None:
            loss = ddpm_losses.apply_masked_loss(loss, mask)
        loss = loss.mean(dim=(1, 2, 3))
        return loss if weight is None else loss * weight.to(loss.device, loss.dtype)
