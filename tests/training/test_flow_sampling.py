"""FLUX.1 / SD3 sample images (library/training/flow_sampling.py, sampling.sample_latents):

- the prompt defaults, sizes, the packed FLUX noise and the schedules against hand formulas;
- one Euler step of the sampler against x + (sigma_next - sigma) v, v computed by calling the
  transformer directly (FLUX: packed patches, position ids, dev's guidance input; SD3: 1000 sigma
  and classifier-free guidance with the negative prompt), in float64;
- whole samples against diffusers' own pipelines (FluxPipeline, StableDiffusion3Pipeline) over
  the same weights converted to diffusers' transformers, from the same noise;
- sample images during a training run: files as for SD, identical across runs, the step-0 image
  equal to FluxPipeline's from the prompt text.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

from library.config import parse
from library.models import flow_family
from library.models.families.flux import flux
from library.models.families.sd3 import sd3_checkpoint
from library.models.families import registry
from library.training import flow_matching, flow_sampling, sampling


def _bundle(name):
    o = parse.options_from_values("train_dreambooth", {"pretrained_model_name_or_path": name})
    b = flow_family.load_from_options(o)
    return b, flow_family.family_model_for(b, o)


@pytest.fixture(scope="module")
def flux_parts():
    return _bundle("tiny-flux")


@pytest.fixture(scope="module")
def sd3_parts():
    return _bundle("tiny-sd3")


def _cond(fm, text):
    with torch.no_grad():
        return sampling.prompt_conditioning(fm, torch.device("cpu"), None, text)


def test_prompt_defaults_are_the_familys():
    p = sampling.parse_line("x --w 100 --h 72", "f")
    assert (p["sample_steps"], p["scale"], p["guidance_scale"]) == (None, None, None)
    assert sampling.settings(p, "sd1") == (30, 7.5, None)
    assert sampling.settings(p, "flux") == (20, 1.0, 3.5)  # sd-scripts' flux_train_utils
    assert sampling.settings(p, "sd3") == (30, 7.5, None)  # sd-scripts' sd3_train_utils
    q = sampling.parse_line("x --s 4 --l 2.5 --g 5", "f")
    assert sampling.settings(q, "flux") == (4, 2.5, 5.0)
    assert sampling.settings(q, "sdxl") == (4, 2.5, None)
    # FLUX: multiples of 16 (8x autoencoder, 2x2 patches), SD3: of 8; at least 64 (sd-scripts)
    assert flow_sampling.image_size(p, "flux") == (64, 96)
    assert flow_sampling.image_size(p, "sd3") == (72, 96)
    assert flow_sampling.image_size(sampling.parse_line("x --w 8 --h 40", "f"), "sd3") == (64, 64)


def test_flux_noise_is_drawn_packed_as_sd_scripts_does():
    noise = flow_sampling.initial_noise("flux", 64, 96, 11)
    assert noise.shape == (1, 16, 8, 12) and noise.dtype == torch.float32
    packed = torch.randn((1, 4 * 6, 64), generator=torch.Generator().manual_seed(11))
    # token (r, c) holds feature 4 ch + 2 dy + dx of the latent pixel (ch, 2r + dy, 2c + dx)
    for ch, dy, dx, r, c in [(0, 0, 0, 0, 0), (15, 1, 1, 3, 5), (7, 0, 1, 2, 4), (3, 1, 0, 1, 0)]:
        assert noise[0, ch, 2 * r + dy, 2 * c + dx] == packed[0, r * 6 + c, 4 * ch + 2 * dy + dx]
    sd3 = flow_sampling.initial_noise("sd3", 64, 96, 11)
    assert torch.equal(sd3, torch.randn((1, 16, 8, 12), generator=torch.Generator().manual_seed(11)))


def test_schedules_against_the_float64_formulas():
    # FLUX at 64 x 96 px: 4 x 6 = 24 tokens, mu = 0.5 + 0.65 (24 - 256) / 3840
    mu = 0.5 + 0.65 * (24 - 256) / 3840
    ref = [1.0] + [math.exp(mu) / (math.exp(mu) + 1 / t - 1) for t in (0.75, 0.5, 0.25)] + [0.0]
    assert flow_sampling.schedule("flux", 4, (8, 12)) == pytest.approx(ref, rel=1e-13, abs=1e-15)
    # SD3: 3 levels from 1 to shift(1/1000), shifted again with 3.0, then 0

    def shift(x):
        return 3 * x / (1 + 2 * x)

    lo = shift(0.001)
    ref = [shift(1 + (lo - 1) * k / 2) for k in range(3)] + [0.0]
    assert flow_sampling.schedule("sd3", 3, (8, 8)) == pytest.approx(ref, rel=1e-13, abs=1e-15)


def test_flux_schedule_is_diffusers_flux_schedule():
    from diffusers import FlowMatchEulerDiscreteScheduler

    for steps, hw in ((4, (8, 8)), (20, (128, 128)), (28, (64, 96))):
        s = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096)
        n = flow_matching.flux_image_seq_len(*hw)
        mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (n - 256)  # FluxPipeline's calculate_shift
        s.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        # diffusers works in float32
        torch.testing.assert_close(torch.tensor(flow_sampling.schedule("flux", steps, hw), dtype=torch.float32),
                                   s.sigmas.float(), rtol=2e-6, atol=1e-7)


def _flux_velocity(transformer, x, sigma, cond, guidance):
    """The transformer called directly, as BFL's sampler does, in the latents' dtype."""
    b, _, h, w = x.shape
    dt = x.dtype
    out = transformer(flux.pack_latents(x), flux.image_ids(h // 2, w // 2, b).to(dt), cond.hidden_states.to(dt),
                      torch.zeros(b, cond.hidden_states.shape[1], 3, dtype=dt), torch.full((b,), sigma, dtype=dt),
                      cond.pooled.to(dt), None if guidance is None else torch.full((b,), guidance, dtype=dt))
    return flux.unpack_latents(out, h // 2, w // 2)


def test_one_flux_euler_step_is_x_plus_dsigma_v(flux_parts):
    b, fm = flux_parts
    cond = _cond(fm, "red")
    noise = flow_sampling.initial_noise("flux", 64, 64, 5).double()
    model = b.unet.double()
    try:
        with torch.no_grad():
            for guidance in (3.5, 7.0):
                out = flow_sampling.sample(fm, cond, None, noise, [1.0, 0.6], scale=1.0, guidance=guidance,
                                           dtype=torch.float64)
                v = _flux_velocity(model, noise, 1.0, cond, guidance)
                torch.testing.assert_close(out.double(), (noise + (0.6 - 1.0) * v).float().double(),
                                           rtol=0, atol=1e-6)
            # dev's guidance is an input: another value, another step
            other = flow_sampling.sample(fm, cond, None, noise, [1.0, 0.6], scale=1.0, guidance=1.0,
                                         dtype=torch.float64)
            assert float((other - out).abs().max()) > 1e-3
            assert fm.guidance_scale == 3.5  # the training's value is untouched
    finally:
        b.unet.float()


def test_schnell_has_no_guidance_input():
    b, fm = _bundle("tiny-flux-schnell")
    with torch.no_grad():
        a, c = (sampling.sample_latents(b, fm, sampling.parse_line(f"red --w 64 --h 64 --s 2 --g {g}", "t"), 1,
                                        device=torch.device("cpu")) for g in (1, 6))
    assert torch.equal(a, c)


def test_one_sd3_euler_step_with_cfg(sd3_parts):
    b, fm = sd3_parts
    pos, neg = _cond(fm, "red"), _cond(fm, "blue, dark")
    x = flow_sampling.initial_noise("sd3", 64, 64, 6).double()
    model = b.unet.double()
    try:
        with torch.no_grad():
            out = flow_sampling.sample(fm, pos, neg, x, [0.9, 0.5], scale=4.0, guidance=None, dtype=torch.float64)

            def v(c):
                return model(x, torch.tensor([900.0], dtype=torch.float64), c.pooled.double(),
                             c.hidden_states.double())

            vp, vn = v(pos), v(neg)
            ref = x + (0.5 - 0.9) * (vn + 4.0 * (vp - vn))
            torch.testing.assert_close(out.double(), ref.float().double(), rtol=0, atol=1e-6)
            # scale 1: no negative branch (its conditioning is never read)
            one = flow_sampling.sample(fm, pos, None, x, [0.9, 0.5], scale=1.0, guidance=None, dtype=torch.float64)
            torch.testing.assert_close(one.double(), (x + (0.5 - 0.9) * vp).float().double(), rtol=0, atol=1e-6)
    finally:
        b.unet.float()


# float32 on both sides; the transformers differ in their kernels' summation order (measured
# 6e-7 and 1.7e-6 on latents of magnitude 3.5 after 4 steps); a wrong sign, sigma or guidance is
# off by 0.1 or more
PIPELINE_ATOL = 5e-5


def test_flux_sample_equals_diffusers_flux_pipeline(flux_parts):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from library.models.families.flux import flux_checkpoint

    b, fm = flux_parts
    cfg = {k: v for k, v in flux_checkpoint.diffusers_config(b.unet.config).items() if k != "_class_name"}
    dt = FluxTransformer2DModel(**cfg).eval()
    dt.load_state_dict(flux_checkpoint.bfl_to_diffusers(b.unet.state_dict(), b.unet.config))
    m = b.flow
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=sched, vae=m.ae, text_encoder=m.clip_l, tokenizer=m.clip_tokenizer,
                        text_encoder_2=m.t5, tokenizer_2=m.t5_tokenizer, transformer=dt)
    pipe.set_progress_bar_config(disable=True)
    p = sampling.parse_line("red --w 64 --h 96 --s 4 --g 5 --d 3", "t")
    with torch.no_grad():
        ours = sampling.sample_latents(b, fm, p, 3, device=torch.device("cpu"))
        cond = _cond(fm, "red")
        noise = flow_sampling.initial_noise("flux", 96, 64, 3)
        ref = pipe(prompt_embeds=cond.hidden_states, pooled_prompt_embeds=cond.pooled, height=96, width=64,
                   num_inference_steps=4, guidance_scale=5.0, latents=flux.pack_latents(noise),
                   output_type="latent").images
    ref = flux.unpack_latents(ref, 6, 4)
    assert float((ours - noise).abs().max()) > 0.5  # the sample moved
    torch.testing.assert_close(ours, ref, rtol=0, atol=PIPELINE_ATOL)


def test_sd3_sample_equals_diffusers_sd3_pipeline(sd3_parts):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    b, fm = sd3_parts
    m = b.flow
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0), vae=m.vae,
        text_encoder=m.clip_l, tokenizer=m.tokenizer_l, text_encoder_2=m.clip_g, tokenizer_2=m.tokenizer_g,
        text_encoder_3=None, tokenizer_3=None, transformer=sd3_checkpoint.mmdit_to_diffusers(b.unet).eval())
    pipe.set_progress_bar_config(disable=True)
    p = sampling.parse_line("red --n blue, dark --w 64 --h 64 --s 5 --l 4", "t")
    with torch.no_grad():
        ours = sampling.sample_latents(b, fm, p, 8, device=torch.device("cpu"))
        pos, neg = _cond(fm, "red"), _cond(fm, "blue, dark")
        ref = pipe(prompt_embeds=pos.hidden_states, pooled_prompt_embeds=pos.pooled,
                   negative_prompt_embeds=neg.hidden_states, negative_pooled_prompt_embeds=neg.pooled,
                   height=64, width=64, num_inference_steps=5, guidance_scale=4.0,
                   latents=flow_sampling.initial_noise("sd3", 64, 64, 8), output_type="latent").images
    torch.testing.assert_close(ours, ref, rtol=0, atol=PIPELINE_ATOL)


# -- during training ------------------------------------------------------------------------------

PROMPTS = "red --w 64 --h 64 --s 3 --d 5\na blue thing --n dark --l 2 --w 64 --h 96 --s 2\n"


def _pixels(path):
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def _args(model, data, out, prompts, *extra):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", str(out),
            "--resolution", "64", "--max_train_steps", "2", "--learning_rate", "1e-2", "--cache_latents",
            "--seed", "7", "--sample_prompts", str(prompts), "--sample_every_n_steps", "2",
            "--sample_at_first", *extra]


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-sd3"])
def test_sample_images_during_training(train, dataset, tmp_path, model):
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPTS)
    for name in ("a", "b"):
        rc, out, err, _ = train("train_dreambooth", _args(model, dataset, tmp_path / name, prompts))
        assert rc == 0, err
    files = sorted(os.listdir(tmp_path / "a" / "sample"))
    assert files == ["last_000000_00_5.png", "last_000000_01_8.png", "last_000002_00_5.png",
                     "last_000002_01_8.png"]
    for f in files:
        img = _pixels(tmp_path / "a" / "sample" / f)
        assert img.shape == ((64, 64, 3) if "_00_" in f else (96, 64, 3)) and img.std() > 1
        assert np.array_equal(img, _pixels(tmp_path / "b" / "sample" / f))  # deterministic
    # the samples show the training: the weights moved, the image changed
    before = _pixels(tmp_path / "a" / "sample" / "last_000000_00_5.png").astype(int)
    after = _pixels(tmp_path / "a" / "sample" / "last_000002_00_5.png").astype(int)
    assert np.abs(before - after).max() > 0
    if model != "tiny-flux":
        return
    # the step-0 image is FluxPipeline's from the prompt's text, with the same noise and weights
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from library.models.families.flux import flux_checkpoint

    b, _ = _bundle("tiny-flux")
    cfg = {k: v for k, v in flux_checkpoint.diffusers_config(b.unet.config).items() if k != "_class_name"}
    dt = FluxTransformer2DModel(**cfg).eval()
    dt.load_state_dict(flux_checkpoint.bfl_to_diffusers(b.unet.state_dict(), b.unet.config))
    m = b.flow
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096), vae=m.ae, text_encoder=m.clip_l, tokenizer=m.clip_tokenizer,
        text_encoder_2=m.t5, tokenizer_2=m.t5_tokenizer, transformer=dt)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        ref = pipe(prompt="red", height=64, width=64, num_inference_steps=3, guidance_scale=3.5,
                   latents=flux.pack_latents(flow_sampling.initial_noise("flux", 64, 64, 5)),
                   max_sequence_length=512).images[0]
    # ours truncates 127.5 (x + 1) as sd-scripts does, diffusers rounds: one level apart at most
    diff = np.abs(_pixels(tmp_path / "a" / "sample" / "last_000000_00_5.png").astype(int) - np.asarray(ref, dtype=int))
    assert diff.max() <= 1


def test_flow_prompt_warnings(train, dataset, tmp_path, caplog):
    prompts = tmp_path / "p.txt"
    prompts.write_text("red --w 64 --h 64 --s 1 --g 2 --ss euler_a\n")
    rc, out, err, _ = train("train_dreambooth", _args("tiny-sd3", dataset, tmp_path / "o", prompts,
                                                      "--max_train_steps", "1", "--sample_sampler", "euler"))
    assert rc == 0, err
    text = caplog.text + err
    assert f"option sample_sampler has no effect here ({registry.titles(flow=True)} sample with their" in text
    assert "--g is FLUX.1 dev's guidance input" in text
    assert "--ss euler_a: sd3 samples with its flow-matching Euler sampler" in text
