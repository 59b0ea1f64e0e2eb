"""gen_img.py's flags beyond the core (sd-scripts' gen_img argparse): every flag sd-scripts has is
implemented here or refused by name in one line; --shuffle_prompts, --interactive, img2img
(--image_path, --strength, --use_original_file_name), --vae_batch_size, --network_show_meta,
--sdxl / --v1, the aliases.

References: sd-scripts' flag list (gen_img.py ``setup_parser``, restated below); diffusers'
StableDiffusionImg2ImgPipeline on the same tiny weights (tolerance as tests/outputs/test_gen_img.py:
at most one 8-bit level on rare pixels); the VAE's own decode calls, counted."""
from __future__ import annotations

import io
import logging
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import gen_img
from library.models.families.sd_common.tiny_models import build_tiny_components
from library.outputs import gen_options
from tests.conftest import diffusers_pipeline
from tests.outputs.test_gen_img import close, model_scheduler, pixels, write_lora

# sd-scripts gen_img.py's flags (setup_parser and add_logging_arguments)
SD_SCRIPTS_FLAGS = """sdxl v1 v2 v_parameterization prompt from_file from_module prompter_module_args interactive
no_preview image_path mask_path strength images_per_prompt outdir sequential_file_name use_original_file_name
n_iter H W original_height original_width original_height_negative original_width_negative crop_top crop_left
batch_size vae_batch_size vae_slices no_half_vae steps sampler scale ckpt vae tokenizer_cache_dir seed
iter_same_seed shuffle_prompts fp16 bf16 xformers sdpa diffusers_xformers opt_channels_last network_module
network_weights network_mul network_args network_show_meta network_merge_n_models network_merge network_pre_calc
network_regional_mask_max_color_codes textual_inversion_embeddings clip_skip max_embeddings_multiples
emb_normalize_mode guide_image_path highres_fix_scale highres_fix_steps highres_fix_strength highres_fix_save_1st
highres_fix_latents_upscaling highres_fix_upscaler highres_fix_upscaler_args highres_fix_disable_control_net
negative_scale control_net_lllite_models control_net_models control_net_preps control_net_multipliers
control_net_ratios clip_vision_strength ds_depth_1 ds_timesteps_1 ds_depth_2 ds_timesteps_2 ds_ratio
gradual_latent_timesteps gradual_latent_ratio gradual_latent_ratio_step gradual_latent_every_n_steps
gradual_latent_s_noise gradual_latent_unsharp_params full_fp16 full_bf16 console_log_level console_log_file
console_log_simple""".split()
DEFAULTS = {"size": 64, "steps": 2, "scale": 7.5, "guidance": None, "grid": 8, "flow": False}


def _run(tmp_path, name, *args) -> list[str]:
    out = tmp_path / name
    assert gen_img.main(["--outdir", str(out), *map(str, args)]) == 0
    return sorted(str(out / f) for f in os.listdir(out))


def test_every_sd_scripts_flag_is_taken_or_refused_by_name(capsys, tmp_path):
    ours = {a.dest for a in gen_options.build_parser()._actions} | {
        o.lstrip("-") for a in gen_options.build_parser()._actions for o in a.option_strings}
    assert set(SD_SCRIPTS_FLAGS) <= ours, set(SD_SCRIPTS_FLAGS) - ours
    for flag in gen_options.REFUSED:
        with pytest.raises(gen_options.GenError) as e:
            gen_options.parse_args(["--ckpt", "m", "--outdir", str(tmp_path), "--prompt", "x", f"--{flag}", "1"])
        assert str(e.value).startswith(f"--{flag}: ") and "\n" not in str(e.value)
    # a store-true one without a value, through the script: one line, exit 2
    assert gen_img.main(["--ckpt", "m", "--outdir", str(tmp_path), "--prompt", "x", "--highres_fix_save_1st"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --highres_fix_save_1st: not implemented") and err.count("\n") == 1
    a = gen_options.parse_args(["--ckpt", "m", "--outdir", str(tmp_path), "--prompt", "x",
                                "--diffusers_xformers", "--full_bf16"])
    assert a.xformers and a.bf16 and not a.fp16


@pytest.mark.parametrize("argv, message", [
    (["--interactive", "--prompt", "x"], "--interactive reads the prompts from standard input"),
    (["--v1", "--sdxl", "--prompt", "x"], "--v1 with --v2 / --sdxl"),
    (["--vae_batch_size", "0", "--prompt", "x"], "--vae_batch_size must be above 0, got 0"),
    (["--use_original_file_name", "--prompt", "x"], "--use_original_file_name names the files after --image_path"),
    (["--image_path", "nowhere", "--prompt", "x"], "--image_path nowhere: no such file or folder"),
])
def test_bad_combinations_are_one_line(tmp_path, argv, message):
    with pytest.raises(gen_options.GenError, match=message):
        gen_options.parse_args(["--ckpt", "m", "--outdir", str(tmp_path), *argv])


def test_shuffle_prompts_shuffles_each_iteration_and_keeps_the_seeds(tmp_path):
    prompts = [(p, f"f:{i}") for i, p in enumerate(["a", "b", "c", "d"], 1)]
    base = ["--ckpt", "m", "--outdir", str(tmp_path), "--prompt", "x", "--n_iter", "5", "--seed", "9"]
    plain = gen_options.plan_jobs(gen_options.parse_args(base), prompts, DEFAULTS)
    shuffled = gen_options.plan_jobs(gen_options.parse_args(base + ["--shuffle_prompts"]), prompts, DEFAULTS)
    orders = [[j.prompt for j in shuffled[i:i + 4]] for i in range(0, 20, 4)]
    assert all(sorted(o) == ["a", "b", "c", "d"] for o in orders)  # each iteration: every prompt once
    assert any(o != ["a", "b", "c", "d"] for o in orders) and len({tuple(o) for o in orders}) > 1
    assert [j.seed for j in shuffled] == [j.seed for j in plain]  # the k-th image's seed is unchanged
    again = gen_options.plan_jobs(gen_options.parse_args(base + ["--shuffle_prompts"]), prompts, DEFAULTS)
    assert [j.prompt for j in again] == [j.prompt for j in shuffled]  # --seed fixes the order


def test_interactive_renders_each_line_of_stdin(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "stdin", io.StringIO(
        "red cube --d 5 --w 64 --h 64 --s 2\nbad --w 13 --h 64\n\n# a comment\nblue --d 6 --w 64 --h 64 --s 2\n"))
    files = _run(tmp_path, "i", "--ckpt", "tiny-sd15", "--interactive", "--no_preview", "--sequential_file_name")
    assert [os.path.basename(f) for f in files] == ["im_000001.png", "im_000002.png"]
    assert "error: stdin:2: width 13 is not a multiple of 8" in capsys.readouterr().err
    texts = [Image.open(f).text["parameters"] for f in files]
    assert texts[0].startswith("red cube\n") and "Seed: 5" in texts[0]
    assert texts[1].startswith("blue\n") and "Seed: 6" in texts[1]
    [ref] = _run(tmp_path, "p", "--ckpt", "tiny-sd15", "--prompt", "red cube --d 5 --w 64 --h 64 --s 2")
    assert np.array_equal(pixels(ref), pixels(files[0]))


def test_img2img_equals_diffusers_img2img_pipeline(tmp_path):
    import diffusers

    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        Image.fromarray(rng.integers(0, 255, (48, 80, 3), dtype=np.uint8)).save(src / f"{name}.png")
    files = _run(tmp_path, "i2i", "--ckpt", "tiny-sd15", "--prompt", "red cube", "--image_path", src,
                 "--strength", "0.6", "--images_per_prompt", "2", "--seed", "4", "--steps", "4",
                 "--sampler", "euler", "--W", "64", "--H", "64", "--use_original_file_name")
    names = [os.path.basename(f) for f in files]
    assert names[0].startswith("a-im_") and names[1].startswith("b-im_")  # the sources in turn
    text = Image.open(files[0]).text["parameters"]
    assert "Denoising strength: 0.6" in text
    seed = int(text.split("Seed: ")[1].split(",")[0])
    c = build_tiny_components("sd15")
    pipe = diffusers_pipeline("sd15", c)
    i2i = diffusers.StableDiffusionImg2ImgPipeline(**pipe.components)
    i2i.set_progress_bar_config(disable=True)
    i2i.scheduler = model_scheduler("EulerDiscreteScheduler", c)
    image = Image.open(src / "a.png").convert("RGB").resize((64, 64), Image.LANCZOS)
    with torch.no_grad():
        ref = i2i(prompt="red cube", image=image, strength=0.6, num_inference_steps=4,
                  generator=torch.Generator("cpu").manual_seed(seed), output_type="np").images[0]
    close(pixels(files[0]), np.round(ref * 255).astype(int), "img2img vs diffusers' img2img pipeline")
    with pytest.raises(gen_options.GenError, match="--image_path: SD1/SD2/SDXL"):
        gen_img_args = gen_options.parse_args(["--ckpt", "tiny-flux", "--outdir", str(tmp_path / "f"),
                                               "--prompt", "x", "--image_path", str(src)])
        from library.outputs import generation

        generation.Generator(gen_img_args)


def test_vae_batch_size_decodes_in_smaller_batches(monkeypatch, caplog, tmp_path):
    import diffusers

    lora = write_lora("sd15", str(tmp_path / "l.safetensors"))
    common = ["--ckpt", "tiny-sd15", "--prompt", "red cube", "--images_per_prompt", "3", "--batch_size", "3",
              "--seed", "2", "--steps", "2", "--W", "64", "--H", "64", "--sequential_file_name",
              "--network_weights", lora, "--network_show_meta"]
    seen, real = [], diffusers.AutoencoderKL.decode

    def decode(self, z, *a, **kw):
        seen.append(z.shape[0])
        return real(self, z, *a, **kw)

    monkeypatch.setattr(diffusers.AutoencoderKL, "decode", decode)
    with caplog.at_level(logging.INFO, logger="sdtk"):
        whole = _run(tmp_path, "whole", *common)
    assert seen == [3] and f"metadata of {lora}" in caplog.text and "sshs_model_hash" in caplog.text
    seen.clear()
    parts = _run(tmp_path, "parts", *common, "--vae_batch_size", "0.5")  # max(1, int(3 x 0.5)) = 1
    assert seen == [1, 1, 1]
    seen.clear()
    two = _run(tmp_path, "two", *common, "--vae_batch_size", "2")
    assert seen == [2, 1]
    for a, b, c in zip(whole, parts, two):
        close(pixels(b), pixels(a), "--vae_batch_size 0.5 vs one decode")
        close(pixels(c), pixels(a), "--vae_batch_size 2 vs one decode")


def test_sdxl_and_v1_are_checked_against_the_weights(capsys, tmp_path):
    for argv, message in ((["--ckpt", "tiny-sd15", "--sdxl"], "error: --sdxl: this model is SD1"),
                          (["--ckpt", "tiny-sdxl", "--v1"], "error: --v1: this model is SDXL")):
        assert gen_img.main(["--outdir", str(tmp_path / "x"), "--prompt", "x", *argv]) == 2
        assert capsys.readouterr().err.strip() == message
    assert len(_run(tmp_path, "ok", "--ckpt", "tiny-sdxl", "--sdxl", "--prompt", "x", "--steps", "1",
                    "--W", "64", "--H", "64")) == 1
