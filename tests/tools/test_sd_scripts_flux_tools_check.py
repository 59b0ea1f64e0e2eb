"""benchmarks/sd_scripts_flux_tools_check.py stays runnable without sd-scripts: a folder that is not
a checkout is one line, its comparison of two files (hand-built), and its inputs work with our tools."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.models.families.flux import tiny_flux
from tests.conftest import ROOT
from tools import convert_diffusers_to_flux


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location(
        "sd_scripts_flux_tools_check", os.path.join(ROOT, "benchmarks", "sd_scripts_flux_tools_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_not_a_checkout_and_compare(check, tmp_path, capsys):
    assert check.main(["--sd_scripts", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --sd_scripts") and err.count("\n") == 1
    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    save_file({"x": torch.ones(2), "y": torch.zeros(1)}, a, {"m": "1"})
    save_file({"x": torch.ones(2), "y": torch.ones(1)}, b, {"m": "1", "n": "2"})
    assert check.compare(a, a) == "2 tensors, all bit-identical; same metadata keys"
    assert check.compare(a, b) == "2 tensors, 1 differ, e.g. y; metadata keys only on one side: n"


def test_its_flux_shards_convert_to_tiny_flux(check, tmp_path):
    check.flux_diffusers_shards(str(tmp_path / "flux"))
    assert len([f for f in os.listdir(tmp_path / "flux" / "transformer") if f.endswith("-of-00003.safetensors")]) == 3
    out = str(tmp_path / "bfl.safetensors")
    assert convert_diffusers_to_flux.main(["--diffusers_path", str(tmp_path / "flux"), "--save_to", out]) == 0
    tiny = tiny_flux.build_tiny_flux("dev")["transformer"].state_dict()
    got = load_file(out)
    assert got.keys() == tiny.keys() and all(torch.equal(got[k], tiny[k]) for k in tiny)
