"""SD3's 16-channel VAE (library/models/families/sd3/sd3_vae.py): the config read from LDM-layout weights, the
LDM <-> diffusers conversion (the repository's SD one) and the latent scaling."""
from __future__ import annotations

import pytest
import torch

from library.models.families.sd3 import sd3, sd3_builtins, sd3_vae


def test_real_sd3_vae_config_read_back_from_its_ldm_keys():
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        vae = AutoencoderKL.from_config(sd3_vae.vae_config())
    sd = sd3_vae.to_original(vae)
    # SAI's key names and SD3's widths
    assert sd["first_stage_model.encoder.conv_out.weight"].shape == (32, 512, 3, 3)  # 2 x 16 latent channels
    assert "first_stage_model.decoder.up.3.block.0.conv1.weight" in sd
    assert not any("quant_conv" in k for k in sd)
    assert sd3_vae.config_from_state_dict(sd) == sd3_vae.vae_config()


def test_tiny_vae_round_trip_and_scaling():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL.from_config(sd3_builtins.vae_config()).eval()
    for prefix in (sd3_vae.PREFIX, ""):
        back = sd3_vae.load_vae(sd3_vae.to_original(vae, prefix=prefix), "ae.safetensors")
        assert all(torch.equal(v, back.state_dict()[k]) for k, v in vae.state_dict().items())
        assert back.config.latent_channels == 16 and back.config.scaling_factor == 1.5305
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
    lat = sd3_vae.latents_of(z, vae.config)
    assert lat.shape == (1, 16, 4, 4)
    assert torch.allclose(lat.double(), (z.double() - 0.0609) * 1.5305, atol=1e-5)  # float64 formula
    assert torch.allclose(sd3_vae.decode_input(lat, vae.config), z, atol=1e-6)


def test_not_a_vae_is_one_line_error():
    with pytest.raises(sd3.SD3ModelError, match="no VAE weights"):
        sd3_vae.load_vae({"model.diffusion_model.pos_embed": torch.zeros(1)}, "x.safetensors")
