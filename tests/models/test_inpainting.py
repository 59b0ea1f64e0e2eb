"""Inpainting models (9-channel U-Net input): recognised from the weights as diffusers does, loaded
from every source, and their random masks keyed to the sample.

The reference for "is this an inpainting checkpoint" is diffusers' own
``infer_diffusers_model_type`` (the width of ``model.diffusion_model.input_blocks.0.0.weight``),
and for "does the loaded model fit an inpainting pipeline" diffusers' StableDiffusionInpaintPipeline,
which checks that the U-Net takes latents + mask + masked-image latents.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from library.models import inpainting
from library.models import loading
from library.models import sd_checkpoint


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    out = {}
    for arch, inpaint in (("sd15", True), ("sd2", True), ("sd15", False)):
        folder, single = make_tiny_model(arch, str(tmp_path_factory.mktemp(arch)), inpaint=inpaint)
        out[(arch, inpaint)] = folder, single
    return out


@pytest.mark.parametrize("arch,inpaint", [("sd15", True), ("sd2", True), ("sd15", False)])
def test_single_file_and_folder_detected_as_diffusers_does(written, arch, inpaint):
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type
    from safetensors.torch import load_file

    folder, single = written[(arch, inpaint)]
    sd = load_file(single)
    kind = infer_diffusers_model_type(sd)  # "inpainting" / "v1": diffusers' verdict
    assert (kind.startswith("inpainting") or kind == "xl_inpaint") == inpaint
    assert (inpainting.in_channels_of_state_dict(sd) == 9) == inpaint
    family = {"sd15": "sd1", "sd2": "sd2"}[arch]
    assert sd_checkpoint.detect_family(sd) == family
    for source in (single, folder):
        b = loading.load_model_bundle(source)
        assert b.family == family and inpainting.is_inpainting(b.unet) == inpaint
    with open(os.path.join(folder, "unet", "config.json")) as f:
        assert json.load(f)["in_channels"] == (9 if inpaint else 4)


def test_loaded_inpainting_model_runs_in_diffusers_inpainting_pipeline(written):
    from diffusers import StableDiffusionInpaintPipeline
    from PIL import Image

    b = loading.load_model_bundle(written[("sd15", True)][1])
    pipe = StableDiffusionInpaintPipeline(vae=b.vae, text_encoder=b.text_encoders[0],
                                          tokenizer=b.tokenizers[0], unet=b.unet,
                                          scheduler=b.noise_scheduler, safety_checker=None,
                                          feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    img = Image.new("RGB", (64, 64), (120, 30, 200))
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    out = pipe("a photo", image=img, mask_image=mask, height=64, width=64, num_inference_steps=1,
               output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (1, 3, 64, 64) and torch.isfinite(out).all()


def test_a_real_inpainting_checkpoint_gets_the_shipped_configs_with_9_channels(tmp_path):
    """A checkpoint without this toolkit's config metadata (sd-v1-5-inpainting, SDXL inpainting):
    the shipped architecture with the U-Net's input widened to what the weights hold."""
    shipped = os.path.join(loading.SHIPPED_CONFIGS, "sd15")
    with open(os.path.join(shipped, "unet", "config.json")) as f:
        base = json.load(f)
    for channels, expect_copy in ((9, True), (4, False)):
        sd = {inpainting.CONV_IN_KEY: torch.zeros(320, channels, 3, 3)}
        d = loading._shipped_config_for(sd, "sd1", str(tmp_path / str(channels)))
        assert (d != shipped) == expect_copy
        with open(os.path.join(d, "unet", "config.json")) as f:
            cfg = json.load(f)
        assert cfg == dict(base, in_channels=channels)
        assert sorted(os.listdir(d)) == sorted(os.listdir(shipped))


def test_masks_are_keyed_to_seed_epoch_and_sample():
    from library.data import inpaint_masks
    from library.data.step_plan import derive_seed

    def mask(seed, epoch, i, w=48, h=32):
        return inpaint_masks.random_mask(w, h, random.Random(derive_seed("inpaint-mask", seed, epoch, i)))

    a = mask(1, 1, 3)
    assert a.shape == (32, 48) and a.dtype == torch.float32
    assert torch.equal(a, mask(1, 1, 3))  # any process, any batch split: the same mask
    assert not torch.equal(a, mask(1, 2, 3)) and not torch.equal(a, mask(1, 1, 4))
    covered = [float(mask(0, 1, i, 24, 16).mean()) for i in range(300)]
    # never empty (a polygon outside the image is drawn again), never the whole image
    assert all(0 < c < 1 for c in covered)
    assert 0.1 < sum(covered) / len(covered) < 0.4  # sd-scripts' coverages: 10-30 % clouds, ...
    assert all(set(mask(0, 1, i).unique().tolist()) <= {0.0, 1.0} for i in range(5))


def test_widen_conv_in_keeps_the_model_and_zeroes_the_new_channels():
    from library.models.families.sd_common.tiny_models import build_tiny_components

    unet = build_tiny_components("sd15")["unet"]
    old = unet.conv_in.weight.detach().clone()
    inpainting.widen_conv_in(unet)
    assert inpainting.is_inpainting(unet) and unet.conv_in.weight.shape[1] == 9
    assert torch.equal(unet.conv_in.weight[:, :4], old)
    assert not unet.conv_in.weight[:, 4:].any()
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    extra = torch.randn(1, 5, 8, 8, generator=torch.Generator().manual_seed(1))
    ctx = torch.randn(1, 77, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # zero weights on the new channels: their content changes nothing
        a = unet(torch.cat([x, extra], 1), 10, ctx).sample
        b = unet(torch.cat([x, torch.zeros_like(extra)], 1), 10, ctx).sample
    torch.testing.assert_close(a, b, rtol=0, atol=0)
