"""gen_img.py on the tiny FLUX.1 (dev), SD3, Chroma and Lumina 2 models: the image equals diffusers' own
FluxPipeline / StableDiffusion3Pipeline / ChromaPipeline / Lumina2Pipeline (guidance, shift, true CFG,
Lumina's CFG truncation and system prompt, the seed's latents drawn as diffusers draws them) on
weights with the LoRA fused by hand in float64; hooked equals merged; flow-specific bad input.

Both sides decode the final latents with the same VAE and the same pixel formula
(flow_sampling.decode_image), so what is compared is the sampler, the text conditioning, the seed and
the LoRA. Tolerance: ours runs float32 with the LoRA as hooks, the reference a float64 fused weight
cast to float32 (diffusers' own transformer): relative 1e-6 differences, far below half an 8-bit
level, so at most one level on rare pixels (tests/outputs/test_gen_img.py's analysis).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from library.config import parse
from library.models import flow_family
from library.models.families.flux import flux, flux_checkpoint
from library.models.families.sd3 import sd3_checkpoint
from library.models.families.chroma import checkpoint as chroma_checkpoint
from library.models.families.lumina import layout as lumina_layout
from library.training import flow_matching, flow_sampling
from networks import lora_anima, lora_flux, lora_lumina, lora_sd3
from networks.lora import write_weights
from tests.outputs.test_gen_img import _fails, close, pixels, run


def _bundle(name):
    return flow_family.load_from_options(parse.options_from_values("train_lora", {"pretrained_model_name_or_path": name}))


def _lora(module, b, path, seed=0):
    net = module.create_network(1.0, 4, 2, None, b.text_encoders, b.unet)
    net.apply_to(b.text_encoders, b.unet, False, True)  # transformer modules only
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.unet_loras:
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    sd = net.state_dict()
    net.remove_from()
    write_weights(path, sd, torch.float32, {})
    return sd


def _fuse_float64(model, sd, mul):
    """W + mul * up @ down * alpha / rank in float64, for every module the file names (kohya name =
    lora_unet_ + the module's path with '_' for '.')."""
    with torch.no_grad():
        for name, m in model.named_modules():
            key = "lora_unet_" + name.replace(".", "_")
            if key + ".lora_down.weight" not in sd:
                continue
            d, u, a = (sd[f"{key}.{p}"].double() for p in ("lora_down.weight", "lora_up.weight", "alpha"))
            m.weight.copy_((m.weight.double() + mul * (u.flatten(1) @ d.flatten(1)).view(m.weight.shape)
                            * (float(a) / d.shape[0])).float())


def _hooked_merged_plain(tmp_path, base: list, network: list) -> str:
    """gen_img with the network hooked (returned), merged (the same within tolerance) and without
    it (another image: the LoRA shows)."""
    [ours] = run(tmp_path, "hooked", *base, *network)
    [merged] = run(tmp_path, "merged", *base, *network, "--network_merge")
    close(pixels(merged), pixels(ours), "--network_merge vs hooked")
    [plain] = run(tmp_path, "plain", *base)
    assert np.abs(pixels(plain) - pixels(ours)).max() > 10
    return ours


def test_flux_dev_equals_flux_pipeline_with_the_lora_fused(tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    b = _bundle("tiny-flux")
    path = str(tmp_path / "f.safetensors")
    sd = _lora(lora_flux, b, path)
    ours = _hooked_merged_plain(tmp_path, ["--ckpt", "tiny-flux", "--prompt", "red cube --d 7 --w 64 --h 96 --s 4 --g 5"],
                                ["--network_weights", path, "--network_mul", "0.8"])

    _fuse_float64(b.unet, sd, 0.8)
    cfg = {k: v for k, v in flux_checkpoint.diffusers_config(b.unet.config).items() if k != "_class_name"}
    tr = FluxTransformer2DModel(**cfg).eval()
    tr.load_state_dict(flux_checkpoint.bfl_to_diffusers(b.unet.state_dict(), b.unet.config))
    m = b.flow
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5,
                                                                  max_shift=1.15, base_image_seq_len=256,
                                                                  max_image_seq_len=4096),
                        vae=m.ae, text_encoder=m.clip_l, tokenizer=m.clip_tokenizer, text_encoder_2=m.t5,
                        tokenizer_2=m.t5_tokenizer, transformer=tr)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        lat = pipe(prompt="red cube", height=96, width=64, num_inference_steps=4, guidance_scale=5.0,
                   max_sequence_length=m.t5_max_length, generator=torch.Generator("cpu").manual_seed(7),
                   output_type="latent").images
        ref = flow_sampling.decode_image(m.ae, flux.unpack_latents(lat, 6, 4))
    close(pixels(ours), np.asarray(ref).astype(int), "gen_img FLUX vs FluxPipeline + fused LoRA")


def test_sd3_equals_sd3_pipeline_with_shift_cfg_and_the_lora_fused(tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    b = _bundle("tiny-sd3")
    path = str(tmp_path / "s.safetensors")
    sd = _lora(lora_sd3, b, path)
    ours = _hooked_merged_plain(tmp_path, ["--ckpt", "tiny-sd3", "--prompt", "red cube --n blue --d 8 --w 64 --h 64 "
                                           "--s 4 --l 4", "--shift", "2.5"], ["--network_weights", path])

    _fuse_float64(b.unet, sd, 1.0)
    m = b.flow
    t5 = len(b.text_encoders) > 2
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=2.5), vae=m.vae,
        text_encoder=m.clip_l, tokenizer=m.tokenizer_l, text_encoder_2=m.clip_g, tokenizer_2=m.tokenizer_g,
        text_encoder_3=m.t5xxl if t5 else None, tokenizer_3=m.tokenizer_t5 if t5 else None,
        transformer=sd3_checkpoint.mmdit_to_diffusers(b.unet).eval())
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        lat = pipe(prompt="red cube", negative_prompt="blue", height=64, width=64, num_inference_steps=4,
                   guidance_scale=4.0, generator=torch.Generator("cpu").manual_seed(8), output_type="latent").images
    close(pixels(ours), np.asarray(flow_sampling.decode_image(m.vae, lat)).astype(int),
          "gen_img SD3 vs StableDiffusion3Pipeline + fused LoRA")


def test_chroma_equals_chroma_pipeline_with_true_cfg_and_the_lora_fused(tmp_path):
    """Chroma: T5 with its attention mask, FLUX.1's autoencoder, the shifted sequence schedule of
    FLUX.1 (diffusers: dynamic shifting with FLUX.1's constants), true CFG with a negative prompt."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    b = _bundle("tiny-chroma")
    path = str(tmp_path / "c.safetensors")
    sd = _lora(lora_flux, b, path)
    ours = _hooked_merged_plain(tmp_path, ["--ckpt", "tiny-chroma", "--prompt", "red cube --n blue --d 9 --w 64 "
                                           "--h 96 --s 4 --l 4"], ["--network_weights", path, "--network_mul", "0.8"])

    _fuse_float64(b.unet, sd, 0.8)
    m = b.flow
    cfg = {k: v for k, v in chroma_checkpoint.diffusers_config(m.config).items() if k != "_class_name"}
    tr = ChromaTransformer2DModel(**cfg).eval()
    tr.load_state_dict(chroma_checkpoint.to_diffusers(b.unet.state_dict(), m.config))
    pipe = ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5,
                                                                    max_shift=1.15, base_image_seq_len=256,
                                                                    max_image_seq_len=4096),
                          vae=m.ae, text_encoder=m.t5, tokenizer=m.t5_tokenizer, transformer=tr)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        # diffusers makes the prompt masks float 0/1 (encode_prompt's dtype), which SDPA adds as a bias
        # instead of masking (1.0 on real keys, 0.0 on padding: padding keeps e^-1 of its weight); given
        # as booleans they mask, as Chroma was trained (sd-scripts, ComfyUI, ours)
        emb, _, mask, neg, _, neg_mask = pipe.encode_prompt("red cube", "blue", do_classifier_free_guidance=True,
                                                            max_sequence_length=m.t5_max_length)
        lat = pipe(prompt_embeds=emb, prompt_attention_mask=mask.bool(), negative_prompt_embeds=neg,
                   negative_prompt_attention_mask=neg_mask.bool(), height=96, width=64, num_inference_steps=4,
                   guidance_scale=4.0, generator=torch.Generator("cpu").manual_seed(9), output_type="latent").images
        ref = flow_sampling.decode_image(m.ae, flux.unpack_latents(lat, 6, 4))
    close(pixels(ours), np.asarray(ref).astype(int), "gen_img Chroma vs ChromaPipeline + fused LoRA")


def test_lumina_equals_lumina2_pipeline_with_truncated_cfg_system_prompt_and_the_lora_fused(tmp_path):
    """Lumina 2 against diffusers' Lumina2Pipeline, with the pipeline's inputs adjusted where it
    differs from sd-scripts (docs/GENERATION.md): its schedule is given as ``sigmas`` (it spaces them
    linspace(1, 1/N) before the shift; sd-scripts' and ours are the scheduler's own set_timesteps(N)),
    its CFG truncation counts steps ((i + 1) / N <= ratio) where sd-scripts compares Lumina's time
    1 - sigma with the ratio (the ratio given is the share of steps ours guides), and its
    ``cfg_normalization`` (every guided velocity rescaled to the conditional norm along the last axis)
    is not sd-scripts' ``renorm_cfg`` (a cap on the whole sample's norm): off on both sides here,
    renorm_cfg's own formula is tests/training/test_lumina_sampling.py's."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    b = _bundle("tiny-lumina")
    path = str(tmp_path / "l.safetensors")
    sd = _lora(lora_lumina, b, path)
    system = "You are an assistant"
    ours = _hooked_merged_plain(tmp_path, ["--ckpt", "tiny-lumina", "--system_prompt", system, "--prompt",
                                           "red cube --n blue --d 9 --w 64 --h 96 --s 5 --l 4 --rcfg 0"],
                                ["--network_weights", path, "--network_mul", "0.8"])

    steps, shift = 5, 6.0
    sigmas = flow_sampling.schedule("lumina", steps, (12, 8))
    guided = sum(1 - s < 0.25 for s in sigmas[:-1])  # sd-scripts' default cfg_trunc_ratio
    assert 0 < guided < steps
    _fuse_float64(b.unet, sd, 0.8)
    m = b.flow
    cfg = {k: v for k, v in lumina_layout.diffusers_config(m.config).items() if k != "_class_name"}
    tr = Lumina2Transformer2DModel(**cfg).eval()
    tr.load_state_dict(lumina_layout.to_diffusers(b.unet.state_dict(), m.config))
    pipe = Lumina2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=shift), vae=m.ae, text_encoder=m.gemma2,
                           tokenizer=m.tokenizer, transformer=tr)
    pipe.set_progress_bar_config(disable=True)
    lowest = flow_matching.shift_sigmas(1 / flow_matching.NUM_TRAIN_TIMESTEPS, shift)
    unshifted = np.linspace(1.0, float(lowest), steps)  # the scheduler shifts them: our schedule
    with torch.no_grad():
        lat = pipe(prompt="red cube", negative_prompt="blue", system_prompt=system, height=96, width=64,
                   num_inference_steps=steps, sigmas=unshifted, guidance_scale=4.0,
                   cfg_trunc_ratio=guided / steps, cfg_normalization=False,
                   generator=torch.Generator("cpu").manual_seed(9), output_type="latent").images
    assert np.allclose(pipe.scheduler.sigmas.numpy(), sigmas, atol=1e-6)
    close(pixels(ours), np.asarray(flow_sampling.decode_image(m.ae, lat)).astype(int),
          "gen_img Lumina 2 vs Lumina2Pipeline + fused LoRA")


def test_anima_network_merge_equals_hooked(tmp_path):
    """Anima has no diffusers pipeline: its gen_img image equals the in-run sample
    (tests/outputs/test_gen_img.py), and merged equals hooked here."""
    path = str(tmp_path / "a.safetensors")
    _lora(lora_anima, _bundle("tiny-anima"), path)
    _hooked_merged_plain(tmp_path, ["--ckpt", "tiny-anima", "--prompt", "red cube --n blue --d 5 --w 64 --h 64 --s 4"],
                         ["--network_weights", path, "--network_mul", "0.8"])


def test_flow_bad_input(capsys, tmp_path):
    flux_args = ["--ckpt", "tiny-flux", "--steps", "1"]
    assert "--W/--H: width 72 is not a multiple of 16" in _fails(capsys, tmp_path, *flux_args, "--prompt", "x",
                                                                 "--W", "72", "--H", "64")
    assert "--shift is SD3's" in _fails(capsys, tmp_path, *flux_args, "--prompt", "x", "--W", "64", "--H", "64",
                                        "--shift", "2")
    assert "--highres_fix_scale: SD1/SD2/SDXL" in _fails(capsys, tmp_path, *flux_args, "--prompt", "x",
                                                         "--highres_fix_scale", "0.5")
