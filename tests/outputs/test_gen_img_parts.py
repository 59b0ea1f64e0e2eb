"""gen_img.py with a single-file Anima / Lumina 2 backbone and its parts in their own files
(sd-scripts' --qwen3, --llm_adapter_path, --t5_tokenizer_path, --vae; --gemma2, --ae): the image is
the built-in model's, bit for bit (the same weights, one thread); a part flag of another family is
one line before any weight loads."""
from __future__ import annotations

import numpy as np
from safetensors.torch import load_file, save_file

from library.models.families.flux import flux_ae
from library.models.families.anima import tiny as anima_tiny, weights as anima_weights
from library.models.families.lumina import loading as lumina_loading, text as lumina_text, tiny as lumina_tiny
from tests.outputs.test_gen_img import _fails, pixels, run

PROMPT = "red cube --n blue --d 11 --w 64 --h 48 --s 3 --l 4"


def test_anima_from_separate_files_equals_the_builtin(tmp_path):
    m = anima_tiny.build()
    whole = str(tmp_path / "whole.safetensors")
    anima_weights.save_dit(m["dit"], whole)
    sd = load_file(whole)
    # the DiT without its adapter (sd-scripts' layout without net.), the adapter in its own file
    save_file({k[4:]: v for k, v in sd.items() if not k.startswith(("net.llm_adapter.", "net.pos_embedder."))},
              str(tmp_path / "dit.safetensors"))
    save_file({k[len("net.llm_adapter."):]: v for k, v in sd.items() if k.startswith("net.llm_adapter.")},
              str(tmp_path / "adapter.safetensors"))
    m["qwen3"].save_pretrained(tmp_path / "qwen3")
    m["qwen3_tokenizer"].save_pretrained(tmp_path / "qwen3")
    m["vae"].save_pretrained(tmp_path / "vae")
    m["t5_tokenizer"].save_pretrained(tmp_path / "t5")

    [builtin] = run(tmp_path, "builtin", "--ckpt", "tiny-anima", "--prompt", PROMPT)
    [files] = run(tmp_path, "files", "--ckpt", tmp_path / "dit.safetensors", "--llm_adapter_path",
                  tmp_path / "adapter.safetensors", "--qwen3", tmp_path / "qwen3", "--vae", tmp_path / "vae",
                  "--t5_tokenizer_path", tmp_path / "t5", "--prompt", PROMPT)
    assert np.array_equal(pixels(files), pixels(builtin))
    assert pixels(builtin).std() > 1  # an image, not a blank


def _lumina_files(tmp_path) -> dict:
    parts = lumina_tiny.build_tiny_lumina()
    cfg = lumina_tiny.nextdit.TINY
    m = lumina_loading.LuminaModel("original", cfg, parts["transformer"], parts["gemma2"], parts["tokenizer"],
                                   parts["ae"], "x", "y")
    out = {k: str(tmp_path / f"{k}.safetensors") for k in ("lumina", "gemma2", "ae")}
    lumina_loading.save_transformer(out["lumina"], m, parts["transformer"].state_dict(), {})
    save_file({"model." + k: v.contiguous() for k, v in parts["gemma2"].state_dict().items()}, out["gemma2"],
              lumina_text.gemma2_file_metadata(parts["gemma2"], parts["tokenizer"]))
    save_file({k: v.contiguous() for k, v in flux_ae.ae_state_dict(parts["ae"]).items()}, out["ae"],
              flux_ae.ae_file_metadata(parts["ae"]))
    return out


def test_lumina_from_separate_files_equals_the_builtin(tmp_path):
    f = _lumina_files(tmp_path)
    system = ["--system_prompt", "You are an assistant"]
    [builtin] = run(tmp_path, "builtin", "--ckpt", "tiny-lumina", "--prompt", PROMPT, *system)
    # sd-scripts' lumina_minimal_inference spells them --gemma2_path / --ae_path
    [files] = run(tmp_path, "files", "--ckpt", f["lumina"], "--gemma2", f["gemma2"], "--ae_path", f["ae"],
                  "--prompt", PROMPT, *system)
    assert np.array_equal(pixels(files), pixels(builtin))
    [plain] = run(tmp_path, "plain", "--ckpt", "tiny-lumina", "--prompt", PROMPT)
    assert np.abs(pixels(plain) - pixels(builtin)).max() > 0  # the system prompt reaches Gemma-2


def test_a_part_flag_of_another_family_is_one_line(capsys, tmp_path):
    f = _lumina_files(tmp_path)
    lumina = ["--ckpt", "tiny-lumina", "--prompt", "x", "--steps", "1"]
    assert "--qwen3: an Anima option" in _fails(capsys, tmp_path, *lumina, "--qwen3", tmp_path)
    assert "--t5xxl: Lumina 2's only text encoder is Gemma-2" in _fails(capsys, tmp_path, *lumina, "--t5xxl", f["ae"])
    assert "--vae: a Lumina 2 model's autoencoder is --ae" in _fails(capsys, tmp_path, *lumina, "--vae", f["ae"])
    anima = ["--ckpt", "tiny-anima", "--prompt", "x", "--steps", "1"]
    assert "--gemma2: a Lumina 2 option" in _fails(capsys, tmp_path, *anima, "--gemma2", f["gemma2"])
    assert "--ae: Anima's autoencoder is the vae option" in _fails(capsys, tmp_path, *anima, "--ae", f["ae"])
    msg = _fails(capsys, tmp_path, "--ckpt", "tiny-sd15", "--prompt", "x", "--system_prompt", "hi")
    assert "--system_prompt: an option of Lumina 2; this model is SD1/SD2/SDXL" in msg
    # a single-file Lumina 2 transformer without its parts, a Gemma-2 that is not one: the loader's line, as flags
    assert "--gemma2: required with a single-file Lumina 2 transformer" in _fails(
        capsys, tmp_path, "--ckpt", f["lumina"], "--ae", f["ae"], "--prompt", "x")
    assert f"--gemma2: {f['ae']} is not a Gemma-2 2B text encoder" in _fails(
        capsys, tmp_path, "--ckpt", f["lumina"], "--ae", f["ae"], "--gemma2", f["ae"], "--prompt", "x")


def test_lumina_cfg_shaping_flags_equal_the_prompt_line_and_the_in_run_sample(capsys, tmp_path):
    """--cfg_trunc_ratio / --renorm_cfg (lumina_minimal_inference's flags) mean the line's --ctr /
    --rcfg; the image is the in-run sample's of the same line and seed (library/training/sampling.py,
    whose formula tests/training/test_lumina_sampling.py checks against float64)."""
    import torch

    from library.config import parse
    from library.models import flow_family
    from library.training import flow_sampling, sampling

    line = "red cube --n blue --d 11 --w 64 --h 80 --s 3 --l 4"
    [by_line] = run(tmp_path, "line", "--ckpt", "tiny-lumina", "--prompt", line + " --ctr 0.6 --rcfg 1.1")
    [by_flag] = run(tmp_path, "flag", "--ckpt", "tiny-lumina", "--prompt", line, "--cfg_trunc_ratio", "0.6",
                    "--renorm_cfg", "1.1")
    [default] = run(tmp_path, "default", "--ckpt", "tiny-lumina", "--prompt", line)
    assert np.array_equal(pixels(by_line), pixels(by_flag))
    assert np.abs(pixels(default) - pixels(by_line)).max() > 0
    opts = parse.options_from_values("train_lora", {"pretrained_model_name_or_path": "tiny-lumina"})
    b = flow_family.load_from_options(opts)
    p = sampling.parse_line(line + " --ctr 0.6 --rcfg 1.1", "test")
    with torch.no_grad():
        sample = flow_sampling.decode_image(b.vae, sampling.sample_latents(
            b, flow_family.family_model_for(b, opts), p, 11, device=torch.device("cpu")))
    assert np.array_equal(pixels(by_line), np.asarray(sample).astype(int))
    capsys.readouterr()  # the runs' log lines
    flux = ["--ckpt", "tiny-flux", "--steps", "1", "--W", "64", "--H", "64"]
    assert "--ctr / --cfg_trunc_ratio shape Lumina 2's CFG" in _fails(capsys, tmp_path, *flux, "--prompt", "x --ctr 0.5")
    assert "--renorm_cfg must be at least 0" in _fails(capsys, tmp_path, *flux, "--prompt", "x", "--renorm_cfg", "-1")


def test_system_prompt_before_the_negative_prompt_too(capsys, tmp_path):
    """--add_system_prompt_to_negative_prompt (lumina_minimal_inference's flag): the same image as
    both texts written out with sd-scripts' format and no system prompt."""
    line = "--d 4 --w 64 --h 64 --s 3 --l 4"
    [ours] = run(tmp_path, "ours", "--ckpt", "tiny-lumina", "--system_prompt", "You are an assistant",
                 "--add_system_prompt_to_negative_prompt", "--prompt", f"red cube --n blue {line}")
    [spelt] = run(tmp_path, "spelt", "--ckpt", "tiny-lumina", "--prompt", "You are an assistant <Prompt Start> red cube "
                  f"--n You are an assistant <Prompt Start> blue {line}")
    [default] = run(tmp_path, "default", "--ckpt", "tiny-lumina", "--system_prompt", "You are an assistant",
                    "--prompt", f"red cube --n blue {line}")
    assert np.array_equal(pixels(ours), pixels(spelt))
    assert np.abs(pixels(default) - pixels(ours)).max() > 0
    capsys.readouterr()
    assert "--add_system_prompt_to_negative_prompt: Lumina 2's system prompt; this model is Anima" in _fails(
        capsys, tmp_path, "--ckpt", "tiny-anima", "--prompt", "x", "--add_system_prompt_to_negative_prompt")
