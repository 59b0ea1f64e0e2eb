"""The one per-sample loss of a batch, used by training and by validation (library/training/validation.py).

    per_sample(latents, draw, conditioning, size_cond, mask, forward)   (B,) loss of each sample
    training(epoch, idx, loaded_images, n_global)               a micro-step's weighted loss

Training and validation differ only in what they hand to ``per_sample``: training draws noise
and timesteps from each sample's generator (with the noise variants) and weights each sample
(prior_loss_weight for regularization images); validation uses fixed timesteps and plain noise
(library/training/validation.py). The forward itself (noisy latents, the U-Net under autocast in its
input dtype, SDXL's size conditioning, ``Losses.per_sample_loss`` with loss_type, SNR weighting
and masks) is this module's, once.
"""
from __future__ import annotations

from library.data import step_plan
from library.models import inpainting


def latent_slot(item, flipped: bool) -> tuple:
    """What tells two latent-cache entries of a run apart: one image may be in two datasets at
    different sizes, each with its flip."""
    return (item.path, tuple(item.bucket), tuple(item.resized_size), bool(flipped),
            bool(getattr(item, "alpha_mask", False)), getattr(item, "mask_path", None))


class BatchLoss:
    """The loss of a run's batches over its components (library/training/run_state.py Components): reads
    the losses, adapter, placement, bundle, method, accelerator and caches, writes nothing."""

    def __init__(self, opts, tset, c):
        self.opts, self.tset, self.c = opts, tset, c

    def per_sample(self, latents, draw, conditioning, size_cond, mask, forward=None, inpaint=None):
        """(B,) per-sample loss of latents (B,C,h,w) noised by ``draw``; ``conditioning()``
        gives the text conditioning (called under autocast: cached, or encoded now).
        ``forward(fn)`` runs the text encoding and the U-Net (training: the strategy's, so that
        DDP sees the forward); None calls it directly (validation). ``inpaint``: an inpainting
        model's (B,5,h,w) mask and masked-image latents, concatenated after the noisy latents."""
        c = self.c
        noisy = c.losses.noisy_latents(latents, draw)

        def denoise():
            with c.accelerator.autocast():
                cond = conditioning()
                x = inpainting.unet_input(noisy, inpaint)
                return c.adapter.unet_forward(x.to(c.placement.input_dtype(c.placement.unet)),
                                              draw.timesteps, cond,
                                              size_cond if c.bundle.family == "sdxl" else None)

        pred = denoise() if forward is None else forward(denoise)
        return c.losses.per_sample_loss(pred, latents, draw, mask)  # loss_type, SNR weights

    # -- training -------------------------------------------------------------------------------
    def training(self, epoch: int, idx: list[int], loaded_images, n_global: int):
        """Sum over this process's samples of weight * loss, divided by the global batch size."""
        import torch

        opts, c = self.opts, self.c
        latents, size_cond, inpaint = self._latents(idx, loaded_images, epoch)
        # Sample-keyed randomness: every draw for a sample (noise, timestep, noise variants) comes
        # from its own generator, whatever the process count, batch split or resume point.
        d = c.losses.draw(latents, [torch.Generator().manual_seed(
            step_plan.derive_seed("sample", opts.seed, epoch, i)) for i in idx])
        mask = self._masks(idx, loaded_images, epoch, latents.shape[2:])  # masked loss
        per_sample = self.per_sample(latents, d, lambda: self._text(idx, epoch), size_cond, mask,
                                     forward=c.strategy.forward, inpaint=inpaint)
        weights = torch.tensor([opts.prior_loss_weight if self.tset.samples[i].is_reg else 1.0
                                for i in idx], device=c.accelerator.device)
        return (per_sample * weights).sum() / n_global

    def _latents(self, idx: list[int], loaded_images, epoch: int):
        """Latents (B,C,h,w), SDXL size conditioning (B,6) and (train_inpainting) the inpainting
        conditioning (B,5,h,w) for this process's samples; with cached latents the sample's flip
        for this epoch picks the variant."""
        import torch

        from library.data import latent_cache

        c = self.c
        device, cache = c.accelerator.device, c.caches
        lat, size, inpaint = [], [], None
        if cache.latents is not None:  # never with train_inpainting (inpainting.check_options)
            for i in idx:
                slot = latent_slot(self.tset.samples[i], self.tset.flip(i, epoch))
                e = cache.latents[cache.latent_key[slot]]
                lat.append(e.latents)
                size.append((*e.original_size, *e.crop_top_left, *e.target_size))
            latents = torch.stack(lat).to(device, dtype=torch.float32)
        else:
            vae = c.bundle.vae
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
        import torch

        from library.data import images

        if not self.tset.masked:
            return None
        cache = self.c.caches
        if cache.latents is not None:
            out = [cache.latents[cache.latent_key[latent_slot(self.tset.samples[i],
                                                               self.tset.flip(i, epoch))]].mask
                   for i in idx]
        else:
            out = [None if p.mask is None else images.latent_mask(p.mask, tuple(latent_hw))
                   for p in loaded_images]
        masks = [torch.ones(tuple(latent_hw)) if m is None else m for m in out]
        return torch.stack(masks).unsqueeze(1).to(self.c.accelerator.device, dtype=torch.float32)

    def _text(self, idx: list[int], epoch: int):
        """The text conditioning of this process's samples (called under autocast): from the
        text-encoder cache, or encoded now (with gradients when the text encoders train)."""
        import torch

        from library.data import text_cache

        c, opts = self.c, self.opts
        if c.caches.text is not None:
            return text_cache.stack([c.caches.text[self.tset.cached_caption(i, epoch)] for i in idx],
                                    c.accelerator.device)
        captions = [self.tset.caption(i, epoch) for i in idx]  # sample-keyed augmentation
        # no_token_padding: unpadded ids (batch 1, checked before loading); validation and the
        # text-encoder cache always pad
        tokens = [t.to(c.accelerator.device)
                  for t in c.adapter.tokenize(captions, pad=not opts.no_token_padding)]
        if c.method.train_text_encoder:
            return c.adapter.encode(tokens, opts.clip_skip)
        with torch.no_grad():
            return c.adapter.encode(tokens, opts.clip_skip)
