"""tools/merge_models.py: the merge equals the float64 weighted sum of the files' tensors (sd-scripts'
rules for missing keys, --unet_only and old text-encoder keys included), loads as a model, and
bad input is one line, exit 2, with an existing output left as it was."""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from library.models import loading, sd_checkpoint
from library.models.families.sd_common.tiny_models import build_tiny_components
from tools import merge_models as tool

EPS32 = 2.0 ** -24  # float32's unit roundoff


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Three tiny SD1 checkpoints with different weights (the tiny model plus seeded noise)."""
    d = tmp_path_factory.mktemp("models")
    comps = build_tiny_components("sd15")
    paths = []
    for i in range(3):
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name in ("unet", "vae", "text_encoder"):
                for p in comps[name].parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
        path = str(d / f"m{i}.safetensors")
        sd_checkpoint.save_single_file(comps, "sd1", path)
        paths.append(path)
    return paths


def _reference(paths, ratios, fill_from_first=True):
    """float64 sum_i r_i * x_i over the first file's keys; a key a file lacks counts the first's value."""
    sds = [load_file(p) for p in paths]
    out = {}
    for key, first in sds[0].items():
        if not first.is_floating_point():
            out[key] = first
            continue
        out[key] = sum(r * (sd.get(key, first) if fill_from_first else sd[key]).double() for r, sd in zip(ratios, sds))
    return out, sds


def _assert_sum(got: dict, ref: dict, sds, ratios):
    assert set(got) == set(ref)
    for key, want in ref.items():
        if not want.is_floating_point():
            assert torch.equal(got[key], want)
            continue
        # float32: each of the n products and n - 1 sums rounds once, relative to at most sum |r_i x_i|
        bound = sum(abs(r) * sd.get(key, sds[0][key]).double().abs() for r, sd in zip(ratios, sds))
        err = (got[key].double() - want).abs()
        assert (err <= (2 * len(ratios)) * EPS32 * bound + 1e-30).all(), key


def test_merge_equals_the_float64_weighted_sum_and_loads(files, tmp_path):
    ratios = [0.5, 0.3, -0.2]
    out = tmp_path / "merged"  # .safetensors appended, as sd-scripts
    argv = ["--models", *files, "--ratios", *map(str, ratios), "--output", str(out), "--device", "cpu"]
    assert tool.main(argv) == 0
    got = load_file(str(out) + ".safetensors")
    ref, sds = _reference(files, ratios)
    _assert_sum(got, ref, sds, ratios)
    bundle = loading.load_model_bundle(str(out) + ".safetensors")  # the tiny architecture rides along
    assert bundle.family == "sd1"


def test_default_ratios_missing_keys_old_te_keys_and_skipped(files, tmp_path, caplog):
    """Two files at 1/2 each; the second lacks one U-Net tensor (the first's value fills in) and has
    an extra one (skipped, listed), and uses the old text-encoder prefix (read as the new one)."""
    second = load_file(files[1])
    gone = "model.diffusion_model.out.2.weight"
    second.pop(gone)
    second["model.diffusion_model.extra.weight"] = torch.ones(2)
    old = {}
    for k, v in second.items():
        old[k.replace("cond_stage_model.transformer.text_model.", "cond_stage_model.transformer.")] = v
    path2 = str(tmp_path / "old.safetensors")
    save_file(old, path2)
    out = str(tmp_path / "m.safetensors")
    with caplog.at_level(logging.INFO, logger="sdtk"):
        assert tool.main(["--models", files[0], path2, "--output", out, "--show_skipped"]) == 0
    sds = [load_file(files[0]), second]
    ref = {k: sum(0.5 * sd.get(k, v).double() for sd in sds) for k, v in sds[0].items()}
    _assert_sum(load_file(out), ref, sds, [0.5, 0.5])
    assert "Skip: model.diffusion_model.extra.weight" in caplog.text
    assert f"{gone} is missing" in caplog.text


def test_unet_only_and_saving_precision(files, tmp_path):
    out = str(tmp_path / "u.safetensors")
    assert tool.main(["--models", *files[:2], "--ratios", "0.25", "0.75", "--output", out, "--unet_only",
                      "--saving_precision", "fp16"]) == 0
    got, first = load_file(out), load_file(files[0])
    ref, sds = _reference(files[:2], [0.25, 0.75])
    for key, value in got.items():
        assert value.dtype == torch.float16
        if key.startswith("model.diffusion_model."):
            # one rounding to float16 after the float32 sum: within half a float16 ulp plus the sum's error
            assert torch.allclose(value.double(), ref[key], rtol=2.0 ** -10, atol=2.0 ** -24), key
        else:
            assert torch.equal(value, first[key].half()), key  # VAE and text encoder: the first model's


@pytest.mark.parametrize("case,message", [
    ("missing", "--models {missing}: no such file"),
    ("ckpt", "--models {ckpt}: not a .safetensors file"),
    ("ratios", "--ratios: 1 value(s) given for 2 file(s) in --models"),
    ("family", "--models: {sd2} is a sd2 model but {m0} is sd1"),
    ("shape", "--models: model.diffusion_model.out.2.weight is"),
    ("overflow", "{out}: "),
    ("device", "--device 'nodevice': not a torch device"),
])
def test_bad_input_is_one_line_and_keeps_the_previous_output(files, tmp_path, capsys, case, message):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous good model")
    paths = {"missing": str(tmp_path / "nope.safetensors"), "ckpt": str(tmp_path / "m.ckpt"),
             "sd2": str(tmp_path / "sd2.safetensors"), "m0": files[0], "out": str(out),
             "bad": str(tmp_path / "bad.safetensors")}
    models, extra = [files[0], files[1]], []
    if case == "missing":
        models[1] = paths["missing"]
    elif case == "ckpt":
        torch.save({"state_dict": {}}, paths["ckpt"])
        models[1] = paths["ckpt"]
    elif case == "ratios":
        extra = ["--ratios", "1.0"]
    elif case == "family":
        sd_checkpoint.save_single_file(build_tiny_components("sd2"), "sd2", paths["sd2"])
        models[1] = paths["sd2"]
    elif case == "shape":
        sd = load_file(files[1])
        sd["model.diffusion_model.out.2.weight"] = torch.zeros(1, 2, 3, 3)
        save_file(sd, paths["bad"])
        models[1] = paths["bad"]
    elif case == "overflow":  # finite in float32, infinite in float16: nothing is written
        extra = ["--ratios", "1e6", "1e6", "--saving_precision", "fp16"]
    elif case == "device":
        extra = ["--device", "nodevice"]
    capsys.readouterr()
    assert tool.main(["--models", *models, "--output", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: " + message.format(**paths)) and "\n" not in err, err
    if case == "overflow":
        assert err.endswith("has non-finite values; not written")
    assert out.read_bytes() == b"previous good model"


def test_help_names_sd_scripts_flags(capsys):
    with pytest.raises(SystemExit):
        tool.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--models", "--ratios", "--output", "--precision", "--saving_precision", "--show_skipped",
                 "--unet_only", "--device"):
        assert flag in text, flag


def test_merged_file_has_no_stray_temporaries(files, tmp_path):
    out = tmp_path / "m.safetensors"
    assert tool.main(["--models", *files[:2], "--output", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    with safe_open(str(out), "pt") as f:
        assert "m0.safetensors" in f.metadata()["sdtk.merged_from"]


@pytest.mark.parametrize("script,flag", [("tools/merge_models.py", "--saving_precision"),
                                         ("tools/convert_diffusers20_original_sd.py", "--unet_use_linear_projection"),
                                         ("networks/sdxl_merge_lora.py", "--lbws")])
def test_scripts_run_from_a_plain_checkout(script, flag):
    """As the kohya_ss GUI calls them: by path, from the repository, nothing installed on the path."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"], capture_output=True, text=True,
                          cwd="/", env=env, timeout=120)
    assert proc.returncode == 0 and flag in proc.stdout, proc.stderr
