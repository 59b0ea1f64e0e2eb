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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_benchmark_dry_run(capsys, tmp_path):
    """benchmarks/gpu.py --dry-run on the cheapest case (tiny SD1.5 LoRA, 1 step): the code path
    through the trainer, step timing, the FLOP count and the table; every case's options (SDXL
    fused Adafactor, torch_compile, the GPU-only bf16 flags) parse, so none can rot unnoticed."""
    from library.config.parse import parse_args

    gpu = _load("gpu")
    for name in gpu.CASES:
        for dry in (True, False):
            script, args = gpu.case_args(name, str(tmp_path), str(tmp_path / "o"), 3, dry)
            opts = parse_args(script, [str(a) for a in args] + ["--torch_compile"])
            assert opts.torch_compile and opts.cache_latents and opts.train_batch_size == gpu.CASES[name][3]
            assert opts.fused_backward_pass == (name == "sdxl-full-b1")
    out = tmp_path / "rows.json"
    assert gpu.main(["--dry-run", "--no-compile", "--only", "sd15-lora-b1",
                     "--json", str(out), "--work", str(tmp_path / "w")]) == 0
    text = capsys.readouterr().out
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["sd15-lora-b1"]
    assert rows[0]["steps"] == 1 and rows[0]["it_s"] > 0 and not rows[0]["compile"]
    assert rows[0]["flops"] > 0
    assert "sd15-lora-b1" in text and "% peak" in text and "n/a" in text  # no peak on the CPU


def test_gpu_benchmark_flop_count_and_peak_table():
    """The FLOP count of a step is torch's count of forward + backward: for one Linear layer
    (m x k input, k -> n), 2*m*k*n forward and 2*m*k*n for the weight gradient (the input is a
    leaf without grad: no input gradient), the elementwise loss not counted."""
    import types

    gpu = _load("gpu")
    lin = torch.nn.Linear(8, 16, bias=False)
    x = torch.randn(5, 8)

    class FakeRun:
        parts = types.SimpleNamespace(params=list(lin.parameters()))
        tset = types.SimpleNamespace(samples=[0] * 5)

        @staticmethod
        def micro_step_loss(epoch, idx, images, n):
            return lin(x[:len(idx)]).square().sum()

    assert gpu.step_flops(FakeRun, 5) == 2 * (2 * 5 * 8 * 16)
    assert gpu.peak_flops("NVIDIA H200", None) == 989.4e12
    assert gpu.peak_flops("NVIDIA H100 PCIe", None) == 756.0e12
    assert gpu.peak_flops("Unknown GPU", None) is None and gpu.peak_flops("x", 100) == 100e12


def test_ddp_scaling_parser_and_strategies():
    ddp = _load("ddp_scaling")
    a = ddp.build_parser().parse_args(["--steps", "2", "--methods", "lora", "--strategies", "sum"])
    assert (a.steps, a.methods, a.strategies, a.worker) == (2, ["lora"], ["sum"], None)
    with pytest.raises(SystemExit):
        ddp.build_parser().parse_args(["--strategies", "nope"])
    assert a.strategy == "ddp"  # the worker's default: the trainer's DDP engine
    # no trainer option for either; "sum" selects the old synchronous sum in the worker
    assert ddp.STRATEGIES == {"ddp": {"args": [], "reducer": True},
                              "sum": {"args": [], "reducer": False}}
    assert ddp.build_parser().parse_args([]).strategies == ["ddp", "sum"]
    assert ddp.main(["--sd-scripts", os.path.join(ROOT, "docs")]) == 2  # not a checkout


def test_data_pipeline_times_calls_that_exist():
    """benchmarks/data_pipeline.py wraps named functions of the run (the README quotes it): each
    must still exist where it looks for it, or the benchmark fails only when someone runs it."""
    import inspect

    pipeline = _load("data_pipeline")
    calls = pipeline.timed_calls()
    assert {key for _, _, key in calls} == {"cache_latents", "cache_text", "sample_latents",
                                           "text_conditioning", "train"}
    for owner, name, key in calls:
        assert callable(inspect.getattr_static(owner, name)), (owner, name, key)
