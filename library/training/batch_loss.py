"""The one per-sample loss of a batch, used by training and by validation (library/training/validation.py).

    per_sample(latents, draw, conditioning, size_cond, mask, forward, preserve, inpaint)
                                                                (B,) loss of each sample
    training(epoch, idx, loaded_images, n_global, step)         a micro-step's weighted loss
    end_step()                                                  the network back at the run's multiplier

Training and validation differ only in what they hand to ``per_sample``: training draws noise
and timesteps from each sample's generator (with the noise variants) and weights each sample
(prior_loss_weight for regularization images); validation uses fixed timesteps and plain noise
(library/training/validation.py). The forward itself (noisy latents, the U-Net under autocast in its
input dtype, SDXL's size conditioning, ``Losses.per_sample_loss`` with loss_type, SNR weighting
and masks) is this module's, once.

Two dataset-config keys act on the network here, as in sd-scripts' train_network.py:
- a dataset's ``network_multiplier``: the network runs at it while the dataset's samples train
  (a batch holds one multiplier's samples: TrainingSet.bucket_of); after the step it is back at
  the run's ``network_multiplier`` (samples, validation);
- a subset's ``custom_attributes = {diff_output_preservation = true}`` (DOP, sd-scripts PR
  #1710): its samples' target is the model's own prediction with the network at multiplier 0,
  without gradient, on the same noisy latents, timesteps and text conditioning (computed once,
  with the network on, as sd-scripts reuses its text-encoder outputs).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from library.data import images, latent_cache, step_plan, text_cache
from library.data.latent_cache import latent_slot
from library.errors import UserError
from library.models import inpainting
from library.models.families import registry
from library.models.family import TextConditioning

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options


def check_multiplier(opts: Options, tset, method) -> None:
    """network_multiplier per dataset and diff_output_preservation switch the ``method``'s
    network's multiplier: a network without ``set_multiplier()`` is refused (at set-up)."""
    acts = any(s.dop or s.network_multiplier is not None for s in tset.samples)
    net = method.network
    if acts and net is not None and not hasattr(net, "set_multiplier"):
        raise UserError(f"network_module {opts.network_module}: its network has no "
                        "set_multiplier(), which network_multiplier per dataset and "
                        "diff_output_preservation need")


class BatchLoss:
    """The loss of a run's batches: reads the losses, family model, placement, bundle, method,
    accelerator, strategy (its training forward) and caches it is given, writes nothing."""

    def __init__(self, opts: Options, tset, *, accelerator, bundle, family_model, losses, placement, method,
                 strategy, caches):
        self.opts, self.tset = opts, tset
        self.accelerator, self.bundle, self.family_model = accelerator, bundle, family_model
        self.losses, self.placement, self.method = losses, placement, method
        self.strategy, self.caches = strategy, caches
        self._switched = False  # the network runs at a dataset's multiplier (end_step restores)

    def per_sample(self, latents, draw, conditioning, size_cond, mask, forward=None, preserve=(),
                   multiplier=None, inpaint=None, seeds=None):
        """(B,) per-sample loss of latents (B,C,h,w) noised by ``draw``; ``conditioning()``
        gives the text conditioning (called under autocast: cached, or encoded now).
        ``forward(fn)`` runs the text encoding and the U-Net (training: the strategy's, so that
        DDP sees the forward); None calls it directly (validation). ``preserve``: the rows whose
        target is the prior prediction (DOP); the network is then back at ``multiplier``
        (None: the run's) after it. ``inpaint``: an inpainting model's (B,5,h,w) mask and
        masked-image latents, concatenated after the noisy latents (the prior's input too).
        ``seeds``: training's per-sample seeds of the denoiser's own draws (SD3's
        pos_emb_random_crop_rate); None (validation): none drawn."""
        noisy = self.losses.noisy_latents(latents, draw)
        x = inpainting.unet_input(noisy, inpaint)
        size = size_cond if registry.of(self.bundle).size_conditioning else None
        held = {}

        def denoise():
            with self.accelerator.autocast():
                held["cond"] = cond = conditioning()
                return self.family_model.unet_forward(x.to(self.placement.input_dtype(self.placement.unet)),
                                              draw.timesteps, cond, size, sample_seeds=seeds)

        pred = denoise() if forward is None else forward(denoise)
        target = None
        if preserve:
            target = self.losses.target(latents, draw).clone()
            rows = list(preserve)
            target[rows] = self._prior(x, draw.timesteps, held["cond"], size, rows,
                                       multiplier, seeds).to(target.dtype)
        return self.losses.per_sample_loss(pred, latents, draw, mask, target=target)  # loss_type, SNR

    def _prior(self, x, timesteps, cond, size_cond, rows, multiplier, seeds=None):
        """DOP: the U-Net's prediction for ``rows`` with the network at multiplier 0, no gradient."""
        net = self.method.network
        cond = TextConditioning(cond.hidden_states[rows],
                                None if cond.pooled is None else cond.pooled[rows])
        net.set_multiplier(0.0)
        try:
            with torch.no_grad(), self.accelerator.autocast():
                return self.family_model.unet_forward(
                    x[rows].to(self.placement.input_dtype(self.placement.unet)), timesteps[rows],
                    cond, None if size_cond is None else size_cond[rows],
                    sample_seeds=None if seeds is None else [seeds[k] for k in rows])
        finally:
            # the backward (and gradient checkpointing's recomputation in it) runs at this one
            net.set_multiplier(self.opts.network_multiplier if multiplier is None else multiplier)

    def end_step(self) -> None:
        """After a step's update: the network back at the run's network_multiplier."""
        if self._switched:
            self.method.network.set_multiplier(self.opts.network_multiplier)
            self._switched = False

    # -- training -------------------------------------------------------------------------------
    def training(self, epoch: int, idx: list[int], loaded_images, n_global: int,
                 step: int | None = None):
        """Sum over this process's samples of weight * loss, divided by the global batch size;
        ``step``: the optimizer steps done before this one (token warmup)."""
        opts = self.opts
        multiplier = self.tset.multiplier(idx) if self.method.network is not None else None
        if multiplier is not None:  # the dataset's network_multiplier
            self.method.network.set_multiplier(multiplier)
            self._switched = True
        preserve = [k for k, i in enumerate(idx) if self.tset.samples[i].dop]
        latents, size_cond, inpaint = self._latents(idx, loaded_images, epoch)
        # Sample-keyed randomness: every draw for a sample (noise, timestep, noise variants) comes
        # from its own generator, whatever the process count, batch split or resume point.
        d = self.losses.draw(latents, [torch.Generator().manual_seed(
            step_plan.derive_seed("sample", opts.seed, epoch, i)) for i in idx])
        mask = self._masks(idx, loaded_images, epoch, latents.shape[2:])  # masked loss
        seeds = [step_plan.derive_seed("te-dropout", opts.seed, epoch, i) for i in idx]  # SD3's
        # the denoiser's own per-sample draws (SD3's pos_emb_random_crop_rate), keyed alike
        forward_seeds = [step_plan.derive_seed("pos-crop", opts.seed, epoch, i) for i in idx]

        def text():  # cached or encoded now, then the family's text-encoder dropout
            return self.family_model.drop_encoders(self._text(idx, epoch, step), seeds)

        per_sample = self.per_sample(latents, d, text, size_cond,
                                     mask, forward=self.strategy.forward, preserve=preserve,
                                     multiplier=multiplier, inpaint=inpaint, seeds=forward_seeds)
        weights = torch.tensor([opts.prior_loss_weight if self.tset.samples[i].is_reg else 1.0
                                for i in idx], device=self.accelerator.device)
        return (per_sample * weights).sum() / n_global

    def _latents(self, idx: list[int], loaded_images, epoch: int):
        """Latents (B,C,h,w), SDXL size conditioning (B,6) and (train_inpainting) the inpainting
        conditioning (B,5,h,w) for this process's samples; with cached latents the sample's flip
        for this epoch picks the variant."""
        device, cache = self.accelerator.device, self.caches
        lat, size, inpaint = [], [], None
        if cache.latents is not None:  # never with train_inpainting (inpainting.check_options)
            for i in idx:
                slot = latent_slot(self.tset.samples[i], self.tset.flip(i, epoch))
                e = cache.latents[cache.latent_key[slot]]
                lat.append(e.latents)
                size.append((*e.original_size, *e.crop_top_left, *e.target_size))
            latents = torch.stack(lat).to(device, dtype=torch.float32)
        else:
            vae = self.bundle.vae
            pix = loaded_images.pixels_on(device, vae.dtype)  # pinned: non-blocking
            with torch.no_grad():
                latents = latent_cache.encode_pixels(vae, pix).to(torch.float32)
                if self.opts.train_inpainting:  # each sample's mask for this epoch (prepare())
                    masks = loaded_images.inpaint_masks.unsqueeze(1).to(
                        device, non_blocking=loaded_images.inpaint_masks.is_pinned())
                    masked = latent_cache.encode_pixels(vae, inpainting.masked_pixels(pix, masks))
                    inpaint = inpainting.conditioning(masks, masked.to(torch.float32))
            size = [(*p.original_size, *p.crop_top_left, *p.target_size) for p in loaded_images]
        return latents, torch.tensor(size, dtype=torch.float32, device=device), inpaint

    def _masks(self, idx: list[int], loaded_images, epoch: int, latent_hw):
        """Masked loss: (B,1,h,w) masks at the latent size, from the latent cache (stored beside
        each latent variant) or from the loaded images (same resize, crop and flip); ones for an
        image without a mask. None when no image of the run has a mask."""
        if not self.tset.masked:
            return None
        cache = self.caches
        if cache.latents is not None:
            out = [cache.latents[cache.latent_key[latent_slot(self.tset.samples[i],
                                                               self.tset.flip(i, epoch))]].mask
                   for i in idx]
        else:
            out = [None if p.mask is None else images.latent_mask(p.mask, tuple(latent_hw))
                   for p in loaded_images]
        masks = [torch.ones(tuple(latent_hw)) if m is None else m for m in out]
        return torch.stack(masks).unsqueeze(1).to(self.accelerator.device, dtype=torch.float32)

    def _text(self, idx: list[int], epoch: int, step: int | None = None):
        """The text conditioning of this process's samples (called under autocast): from the
        text-encoder cache, or encoded now (with gradients when the text encoders train)."""
        opts = self.opts
        if self.caches.text is not None:  # a partial cache: the trained encoders run now
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.method.train_text_encoder):
                return text_cache.batch(self.caches.text, [self.tset.cached_caption(i, epoch) for i in idx],
                                        self.accelerator.device, self.family_model, self.caches.text_partial)
        captions = [self.tset.caption(i, epoch, step) for i in idx]  # sample-keyed augmentation
        # no_token_padding: unpadded ids (batch 1, checked before loading); validation and the
        # text-encoder cache always pad
        tokens = [t.to(self.accelerator.device)
                  for t in self.family_model.tokenize(captions, pad=not opts.no_token_padding)]
        if self.method.train_text_encoder:
            return self.family_model.encode(tokens, opts.clip_skip)
        with torch.no_grad():
            return self.family_model.encode(tokens, opts.clip_skip)
