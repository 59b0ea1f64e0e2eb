"""tools/merge_sd3_safetensors.py: tiny SD3.5 medium split into sd-scripts' separate files by our
writer, merged back: the file equals our own all-in-one save tensor for tensor, loads with our
loader equal to the original and in diffusers' single-file loaders; wrong files are one line."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from library.models import t5
from library.models.families.sd3 import sd3_checkpoint, sd3_vae
from tests.models.test_sd3_checkpoint import COMPONENTS, _assert_same, check_diffusers_reads_all_in_one
from tools import merge_sd3_safetensors


@pytest.fixture(scope="module")
def tiny():
    return sd3_checkpoint.load_sd3("tiny-sd3.5-medium")


@pytest.fixture(scope="module")
def parts(tiny, tmp_path_factory):
    """The transformer file as our writer saves it alone; CLIP-L as the all-in-one writer holds it
    (prefixed, no identity projection), CLIP-G, T5 and the VAE (original layout) without prefixes."""
    d = tmp_path_factory.mktemp("sd3-parts")
    files = {w: str(d / f"{w}.safetensors") for w in ("dit", "clip_l", "clip_g", "t5xxl", "vae")}
    sd3_checkpoint.save_sd3(tiny, files["dit"], components={"mmdit"})
    save_file(sd3_checkpoint.single_file_state_dict(tiny, {"clip_l"}), files["clip_l"])
    save_file(tiny.clip_g.state_dict(), files["clip_g"])
    t5_sd = sd3_checkpoint.single_file_state_dict(tiny, {"t5xxl"})
    save_file({k[len(sd3_checkpoint.TE_PREFIX["t5xxl"]):]: v for k, v in t5_sd.items()}, files["t5xxl"])
    save_file(sd3_vae.to_original(tiny.vae, prefix=""), files["vae"])
    return files


def _argv(files: dict, output: str, **changes) -> list[str]:
    argv = []
    for which, path in {**files, **changes}.items():
        if path:
            argv += [f"--{which}", path]
    return argv + ["--output", output]


def test_merged_file_is_the_all_in_one_file_and_loads(tiny, parts, tmp_path, capsys):
    out = str(tmp_path / "merged.safetensors")
    assert merge_sd3_safetensors.main(_argv(parts, out)) == 0
    assert "saved" in capsys.readouterr().out
    reference = str(tmp_path / "ours.safetensors")
    sd3_checkpoint.save_sd3(tiny, reference)  # the toolkit's own all-in-one writer
    merged, ref = load_file(out), load_file(reference)
    assert merged.keys() == ref.keys()
    assert all(torch.equal(merged[k], ref[k]) and merged[k].dtype == ref[k].dtype for k in ref)
    with safe_open(out, "pt") as f:
        assert sd3_checkpoint.META_KEY in f.metadata()  # the transformer file's metadata, as sd-scripts
    back = sd3_checkpoint.load_sd3(out, t5_loader=t5.model_from_state_dict)
    _assert_same(tiny, back, COMPONENTS + ("t5xxl",))
    assert back.in_source == frozenset(COMPONENTS + ("t5xxl",))
    check_diffusers_reads_all_in_one(out, tiny, tmp_path / "cfg")
    # bf16: the same tensors cast; a transformer file holding a VAE has it replaced by --vae
    with_vae = str(tmp_path / "dit_vae.safetensors")
    sd3_checkpoint.save_sd3(tiny, with_vae, components={"mmdit", "vae"})
    out16 = str(tmp_path / "merged16.safetensors")
    assert merge_sd3_safetensors.main(_argv(parts, out16, dit=with_vae) + ["--save_precision", "bf16"]) == 0
    assert "--vae: replaces the vae weights of --dit" in capsys.readouterr().out
    cast = load_file(out16)
    assert cast.keys() == ref.keys() and all(torch.equal(cast[k], ref[k].to(torch.bfloat16)) for k in ref)


@pytest.mark.parametrize("case, message", [
    ("missing", "--clip_g {d}/none.safetensors: file not found"),
    ("not_dit", "--dit {p[vae]}: not an SD3 transformer"),
    ("t5_is_clip", "--t5xxl {p[clip_g]}: not a T5 encoder in transformers' layout"),
    ("swapped", "--clip_l {p[clip_g]} is wider than --clip_g {d}/clip_l.safetensors (swapped?)"),
    ("other_prefix", "--clip_g {p[clip_l]}: holds clip_l weights (text_encoders.clip_l.*), not clip_g"),
    ("diffusers_vae", "--vae {d}/vae_diffusers.safetensors: a VAE in diffusers' layout"),
    ("output_is_input", "--output {p[t5xxl]}: is --t5xxl"),
    ("truncated", "--dit {d}/dit.safetensors: truncated ("),
    ("overflow", "first_stage_model.encoder.conv_in.weight has non-finite values in float16; not written"),
])
def test_bad_input_is_one_line_and_writes_nothing(tiny, parts, tmp_path, capsys, case, message):
    d = str(tmp_path)
    out = d + "/out.safetensors"
    if case == "diffusers_vae":
        save_file(tiny.vae.state_dict(), d + "/vae_diffusers.safetensors")
    if case == "truncated":
        with open(parts["dit"], "rb") as f:
            data = f.read()
        with open(d + "/dit.safetensors", "wb") as f:
            f.write(data[:-100])
    if case == "swapped":
        save_file({k: v for k, v in tiny.clip_l.state_dict().items() if "projection" not in k}, d + "/clip_l.safetensors")
    if case == "overflow":
        big = sd3_vae.to_original(tiny.vae, prefix="")
        big["encoder.conv_in.weight"] = big["encoder.conv_in.weight"].clone()
        big["encoder.conv_in.weight"][0, 0, 0, 0] = 1e6
        save_file(big, d + "/big_vae.safetensors")
    changes = {"missing": {"clip_g": d + "/none.safetensors"}, "not_dit": {"dit": parts["vae"]},
               "t5_is_clip": {"t5xxl": parts["clip_g"]},
               "swapped": {"clip_l": parts["clip_g"], "clip_g": d + "/clip_l.safetensors"},
               "other_prefix": {"clip_g": parts["clip_l"]}, "truncated": {"dit": d + "/dit.safetensors"},
               "diffusers_vae": {"vae": d + "/vae_diffusers.safetensors"},
               "output_is_input": {}, "overflow": {"vae": d + "/big_vae.safetensors"}}[case]
    output = parts["t5xxl"] if case == "output_is_input" else out
    argv = _argv(parts, output, **changes) + (["--save_precision", "fp16"] if case == "overflow" else [])
    before = {p: os.path.getmtime(p) for p in parts.values()}
    assert merge_sd3_safetensors.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message.format(d=d, p=parts) in err, err
    assert not os.path.exists(out) and not [f for f in os.listdir(d) if f.startswith(".")]
    assert before == {p: os.path.getmtime(p) for p in parts.values()}


def test_help_names_sd_scripts_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        merge_sd3_safetensors.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and all(f"--{flag}" in out for flag in (
        "dit", "vae", "clip_l", "clip_g", "t5xxl", "output", "device", "save_precision"))
