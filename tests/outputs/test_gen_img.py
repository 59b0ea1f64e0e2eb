"""gen_img.py on the tiny SD1 / SD2 / SDXL models.

References, none of them our generation code:
- diffusers' own StableDiffusionPipeline / StableDiffusionXLPipeline over freshly built weights,
  the LoRA file loaded by diffusers' kohya loader (``load_lora_weights``) and fused at the
  multiplier, the scheduler from the same config, ``torch.Generator("cpu").manual_seed(seed)``;
- the in-run sample of a training run at the step whose LoRA file gen_img then loads;
- A1111's infotext parser (modules/infotext_utils.py ``parse_generation_parameters``: its regex,
  restated here) and the addnet hash computed from the file's bytes.

Tolerance: ours runs the LoRA as hooks (x W^T + m s (x D^T) U^T in float32), diffusers fused
(x (W + m s U D)^T); the two differ by float32 rounding, a relative 1e-6 per layer, so the final
image in [0, 1] differs by far less than half a level of 8 bits: a pixel differs by at most one
level where the value sits on a rounding boundary, and such pixels are rare.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import struct

import numpy as np
import pytest
import torch
from PIL import Image

import gen_img
from library.models.families.sd_common.tiny_models import build_tiny_components
from networks import lora
from tests.conftest import diffusers_pipeline

pytest.importorskip("peft")  # diffusers' load_lora_weights needs it

PROMPT = "red cube --n blue, dark --d 3 --w 64 --h 64 --s 4 --l 6"


def _tes(c):
    return [c["text_encoder"]] + ([c["text_encoder_2"]] if "text_encoder_2" in c else [])


def write_lora(arch: str, path: str, seed: int = 0) -> str:
    """A random rank-4 LoRA (text encoders and U-Net) of the tiny ``arch`` model."""
    c = build_tiny_components(arch)
    net = lora.create_network(1.0, 4, 2.0, c["vae"], _tes(c), c["unet"])
    net.apply_to(_tes(c), c["unet"])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.text_encoder_loras + net.unet_loras:
            m.lora_up.weight.copy_(torch.randn(m.lora_up.weight.shape, generator=g) * 0.5)
    net.save_weights(path, None, {})
    return path


def pixels(path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).astype(int)


def run(tmp_path, name: str, *args) -> list[str]:
    out = tmp_path / name
    rc = gen_img.main(["--outdir", str(out), *map(str, args)])
    assert rc == 0
    return sorted(str(out / f) for f in os.listdir(out))


def model_scheduler(name: str, c):
    """A sampler as a diffusers user sets one: from the model's own scheduler config."""
    import diffusers

    return getattr(diffusers, name).from_config(c["scheduler"].config)


def diffusers_image(arch, lora_path, mul, *, prompt, negative, seed, size, steps, scale, scheduler="EulerDiscreteScheduler"):
    import diffusers

    c = build_tiny_components(arch)
    pipe = diffusers_pipeline(arch, c)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = model_scheduler(scheduler, c)
    if lora_path:
        pipe.load_lora_weights(lora_path)
        pipe.fuse_lora(lora_scale=mul)
    with torch.no_grad():
        img = pipe(prompt=prompt, negative_prompt=negative, height=size[1], width=size[0], num_inference_steps=steps,
                   guidance_scale=scale, generator=torch.Generator("cpu").manual_seed(seed),
                   output_type="np").images[0]
    return np.round(img * 255).astype(int)


def close(a, b, what):
    """Equal up to float32 noise: no pixel more than one 8-bit level apart. A pixel flips level
    when its float error crosses a rounding boundary, with probability about 255 x its error:
    CPU kernels' last bits depend on memory alignment and thread count (so on what ran before in
    the process), and 4 CFG-6 steps of a random tiny model amplify them to about 1e-4, up to a
    few tenths of the pixels; the LoRA itself moves pixels by more than 10 levels (checked by the
    callers), the quantity this bounds is far below that."""
    diff = np.abs(a - b)
    assert a.shape == b.shape, what
    assert diff.max() <= 1 and (diff > 0).mean() < 0.3, f"{what}: max {diff.max()}, share {(diff > 0).mean()}"


@pytest.mark.parametrize("arch", ["sd15", "sd2", "sdxl"])
def test_image_equals_diffusers_pipeline_with_the_lora_fused(arch, tmp_path):
    path = write_lora(arch, str(tmp_path / "style.safetensors"))
    common = ["--ckpt", f"tiny-{arch}", "--prompt", PROMPT, "--sampler", "euler",
              "--network_weights", path, "--network_mul", "0.7"]
    [ours] = run(tmp_path, "hooked", *common)
    ref = diffusers_image(arch, path, 0.7, prompt="red cube", negative="blue, dark", seed=3, size=(64, 64),
                          steps=4, scale=6.0)
    close(pixels(ours), ref, "gen_img vs diffusers + fused LoRA")
    # the LoRA shows: without it, another image
    base = diffusers_image(arch, None, 0, prompt="red cube", negative="blue, dark", seed=3, size=(64, 64),
                           steps=4, scale=6.0)
    assert np.abs(base - ref).max() > 10
    # merged into the weights: the same image within float tolerance
    [merged] = run(tmp_path, "merged", *common, "--network_merge")
    close(pixels(merged), pixels(ours), "--network_merge vs hooked")


def _a1111_parse(text: str) -> dict:
    """A1111's parse_generation_parameters (modules/infotext_utils.py), the parts used here."""
    re_param = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
    *lines, last = text.strip().split("\n")
    if len(re_param.findall(last)) < 3:
        lines.append(last)
        last = ""
    res, prompt, negative, done_prompt = {}, "", "", False
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            done_prompt, line = True, line[16:].strip()
        if done_prompt:
            negative += ("" if negative == "" else "\n") + line
        else:
            prompt += ("" if prompt == "" else "\n") + line
    res["Prompt"], res["Negative prompt"] = prompt, negative
    for k, v in re_param.findall(last):
        if v.startswith('"') and v.endswith('"'):
            v = json.loads(v)
        m = re.match(r"^(\d+)x(\d+)$", v)
        if m:
            res[f"{k}-1"], res[f"{k}-2"] = m.group(1), m.group(2)
        else:
            res[k] = v
    return res


def addnet_hash(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    return hashlib.sha256(data[8 + n:]).hexdigest()


def test_png_parameters_parse_back_with_a1111s_format(tmp_path):
    a = write_lora("sd15", str(tmp_path / "style_a.safetensors"), seed=1)
    b = write_lora("sd15", str(tmp_path / "other.safetensors"), seed=2)
    [png] = run(tmp_path, "o", "--ckpt", "tiny-sd15", "--prompt", "a (red:1.2) cube, shiny --n blurry, dark --am 0.5,0.25",
                "--seed", "1234", "--W", "72", "--H", "64", "--steps", "3", "--scale", "5.5", "--sampler", "k_euler_a",
                "--clip_skip", "2", "--network_weights", a, b)
    with Image.open(png) as im:
        text = im.text["parameters"]
        assert im.text["seed"] == "1234"
    p = _a1111_parse(text)
    assert p["Prompt"] == "a (red:1.2) cube, shiny <lora:style_a:0.5> <lora:other:0.25>"
    assert p["Negative prompt"] == "blurry, dark"
    assert (p["Steps"], p["Sampler"], p["CFG scale"], p["Seed"]) == ("3", "Euler a", "5.5", "1234")
    assert (p["Size-1"], p["Size-2"], p["Clip skip"], p["Model"]) == ("72", "64", "2", "tiny-sd15")
    assert re.fullmatch(r"[0-9a-f]{10}", p["Model hash"])
    assert p["Lora hashes"] == f"style_a: {addnet_hash(a)[:12]}, other: {addnet_hash(b)[:12]}"
    assert os.path.basename(png).endswith("_1234.png")


def test_prompt_file_seeds_multipliers_and_batches(tmp_path):
    path = write_lora("sd15", str(tmp_path / "l.safetensors"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("# two lines\nred cube --d 5,6 --w 64 --h 64 --s 3 --am 0\n\nblue ball --d 9 --w 64 --h 64 --s 3\n")
    common = ["--ckpt", "tiny-sd15", "--from_file", prompts, "--images_per_prompt", "2", "--sampler", "dpmsolver++",
              "--network_weights", path, "--sequential_file_name"]
    one = run(tmp_path, "one", *common)
    two = run(tmp_path, "two", *common, "--batch_size", "2")
    assert [os.path.basename(f) for f in one] == [f"im_00000{i}.png" for i in range(1, 5)]
    seeds = [Image.open(f).text["seed"] for f in one]
    assert seeds == ["5", "6", "9", "9"]  # --d's seeds, the last one kept when they run out
    for x, y in zip(one, two):
        close(pixels(x), pixels(y), "batch of 2 vs batch of 1")
    # --am 0: the network off, i.e. diffusers' pipeline without it
    ref = diffusers_image("sd15", None, 0, prompt="red cube", negative="", seed=6, size=(64, 64), steps=3, scale=7.5,
                          scheduler="DPMSolverMultistepScheduler")
    close(pixels(one[1]), ref, "--am 0 vs no LoRA")
    # a second run in the same folder continues the numbering: nothing is overwritten
    again = run(tmp_path, "one", "--ckpt", "tiny-sd15", "--prompt", "x --w 64 --h 64 --s 1", "--sequential_file_name")
    assert [os.path.basename(f) for f in again][-1] == "im_000005.png" and len(again) == 5


# FLUX.1 and Chroma are not here: their in-run samples draw the seed's noise packed, as sd-scripts,
# gen_img as diffusers' FluxPipeline / ChromaPipeline (docs/GENERATION.md, "Seeds")
@pytest.mark.parametrize("model,module", [("tiny-sd15", "networks.lora"),
                                          pytest.param("tiny-sdxl", "networks.lora", marks=pytest.mark.slow),
                                          ("tiny-sd3", "networks.lora_sd3"), ("tiny-anima", "networks.lora_anima")])
def test_equals_the_in_run_sample_of_the_same_step(model, module, train, dataset, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("sks shape, red --n blurry --w 64 --h 64 --d 11 --s 3 --l 5 --ss euler_a\n")
    out = tmp_path / "run"
    rc, _, err, _ = train("train_lora", [
        "--pretrained_model_name_or_path", model, "--train_data_dir", dataset, "--output_dir", str(out),
        "--resolution", "64", "--max_train_steps", "2", "--learning_rate", "1e-2", "--network_dim", "4",
        "--network_alpha", "2", "--network_module", module, "--cache_latents", "--sample_prompts", str(prompts),
        "--sample_every_n_steps", "2", "--output_name", "run"])
    assert rc == 0, err
    sample = out / "sample" / "run_000002_00_11.png"
    [ours] = run(tmp_path, "gen", "--ckpt", model, "--from_file", prompts,
                 "--network_weights", out / "run.safetensors")  # the weights of step 2
    assert np.array_equal(pixels(ours), pixels(sample))


def test_highres_fix_is_txt2img_then_lanczos_then_img2img(tmp_path):
    import diffusers

    # 1st stage: 128 x 0.5 = 64 and 96 x 0.5 = 48, down to a multiple of 32: 64 x 32 (sd-scripts)
    [ours] = run(tmp_path, "hr", "--ckpt", "tiny-sd15", "--prompt", "red cube", "--seed", "4", "--W", "128",
                 "--H", "96", "--steps", "4", "--highres_fix_scale", "0.5", "--highres_fix_steps", "3",
                 "--sampler", "euler")
    c = build_tiny_components("sd15")
    pipe = diffusers_pipeline("sd15", c)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = model_scheduler("EulerDiscreteScheduler", c)
    with torch.no_grad():
        first = pipe(prompt="red cube", height=32, width=64, num_inference_steps=3,
                     generator=torch.Generator("cpu").manual_seed(4)).images[0]
        i2i = diffusers.StableDiffusionImg2ImgPipeline(**pipe.components)
        i2i.set_progress_bar_config(disable=True)
        ref = i2i(prompt="red cube", image=first.resize((128, 96), Image.LANCZOS), strength=0.8,
                  num_inference_steps=4, generator=torch.Generator("cpu").manual_seed(5), output_type="np").images[0]
    close(pixels(ours), np.round(ref * 255).astype(int), "highres fix vs diffusers txt2img + img2img")


def test_textual_inversion_embedding_equals_diffusers_loader(tmp_path):
    from safetensors.torch import save_file

    c = build_tiny_components("sd15")
    width = c["text_encoder"].get_input_embeddings().weight.shape[1]
    emb = torch.randn(2, width, generator=torch.Generator().manual_seed(0))
    path = str(tmp_path / "mytok.safetensors")
    save_file({"emb_params": emb}, path)
    [ours] = run(tmp_path, "ti", "--ckpt", "tiny-sd15", "--prompt", "a mytok cube --d 2 --w 64 --h 64 --s 3",
                 "--textual_inversion_embeddings", path, "--sampler", "ddim")
    pipe = diffusers_pipeline("sd15", c)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = model_scheduler("DDIMScheduler", c)
    pipe.load_textual_inversion(path, token="mytok")
    with torch.no_grad():
        ref = pipe(prompt="a mytok cube", height=64, width=64, num_inference_steps=3, guidance_scale=7.5,
                   generator=torch.Generator("cpu").manual_seed(2), output_type="np").images[0]
    close(pixels(ours), np.round(ref * 255).astype(int), "embedding vs diffusers' load_textual_inversion")


def _fails(capsys, tmp_path, *args) -> str:
    rc = gen_img.main(["--outdir", str(tmp_path / "bad"), *map(str, args)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert not os.listdir(tmp_path / "bad") if (tmp_path / "bad").exists() else True
    return err[0]


def test_bad_input_is_one_line_naming_the_file_and_line(capsys, tmp_path):
    from safetensors.torch import save_file

    sd15 = ["--ckpt", "tiny-sd15", "--steps", "1"]
    assert "unknown sampler 'nope'" in _fails(capsys, tmp_path, *sd15, "--prompt", "x", "--sampler", "nope")
    if importlib.util.find_spec("scipy") is None:  # diffusers' LMS scheduler needs it
        assert "sampler lms needs the scipy package" in _fails(capsys, tmp_path, *sd15, "--prompt", "x",
                                                               "--sampler", "k_lms")
    assert "--W/--H: width 60 is not a multiple of 8" in _fails(capsys, tmp_path, *sd15, "--prompt", "x", "--W", "60")
    p = tmp_path / "p.txt"
    p.write_text("fine --w 64 --h 64\nodd --w 64 --h 100\n")
    assert f"{p}:2: height 100 is not a multiple of 8" in _fails(capsys, tmp_path, *sd15, "--from_file", p)
    p.write_text("fine\n# comment\nbroken --q 1\n")
    assert f"{p}:3: unknown option --q" in _fails(capsys, tmp_path, *sd15, "--from_file", p)
    p.write_text("seeds --d 1,x\n")
    assert f"{p}:1: --d must be ints" in _fails(capsys, tmp_path, *sd15, "--from_file", p)
    # a LoRA of another family (SDXL's on SD1), keys that match nothing, a file of no adapter
    xl = write_lora("sdxl", str(tmp_path / "xl.safetensors"))
    msg = _fails(capsys, tmp_path, *sd15, "--prompt", "x", "--network_weights", xl)
    assert msg.startswith(f"error: --network_weights {xl}: ") and "do not exist in this model" in msg and "SD1" in msg
    stray = str(tmp_path / "stray.safetensors")
    save_file({"lora_unet_nowhere.lora_down.weight": torch.zeros(2, 4),
               "lora_unet_nowhere.lora_up.weight": torch.zeros(4, 2), "lora_unet_nowhere.alpha": torch.tensor(2.0)}, stray)
    msg = _fails(capsys, tmp_path, *sd15, "--prompt", "x", "--network_weights", stray)
    assert f"--network_weights {stray}: " in msg and "lora_unet_nowhere" in msg
    other = str(tmp_path / "other.safetensors")
    save_file({"weight": torch.zeros(2)}, other)
    assert "no adapter module keys" in _fails(capsys, tmp_path, *sd15, "--prompt", "x", "--network_weights", other)
    assert "--am needs unmerged networks" in _fails(capsys, tmp_path, *sd15, "--prompt", "x --am 0.5",
                                                     "--network_weights", xl, "--network_merge")
    assert "no such file" in _fails(capsys, tmp_path, *sd15, "--prompt", "x", "--network_weights", tmp_path / "none")
    assert "the following arguments are required: --ckpt" in _fails(capsys, tmp_path, "--prompt", "x")
    assert f"--ckpt: no such file or directory: {tmp_path / 'none.safetensors'}" in _fails(
        capsys, tmp_path, "--ckpt", tmp_path / "none.safetensors", "--prompt", "x")


def test_negative_scale_is_sd_scripts_three_way_guidance(tmp_path):
    """--negative_scale against a denoising loop written here over diffusers' parts: per step
    e = e_u + s (e_p - e_u) - ns (e_n - e_u), e_u the empty prompt's (sd-scripts' gen_img)."""
    [ours] = run(tmp_path, "ns", "--ckpt", "tiny-sd15", "--prompt", "red cube --n blue --d 3 --w 64 --h 64 --s 4",
                 "--scale", "6", "--negative_scale", "20", "--sampler", "euler")
    c = build_tiny_components("sd15")
    pipe = diffusers_pipeline("sd15", c)
    sch = model_scheduler("EulerDiscreteScheduler", c)
    with torch.no_grad():
        emb = [pipe.encode_prompt(t, "cpu", 1, False)[0] for t in ("", "red cube", "blue")]
        x = torch.randn((1, 4, 8, 8), generator=torch.Generator("cpu").manual_seed(3))
        sch.set_timesteps(4)
        x = x * sch.init_noise_sigma
        for t in sch.timesteps:
            xin = sch.scale_model_input(torch.cat([x] * 3), t)
            e_u, e_p, e_n = c["unet"](xin, t, encoder_hidden_states=torch.cat(emb)).sample.chunk(3)
            x = sch.step(e_u + 6 * (e_p - e_u) - 20 * (e_n - e_u), t, x).prev_sample
        img = pipe.image_processor.postprocess(c["vae"].decode(x / c["vae"].config.scaling_factor).sample,
                                               output_type="np")[0]
    close(pixels(ours), np.round(img * 255).astype(int), "--negative_scale vs a three-way guided loop")
    [plain] = run(tmp_path, "plain", "--ckpt", "tiny-sd15", "--prompt", "red cube --n blue --d 3 --w 64 --h 64 --s 4",
                  "--scale", "6", "--sampler", "euler")
    assert np.abs(pixels(plain) - pixels(ours)).max() > 5  # the tiny model's text matters little
    with Image.open(ours) as im:
        assert "Negative scale: 20" in im.text["parameters"]


def test_single_file_and_folder_models_give_the_builtins_image_and_the_file_hash(tmp_path):
    from library.models.sd_checkpoint import save_diffusers, save_single_file

    c = build_tiny_components("sd15")
    f = str(tmp_path / "model.safetensors")
    save_single_file(c, "sd1", f)
    folder = str(tmp_path / "folder")
    save_diffusers(c, "sd1", folder)
    # ddim: its timestep spacing is "leading" by default, as the saved DDPM config states it
    # (another sampler takes the config's spacing: the folder's and the built-in's differ there)
    line = ["--prompt", "red cube --d 2 --w 64 --h 64 --s 2", "--sampler", "ddim"]
    [builtin] = run(tmp_path, "b", "--ckpt", "tiny-sd15", *line)
    [single] = run(tmp_path, "f", "--ckpt", f, *line)
    [diff] = run(tmp_path, "d", "--ckpt", folder, *line)
    close(pixels(single), pixels(builtin), "single file vs built-in")  # the conversion's float rounding
    close(pixels(diff), pixels(builtin), "diffusers folder vs built-in")
    with open(f, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()[:10]
    with Image.open(single) as im:
        p = _a1111_parse(im.text["parameters"])
    assert (p["Model hash"], p["Model"], p["Sampler"]) == (digest, "model", "DDIM")


def test_bf16_runs_the_model_in_bfloat16(tmp_path):
    """--bf16: the same image up to bfloat16's precision (8 significant bits: a relative 2^-9 per
    rounding over the U-Net's depth, a few percent of the latents' scale at worst, so the mean pixel
    stays within a few levels of float32's; a wrong image, e.g. another seed, is off by tens)."""
    line = ["--ckpt", "tiny-sd15", "--prompt", "red cube --d 4 --w 64 --h 64 --s 3", "--sampler", "euler"]
    [full] = run(tmp_path, "f32", *line)
    [half] = run(tmp_path, "bf16", *line, "--bf16")
    [other] = run(tmp_path, "seed", "--ckpt", "tiny-sd15", "--prompt", "red cube --d 5 --w 64 --h 64 --s 3",
                  "--sampler", "euler")
    d = np.abs(pixels(half) - pixels(full)).mean()
    assert 0 < d < 4 < np.abs(pixels(other) - pixels(full)).mean()
    # --no_half_vae: the VAE decodes in float32 the bfloat16 U-Net's latents: again within bf16's precision
    [vae32] = run(tmp_path, "vae32", *line, "--bf16", "--no_half_vae", "--opt_channels_last")
    assert 0 < np.abs(pixels(vae32) - pixels(full)).mean() < 4


def test_network_args_reach_the_network_module(capsys, tmp_path):
    path = write_lora("sd15", str(tmp_path / "l.safetensors"))
    base = ["--ckpt", "tiny-sd15", "--prompt", "x --w 64 --h 64 --s 1", "--network_weights", path]
    assert "has no effect on a network shaped by a weights file" in _fails(
        capsys, tmp_path, *base, "--network_args", "conv_dim=4")
    assert "--network_args entry 1: 'conv_dim' is not key=value" in _fails(capsys, tmp_path, *base,
                                                                            "--network_args", "conv_dim")
