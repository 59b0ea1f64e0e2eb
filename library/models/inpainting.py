"""Inpainting models: a U-Net whose input has 9 channels (sd-scripts' ``train_inpainting``).

    channels 0-3  the noisy latents (as any model)
    channel  4    the mask at the latent size (1 = the region to regenerate), downsampled from the
                  pixel mask by nearest-neighbour interpolation (diffusers' inpainting pipelines
                  and sd-scripts: ``F.interpolate(mask, size=latent_hw)``)
    channels 5-8  the VAE latents of the masked image, ``pixels * (1 - mask)`` in [-1, 1] (the
                  masked region is 0, mid grey)

The model is recognised from its weights: a checkpoint whose first U-Net convolution
(``model.diffusion_model.input_blocks.0.0.weight``; diffusers: ``conv_in``) takes 9 channels, as
diffusers' ``infer_diffusers_model_type`` tells "inpainting" / "inpainting_v2" / "xl_inpaint"
models apart. The rest of the model (text encoders, VAE, LoRA targets, key layouts) is its
family's, so a LoRA trained on an inpainting model is an ordinary LoRA file that the clients load
onto that inpainting model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from library.config import method_kinds
from library.errors import UserError

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

LATENT_CHANNELS = 4
IN_CHANNELS = 9  # noisy latents + mask + masked-image latents
CONV_IN_KEY = "model.diffusion_model.input_blocks.0.0.weight"  # original layout


class InpaintingError(UserError, ValueError):
    """An inpainting option that cannot apply; one line naming the option."""


def in_channels_of_state_dict(state_dict: dict) -> int | None:
    """The U-Net's input channels from an original-layout state dict (None: no U-Net in it)."""
    w = state_dict.get(CONV_IN_KEY)
    return None if w is None else int(w.shape[1])


def is_inpainting(unet) -> bool:
    return int(unet.config.in_channels) == IN_CHANNELS


def check_options(opts: Options) -> None:
    """Before any weight loads: what cannot be combined with train_inpainting. (The validation
    loss takes each held-out image's mask, library/training/validation.py; sample images a
    prompt's --i image and a random mask, library/training/sampling.py.)"""
    if not opts.train_inpainting:
        return
    for name in ("cache_latents", "cache_latents_to_disk"):
        if getattr(opts, name):
            raise InpaintingError(
                f"train_inpainting cannot be combined with {name}: each sample's random mask is "
                "drawn anew every epoch, so the masked image's latents are encoded every step "
                "(as sd-scripts, which refuses the same); turn one of them off")


def prepare_unet(unet, opts: Options, method_name: str, log) -> None:
    """After loading: the model and train_inpainting must agree. A 9-channel model needs
    train_inpainting; train_inpainting on a 4-channel model widens its first convolution to 9
    input channels (the new 5 zero, so the model starts as it was: sd-scripts'
    ``expand_unet_to_inpainting``) when the U-Net itself trains (DreamBooth, fine-tune), and is
    refused for a LoRA or an embedding, whose file would need that widened base."""
    channels = int(unet.config.in_channels)
    if channels not in (LATENT_CHANNELS, IN_CHANNELS):
        raise InpaintingError(f"pretrained_model_name_or_path: the U-Net takes {channels} input "
                              f"channels; expected {LATENT_CHANNELS} or {IN_CHANNELS} (inpainting)")
    if channels == IN_CHANNELS and not opts.train_inpainting:
        raise InpaintingError(
            f"{opts.pretrained_model_name_or_path} is an inpainting model (its U-Net takes 9 input "
            "channels: latents, mask, masked image): set train_inpainting = true")
    if channels == LATENT_CHANNELS and opts.train_inpainting:
        if not method_kinds.get(method_name).trains_model:  # an adapter or embedding
            raise InpaintingError(
                f"train_inpainting: {opts.pretrained_model_name_or_path} is not an inpainting model "
                "(its U-Net takes 4 input channels); a LoRA or embedding trains on an inpainting "
                "base (e.g. sd-v1-5-inpainting): use one, or train the base itself with "
                "train_dreambooth / finetune")
        widen_conv_in(unet)
        log.info("train_inpainting: the U-Net's first convolution widened from 4 to 9 input "
                 "channels (the mask and masked-image channels start at zero)")


def widen_conv_in(unet) -> None:
    """4 -> 9 input channels: the first 4 weights kept, the 5 new ones zero, the bias kept."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when
    # widen_conv_in() runs
    import torch

    old = unet.conv_in
    new = torch.nn.Conv2d(IN_CHANNELS, old.out_channels, kernel_size=old.kernel_size,
                          stride=old.stride, padding=old.padding, bias=old.bias is not None,
                          device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.zero_()
        new.weight[:, :LATENT_CHANNELS] = old.weight
        if old.bias is not None:
            new.bias.copy_(old.bias)
    unet.conv_in = new
    unet.register_to_config(in_channels=IN_CHANNELS)


def masked_pixels(pixels, masks):
    """(B,3,H,W) pixels in [-1, 1] and (B,1,H,W) masks in {0, 1} -> the masked images."""
    return pixels * (1 - masks.to(pixels.dtype))


def latent_masks(masks, latent_hw):
    """(B,1,H,W) pixel masks -> (B,1,h,w) at the latent size, nearest-neighbour as diffusers."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when latent_masks()
    # runs
    import torch

    return torch.nn.functional.interpolate(masks.float(), size=tuple(latent_hw))


def conditioning(masks, masked_latents):
    """The 5 channels concatenated after the noisy latents: mask (B,1,h,w), masked latents."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when conditioning()
    # runs
    import torch

    return torch.cat([latent_masks(masks, masked_latents.shape[2:]).to(masked_latents.dtype),
                      masked_latents], dim=1)


def unet_input(noisy, cond):
    """The 9-channel U-Net input: noisy latents, then the inpainting conditioning (None: as is)."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when unet_input()
    # runs
    import torch

    if cond is None:
        return noisy
    return torch.cat([noisy, cond.to(noisy.dtype)], dim=1)
