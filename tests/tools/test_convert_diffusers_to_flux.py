"""tools/convert_diffusers_to_flux.py: a diffusers FLUX.1 transformer (written by diffusers itself,
sharded) becomes one BFL file that our loader reads bit for bit equal to the original and that
diffusers' own single-file loader reads back to the diffusers weights; bad input is one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from library.models.families.flux import flux_checkpoint, tiny_flux
from tests.conftest import ROOT
from tests.models.test_flux import _split_at_width, reference_to_diffusers
from tools import convert_diffusers_to_flux


@pytest.fixture(scope="module")
def tiny():
    return tiny_flux.build_tiny_flux("dev")["transformer"]


@pytest.fixture(scope="module")
def folder(tiny, tmp_path_factory):
    """A FLUX folder's transformer/ as diffusers writes it (its own BFL -> diffusers conversion,
    save_pretrained in shards with an index)."""
    from diffusers import FluxTransformer2DModel

    out = str(tmp_path_factory.mktemp("diffusers") / "FLUX.1-tiny")
    kw = {k: v for k, v in flux_checkpoint.diffusers_config(tiny.config).items() if not k.startswith("_")}
    model = FluxTransformer2DModel(**kw)
    model.load_state_dict(reference_to_diffusers(tiny.state_dict(), tiny.config.hidden_size), strict=True)
    model.save_pretrained(os.path.join(out, "transformer"), max_shard_size="1MB")
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_folder_and_first_shard_convert_to_the_original_bfl_weights(tiny, folder, tmp_path, capsys):
    shards = sorted(f for f in os.listdir(os.path.join(folder, "transformer")) if f.endswith(".safetensors"))
    assert len(shards) > 1 and shards[0].endswith(f"-00001-of-{len(shards):05d}.safetensors")
    for i, src in enumerate((folder, os.path.join(folder, "transformer", shards[0]))):
        out = str(tmp_path / f"flux{i}.safetensors")
        assert convert_diffusers_to_flux.main(["--diffusers_path", src, "--save_to", out, "--mem_eff_load_save"]) == 0
        assert "FLUX.1 dev, 2 double and 2 single blocks, width 64" in capsys.readouterr().out
        assert _same(load_file(out), tiny.state_dict())  # BFL keys, no prefix, float32 as stored
        back = flux_checkpoint.read_transformer(out)
        assert (back.layout, back.variant, back.config) == ("bfl", "dev", tiny.config)
        assert _same(back.state_dict, tiny.state_dict())
    out = str(tmp_path / "bf16.safetensors")
    assert convert_diffusers_to_flux.main(["--diffusers_path", folder, "--save_to", out,
                                           "--save_precision", "bf16"]) == 0
    assert _same(load_file(out), {k: v.to(torch.bfloat16) for k, v in tiny.state_dict().items()})
    assert sorted(os.listdir(tmp_path)) == ["bf16.safetensors", "flux0.safetensors", "flux1.safetensors"]


def test_bfl_file_reads_in_diffusers_single_file_loader(folder, tmp_path):
    from diffusers import FluxTransformer2DModel

    out = str(tmp_path / "flux.safetensors")
    assert convert_diffusers_to_flux.main(["--diffusers_path", folder, "--save_to", out]) == 0
    original = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True)
    cfg_dir = tmp_path / "cfg" / "transformer"
    os.makedirs(cfg_dir)
    (cfg_dir / "config.json").write_text(json.dumps(dict(original.config)))
    with _split_at_width(64):  # diffusers' converter writes FLUX.1's linear1 widths in (tests/models/test_flux.py)
        ref = FluxTransformer2DModel.from_single_file(out, config=str(tmp_path / "cfg"), subfolder="transformer",
                                                      local_files_only=True)
    assert _same(ref.state_dict(), original.state_dict())


@pytest.mark.parametrize("case, message", [
    ("missing", "--diffusers_path {d}/nothing: not found"),
    ("inside", "--save_to {f}/flux.safetensors: is inside --diffusers_path {f}"),
    ("bfl", "--diffusers_path {d}/bfl.safetensors: already a FLUX.1 transformer in the BFL layout"),
    ("precision", "--save_precision 'fp4': expected one of float32"),
    ("overflow", "{d}/big: double_blocks.0.img_attn.qkv.weight has non-finite values in float16; not written"),
    ("suffix", "--save_to {d}/out.ckpt: must be a .safetensors file"),
])
def test_bad_input_is_one_line_and_writes_nothing(tiny, folder, tmp_path, capsys, case, message):
    d = str(tmp_path)
    save_file(tiny.state_dict(), d + "/bfl.safetensors")
    out = d + "/out.safetensors"
    if case == "overflow":  # a copy of the folder with one weight beyond float16's range
        src = d + "/big"
        os.makedirs(src + "/transformer")
        sd = {}
        for f in os.listdir(folder + "/transformer"):
            if f.endswith(".safetensors"):
                sd.update(load_file(os.path.join(folder, "transformer", f)))
        sd["transformer_blocks.0.attn.to_q.weight"][0, 0] = 1e6
        save_file(sd, src + "/transformer/diffusion_pytorch_model.safetensors")
        with open(folder + "/transformer/config.json") as fh:
            (tmp_path / "big" / "transformer" / "config.json").write_text(fh.read())
    argv = {"missing": ["--diffusers_path", d + "/nothing", "--save_to", out],
            "inside": ["--diffusers_path", folder, "--save_to", folder + "/flux.safetensors"],
            "bfl": ["--diffusers_path", d + "/bfl.safetensors", "--save_to", out],
            "precision": ["--diffusers_path", folder, "--save_to", out, "--save_precision", "fp4"],
            "overflow": ["--diffusers_path", d + "/big", "--save_to", out, "--save_precision", "fp16"],
            "suffix": ["--diffusers_path", folder, "--save_to", d + "/out.ckpt"]}[case]
    before = set(os.listdir(folder))
    assert convert_diffusers_to_flux.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message.format(d=d, f=folder) in err, err
    assert not os.path.exists(out) and not os.path.exists(d + "/out.ckpt") and set(os.listdir(folder)) == before
    assert not [f for f in os.listdir(d) if f.startswith(".")]  # no temporary left


def test_help_from_a_plain_checkout():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_diffusers_to_flux.py"), "--help"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "--diffusers_path" in proc.stdout, proc.stderr


def test_metadata_names_the_config(folder, tmp_path):
    out = str(tmp_path / "flux.safetensors")
    assert convert_diffusers_to_flux.main(["--diffusers_path", folder, "--save_to", out]) == 0
    with safe_open(out, "pt") as f:
        assert flux_checkpoint.META_CONFIG_KEY in f.metadata()  # the tiny width's RoPE axes, for our loader
