"""tools/convert_diffusers20_original_sd.py: built-in tiny SD1 / SD2 / SDXL models go to a single
file, to a diffusers folder and back to a single file bit for bit; diffusers' own pipelines read
the folder (from_pretrained) and the file (from_single_file) as the original weights; the
precision, step and projection flags do what they say; bad input is one line, exit 2, and leaves
an existing output alone."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from library.models.families.sd_common.tiny_models import build_tiny_components
from tests.helpers import assert_same_unet_function
from tools import convert_diffusers20_original_sd as tool

PARTS = {"tiny-sd15": ("sd15", ["unet", "vae", "text_encoder"]),
         "tiny-sd2": ("sd2", ["unet", "vae", "text_encoder"]),
         "tiny-sdxl": ("sdxl", ["unet", "vae", "text_encoder", "text_encoder_2"])}


def _pipeline_class(name):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    return StableDiffusionXLPipeline if name == "tiny-sdxl" else StableDiffusionPipeline


def _assert_equal_models(want: dict, got, names):
    for n in names:
        a, b = want[n].state_dict(), getattr(got, n).state_dict()
        a = {k: v for k, v in a.items() if not k.endswith("position_ids")}
        b = {k: v for k, v in b.items() if not k.endswith("position_ids")}
        assert set(a) == set(b), n
        for k in a:
            assert torch.equal(a[k], b[k]), f"{n}.{k}"


@pytest.mark.parametrize("name", list(PARTS))
def test_round_trip_is_bit_exact_and_diffusers_loads_both_sides(name, tmp_path):
    arch, names = PARTS[name]
    original = build_tiny_components(arch)  # the same seeded weights the built-in name loads
    file1, folder, file2 = tmp_path / "m.safetensors", tmp_path / "m_diffusers", tmp_path / "m2.safetensors"
    assert tool.main([name, str(file1)]) == 0
    assert tool.main([str(file1), str(folder)]) == 0
    assert tool.main([str(folder), str(file2)]) == 0

    a, b = load_file(str(file1)), load_file(str(file2))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    cls = _pipeline_class(name)
    pipe = cls.from_pretrained(str(folder), local_files_only=True, safety_checker=None,
                               requires_safety_checker=False) if name != "tiny-sdxl" else \
        cls.from_pretrained(str(folder), local_files_only=True)
    _assert_equal_models(original, pipe, names)
    # diffusers' single-file loader, with the folder as its offline config (tiny architectures)
    kw = {"safety_checker": None, "requires_safety_checker": False} if name != "tiny-sdxl" else {}
    single = cls.from_single_file(str(file1), config=str(folder), local_files_only=True, **kw)
    _assert_equal_models(original, single, names)


def test_precision_steps_and_metadata_flags(tmp_path):
    path = tmp_path / "m.ckpt"
    assert tool.main(["--fp16", "--epoch", "3", "--global_step", "120", "tiny-sd15", str(path)]) == 0
    ckpt = torch.load(str(path), weights_only=True)
    assert (ckpt["epoch"], ckpt["global_step"]) == (3, 120)
    unet_w = ckpt["state_dict"]["model.diffusion_model.out.2.weight"]
    assert unet_w.dtype == torch.float16
    assert torch.equal(unet_w, build_tiny_components("sd15")["unet"].conv_out.weight.half())

    st = tmp_path / "m.safetensors"
    assert tool.main(["--save_precision_as", "bf16", "--metadata", "{'name': 'mine'}", str(path), str(st)]) == 0
    from safetensors import safe_open

    with safe_open(str(st), "pt") as f:
        assert f.metadata()["name"] == "mine"
        assert f.get_tensor("model.diffusion_model.out.2.weight").dtype == torch.bfloat16

    # a Lightning-style .ckpt (an object besides the tensors) needs --allow_pickle
    lightning = tmp_path / "lightning.ckpt"
    torch.save({**ckpt, "callbacks": _Callback()}, str(lightning))
    assert tool.main([str(lightning), str(tmp_path / "x.safetensors")]) == 2
    assert tool.main(["--allow_pickle", str(lightning), str(tmp_path / "x.safetensors")]) == 0


class _Callback:
    """A pickled non-tensor object, as Lightning checkpoints carry."""


def test_unet_use_linear_projection_keeps_the_function(tmp_path):
    """tiny-sd15's U-Net uses 1x1-conv projections; the flag writes them as Linear layers. Reference:
    the original U-Net's output (the same product, another kernel: float32 rounding only)."""
    from diffusers import UNet2DConditionModel

    folder = tmp_path / "linear"
    assert tool.main(["--unet_use_linear_projection", "tiny-sd15", str(folder)]) == 0
    unet = UNet2DConditionModel.from_pretrained(str(folder), subfolder="unet", local_files_only=True)
    assert unet.config.use_linear_projection
    assert unet.state_dict()["down_blocks.0.attentions.0.proj_in.weight"].ndim == 2
    ref = build_tiny_components("sd15")["unet"]
    assert not ref.config.use_linear_projection
    assert_same_unet_function(ref, unet)


def test_an_sd2_folder_with_conv_projections_becomes_a_single_file_with_linear_ones(tmp_path):
    """sd-scripts writes SD2 diffusers folders with 1x1-conv projections (use_linear_projection
    false) unless told otherwise; a real SD2 single file holds Linear ones (2-D weights)."""
    from diffusers import UNet2DConditionModel

    from library.models import sd_checkpoint

    comps = build_tiny_components("sd2")
    linear = comps["unet"]
    conv = UNet2DConditionModel.from_config(dict(linear.config) | {"use_linear_projection": False})
    conv.load_state_dict({k: v[:, :, None, None] if k.endswith(("proj_in.weight", "proj_out.weight")) else v
                          for k, v in linear.state_dict().items()})
    folder, out = tmp_path / "conv_sd2", tmp_path / "sd2.safetensors"
    sd_checkpoint.save_diffusers(comps | {"unet": conv}, "sd2", str(folder))
    assert tool.main([str(folder), str(out)]) == 0
    got = load_file(str(out))
    key = "model.diffusion_model.input_blocks.1.1.proj_in.weight"
    assert torch.equal(got[key], linear.state_dict()["down_blocks.0.attentions.0.proj_in.weight"])


def test_reference_model_supplies_the_scheduler(tmp_path):
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    ref = tmp_path / "ref"
    assert tool.main(["tiny-sd15", str(ref)]) == 0
    DDIMScheduler(beta_schedule="scaled_linear", clip_sample=False, steps_offset=1).save_pretrained(str(ref / "scheduler"))
    out = tmp_path / "out"
    assert tool.main(["--reference_model", str(ref), "tiny-sd15", str(out)]) == 0
    pipe = StableDiffusionPipeline.from_pretrained(str(out), local_files_only=True, safety_checker=None,
                                                   requires_safety_checker=False)
    assert isinstance(pipe.scheduler, DDIMScheduler)


def test_gui_reference_model_offline_keeps_the_model_and_sets_the_prediction(tmp_path, caplog):
    """The kohya_ss GUI passes its "source model type" (a hub id) as --reference_model. Offline
    (the tests' HF_HUB_OFFLINE=1) the loaded model's tokenizer and scheduler are written, with a
    warning, and the id's prediction type is applied: tiny-sd2 predicts v, SD2-base the noise."""
    import json
    import logging

    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="sdtk"):
        assert tool.main(["--v2", "--reference_model", "stabilityai/stable-diffusion-2-1-base", "tiny-sd2",
                          str(out)]) == 0
    assert "--reference_model stabilityai/stable-diffusion-2-1-base: not available" in caplog.text
    with open(out / "scheduler" / "scheduler_config.json") as f:
        assert json.load(f)["prediction_type"] == "epsilon"


@pytest.mark.parametrize("argv,message", [
    (["missing.safetensors", "{out}"], "model_to_load missing.safetensors: no such file or folder"),
    (["--v1", "{sd2}", "{out}"], "--v1: {sd2} holds SD2 weights, not SD1"),
    (["--v2", "{sd2}", "{txt}"], "model_to_save {txt}: a single file ends in"),
    (["--fp16", "--bf16", "{sd2}", "{out}"], "--fp16 and --bf16: give one save precision"),
    (["--metadata", "[1]", "{sd2}", "{out}"], "--metadata '[1]': not a dict literal"),
    (["--reference_model", "nowhere", "{sd2}", "{folder}"], "--reference_model nowhere: neither a local diffusers folder nor a hub id"),
])
def test_bad_input_is_one_line_and_keeps_the_previous_output(argv, message, tmp_path, capsys):
    sd2 = tmp_path / "sd2.safetensors"
    assert tool.main(["tiny-sd2", str(sd2)]) == 0
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous good model")
    paths = {"sd2": str(sd2), "out": str(out), "txt": str(tmp_path / "x.txt"), "folder": str(tmp_path / "f")}
    capsys.readouterr()
    assert tool.main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: " + message.format(**paths)) and "\n" not in err, err
    assert out.read_bytes() == b"previous good model"
    assert not (tmp_path / "f").exists()


def test_help_names_sd_scripts_flags(capsys):
    with pytest.raises(SystemExit):
        tool.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--v1", "--v2", "--unet_use_linear_projection", "--fp16", "--bf16", "--float",
                 "--save_precision_as", "--global_step", "--epoch", "--reference_model", "--use_safetensors",
                 "model_to_load", "model_to_save"):
        assert flag in text, flag
