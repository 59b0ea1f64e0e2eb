"""SD3's 16-channel autoencoder: diffusers' AutoencoderKL without quant convs, latents
(z - shift_factor) * scaling_factor. In SAI files it is under `first_stage_model.` in the original
(LDM) layout, as a separate `ae`/`vae` file without the prefix; the conversion both ways is the
repository's SD one (library/models/sd_checkpoint.py)."""
from __future__ import annotations

import json
import os
import re
import tempfile

from library.models import sd_checkpoint
from library.models.families.sd3.sd3 import SD3ModelError

SCALING_FACTOR = 1.5305
SHIFT_FACTOR = 0.0609
PREFIX = sd_checkpoint.VAE_PREFIX  # first_stage_model.


def vae_config(block_out_channels=(128, 256, 512, 512), layers_per_block: int = 2, latent_channels: int = 16,
               norm_num_groups: int = 32) -> dict:
    """The diffusers config of an SD3 VAE; the defaults are SD3's own."""
    n = len(block_out_channels)
    return {"_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3,
            "down_block_types": ["DownEncoderBlock2D"] * n, "up_block_types": ["UpDecoderBlock2D"] * n,
            "block_out_channels": list(block_out_channels), "layers_per_block": layers_per_block,
            "latent_channels": latent_channels, "norm_num_groups": norm_num_groups, "act_fn": "silu",
            "sample_size": 1024, "scaling_factor": SCALING_FACTOR, "shift_factor": SHIFT_FACTOR,
            "use_quant_conv": False, "use_post_quant_conv": False, "force_upcast": True}


def strip_prefix(state_dict: dict) -> dict:
    """The VAE's keys without `first_stage_model.` (other components dropped when it is present)."""
    if any(k.startswith(PREFIX) for k in state_dict):
        return {k[len(PREFIX):]: v for k, v in state_dict.items() if k.startswith(PREFIX)}
    return dict(state_dict)


def config_from_state_dict(state_dict: dict, source: str = "checkpoint") -> dict:
    """The config of LDM-layout VAE weights (prefix optional), from their shapes: the width of each
    encoder level, the blocks per level and the latent channels (GroupNorm groups: 32)."""
    sd = strip_prefix(state_dict)
    if "encoder.conv_out.weight" not in sd:
        raise SD3ModelError(f"{source}: no VAE weights in the original layout (no {PREFIX}encoder.conv_out.weight)")
    levels = sorted({int(m.group(1)) for k in sd if (m := re.match(r"encoder\.down\.(\d+)\.", k))})
    widths = [sd[f"encoder.down.{i}.block.0.conv2.weight"].shape[0] for i in levels]
    blocks = len({m.group(1) for k in sd if (m := re.match(r"encoder\.down\.0\.block\.(\d+)\.", k))})
    return vae_config(widths, blocks, sd["encoder.conv_out.weight"].shape[0] // 2)


def load_vae(state_dict: dict, source: str = "checkpoint", config: dict | None = None):
    """An AutoencoderKL from LDM-layout weights (with or without `first_stage_model.`) or from
    diffusers-layout ones; ``config`` defaults to the one the shapes say."""
    sd = strip_prefix(state_dict)
    if config is None:
        # diffusers-layout weights carry no level structure in their names to read: SD3's own VAE
        diffusers_layout = any(k.startswith("encoder.down_blocks.") for k in sd)
        config = vae_config() if diffusers_layout else config_from_state_dict(sd, source)
    with tempfile.TemporaryDirectory(prefix="sdtk-sd3-vae-") as tmp:
        os.makedirs(os.path.join(tmp, "vae"))
        with open(os.path.join(tmp, "vae", "config.json"), "w") as f:
            json.dump(config, f)
        return sd_checkpoint.load_vae_from_state_dict(sd, tmp, source)


def to_original(vae, prefix: str = PREFIX) -> dict:
    """The VAE's weights in the LDM layout under ``prefix`` ('' for a separate ae file)."""
    sd = sd_checkpoint.vae_to_original(vae.state_dict(), dict(vae.config))
    return {prefix + k[len(PREFIX):]: v for k, v in sd.items()}


def latents_of(posterior_sample, config) -> object:
    """VAE output -> the latents the MMDiT sees: (z - shift) * scale."""
    return (posterior_sample - config["shift_factor"]) * config["scaling_factor"]


def decode_input(latents, config) -> object:
    """The inverse of latents_of: what the VAE decoder takes."""
    return latents / config["scaling_factor"] + config["shift_factor"]
