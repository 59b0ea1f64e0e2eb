"""benchmarks/sd_scripts_tools_check.py stays runnable without sd-scripts: its argument parsing, its
refusal of a folder that is not a checkout, and its comparison of two LoRA files (hand-built, known
answers)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "sd_scripts_tools_check.py")


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("sd_scripts_tools_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_from_a_plain_checkout():
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--sd_scripts", "--work", "--archs", "--steps"):
        assert flag in proc.stdout


def test_parsing_and_a_folder_that_is_not_sd_scripts(check, tmp_path, capsys):
    args = check.build_parser().parse_args(["--sd_scripts", "x", "--archs", "sdxl", "--steps", "3"])
    assert (args.sd_scripts, args.archs, args.steps) == ("x", ["sdxl"], 3)
    with pytest.raises(SystemExit):
        check.build_parser().parse_args(["--archs", "sd15"])  # --sd_scripts is required
    capsys.readouterr()
    assert check.main(["--sd_scripts", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --sd_scripts") and "\n" not in err


def test_compare_hand_built_files(check, tmp_path):
    from safetensors.torch import save_file
    down = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]])
    up = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    a = {"lora_unet_m.lora_down.weight": down, "lora_unet_m.lora_up.weight": up, "lora_unet_m.alpha": torch.tensor(1.0),
         "lora_unet_n.lora_down.weight": down.clone(), "lora_unet_n.lora_up.weight": up.clone()}
    # m: alpha 2 instead of 1 -> delta doubled, relative difference |2D - D| / |2D| = 0.5
    # n: same factors, no alpha key (alpha = rank) -> identical
    b = {k: v.clone() for k, v in a.items()}
    b["lora_unet_m.alpha"] = torch.tensor(2.0)
    b["lora_unet_x.lora_down.weight"] = down[:1].clone()  # only in b, rank 1
    b["lora_unet_x.lora_up.weight"] = up[:, :1].clone()
    save_file(a, str(tmp_path / "a.safetensors"), {"ss_network_dim": "2", "mine": "1"})
    save_file(b, str(tmp_path / "b.safetensors"), {"ss_network_dim": "2", "theirs": "1"})
    c = check.compare(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"))
    assert c["keys"] == "ours-only 0, theirs-only 2" and c["modules"] == 2 and c["ranks"] == "equal"
    assert c["worst"] == pytest.approx(0.5) and c["mean"] == pytest.approx(0.25)
    assert c["md_ours_only"] == ["mine"] and c["md_theirs_only"] == ["theirs"]
