"""The 16-channel autoencoder of FLUX.1 (``ae.safetensors``): diffusers' ``AutoencoderKL`` with 16
latent channels and no quant convs.

``ae.safetensors`` holds the LDM VAE key layout without a prefix (``encoder.down.0.block.0...``,
no ``quant_conv``); it is converted with diffusers' own single-file code (through
sd_checkpoint.load_vae_from_state_dict) and written back with the repo's diffusers -> LDM VAE
mapping (sd_checkpoint.vae_to_original, prefix dropped).

Latents for training are ``(mean - shift_factor) * scaling_factor`` of the posterior (0.1159 and
0.3611 for FLUX.1), as sd-scripts' FLUX AutoEncoder.encode without sampling.
"""
from __future__ import annotations

import json
import os
import tempfile

import torch
from diffusers import AutoencoderKL

from library.errors import ModelError, first_line
from library.models import embedded_config, fp8_storage, sd_checkpoint

SCALING_FACTOR = 0.3611
SHIFT_FACTOR = 0.1159
META_CONFIG_KEY = "sdtk.ae_config"

_COMMON = dict(in_channels=3, out_channels=3, latent_channels=16, down_block_types=["DownEncoderBlock2D"] * 4,
               up_block_types=["UpDecoderBlock2D"] * 4, act_fn="silu", norm_num_groups=32,
               scaling_factor=SCALING_FACTOR, shift_factor=SHIFT_FACTOR, use_quant_conv=False,
               use_post_quant_conv=False, mid_block_add_attention=True)
FLUX_AE_CONFIG = dict(_COMMON, block_out_channels=[128, 256, 512, 512], layers_per_block=2, sample_size=1024)
TINY_AE_CONFIG = dict(_COMMON, block_out_channels=[32, 32, 64, 64], layers_per_block=1, sample_size=64)


def build_ae(config: dict, seed: int | None = None):
    if seed is None:
        return AutoencoderKL(**config).eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKL(**config).eval()


def load_ae(path: str, dtype: torch.dtype = torch.float32):
    """The autoencoder from an ``ae`` file (LDM layout without prefix, or diffusers layout) or a
    diffusers folder (with or without ``vae/``); files without this toolkit's config metadata are
    FLUX.1's architecture."""
    if os.path.isdir(path):
        sub = "vae" if os.path.isfile(os.path.join(path, "vae", "config.json")) else None
        try:
            return AutoencoderKL.from_pretrained(path, subfolder=sub, local_files_only=True, torch_dtype=dtype).eval()
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelError(f"ae: cannot load {path}: {first_line(e)}") from None
    sd, meta = sd_checkpoint.read_state_dict(path)
    sd = fp8_storage.load_dtype(sd, dtype, path)
    config = embedded_config.read_record(meta, META_CONFIG_KEY, path) or FLUX_AE_CONFIG
    with tempfile.TemporaryDirectory(prefix="sdtk-ae-") as tmp:
        os.makedirs(os.path.join(tmp, "vae"))
        with open(os.path.join(tmp, "vae", "config.json"), "w") as f:
            json.dump(dict(config, _class_name="AutoencoderKL"), f)
        vae = sd_checkpoint.load_vae_from_state_dict(sd, tmp, path)
    # nn.Module.to directly: diffusers' override only adds a warning about fp32-kept modules (none here)
    return torch.nn.Module.to(vae, dtype).eval()


def ae_state_dict(vae) -> dict:
    """The autoencoder's tensors in ``ae.safetensors``' layout (LDM names, no prefix)."""
    sd = sd_checkpoint.vae_to_original(vae.state_dict(), dict(vae.config))
    prefix = sd_checkpoint.VAE_PREFIX
    return {k[len(prefix):]: v for k, v in sd.items()}


def ae_file_metadata(vae) -> dict[str, str]:
    cfg = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    return {META_CONFIG_KEY: json.dumps(cfg, default=list)}


def encode_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Training latents of images in [-1, 1]: (posterior mean - shift) * scale."""
    mean = vae.encode(pixels.to(vae.dtype)).latent_dist.mean
    return (mean - vae.config.shift_factor) * vae.config.scaling_factor


def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] from training latents (the inverse scaling, then the decoder)."""
    z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
    return vae.decode(z).sample
