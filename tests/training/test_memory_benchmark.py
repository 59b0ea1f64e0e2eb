"""tools/memory_benchmark.py: variant names, the fitted line, and one real (tiny) benchmark run."""
import csv
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tools import memory_benchmark as mb


def test_variant_flags():
    assert mb.variant_flags("adamw") == ["--optimizer_type", "AdamW"]
    assert mb.variant_flags("fused") == ["--optimizer_type", "Adafactor", "--optimizer_args",
                                         *mb.ADAFACTOR_ARGS, "--fused_backward_pass"]
    assert mb.variant_flags("groups4")[-2:] == ["--fused_optimizer_groups", "4"]
    assert mb.variant_flags("groups4")[:-2] == mb.OPTIMIZERS["adafactor"]
    assert mb.ADAFACTOR_ARGS == ["relative_step=False", "scale_parameter=False", "warmup_init=False"]
    assert mb.variant_flags("adamw+fused+gc") == ["--optimizer_type", "AdamW",
                                                  "--fused_backward_pass",
                                                  "--gradient_checkpointing"]
    assert mb.variant_flags("adamw8bit+fullbf16")[-3:] == ["--mixed_precision", "bf16",
                                                           "--full_bf16"]
    assert mb.variant_flags("fp8+gc") == ["--optimizer_type", "AdamW", "--mixed_precision", "bf16",
                                          "--fp8_base", "--gradient_checkpointing"]
    assert mb.variant_flags("fp8unet")[-1] == "--fp8_base_unet"
    with pytest.raises(mb.BenchmarkError, match="unknown part 'adam'"):
        mb.variant_flags("adam")
    with pytest.raises(mb.BenchmarkError, match="two optimizers"):
        mb.variant_flags("adamw+adafactor")


def test_fit_line():
    a, b = mb.fit_line([1, 2, 4], [3.5, 5.5, 9.5])
    assert a == pytest.approx(2.0) and b == pytest.approx(1.5)
    assert mb.fit_line([2], [7.0]) == (None, 7.0)


def test_benchmark_runs_the_real_script_and_writes_its_files(tmp_path):
    out = tmp_path / "bench"
    res = subprocess.run(
        [sys.executable, os.path.join("tools", "memory_benchmark.py"), "--model", "tiny-sd15",
         "--method", "lora", "--network_dim", "4", "--resolution", "64", "--batch_sizes", "1,2",
         "--variants", "fused", "--steps", "1", "--threads", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    # one variant at two batch sizes (each run is a fresh process: ~10 s); variant names and the
    # line fit are unit-tested above
    assert [(r["variant"], r["batch"], r["status"]) for r in rows] == [
        ("fused", "1", "ok"), ("fused", "2", "ok")]
    for r in rows:
        # a real training process: more than torch's own import (~0.2 GiB), far below the machine
        assert 0.25 < float(r["train_rss_gib"]) < 8
        assert r["phases_separate"] == "True" and float(r["load_rss_gib"]) > 0.25
        assert float(r["save_rss_gib"]) > 0.25
        assert float(r["train_seconds"]) > 0
    assert rows[0]["flags"].endswith("--fused_backward_pass")
    md = (out / "results.md").read_text()
    assert "| fused | 1 | ok |" in md and "Fitted train_rss (GiB) = a x batch + b" in md
    fitted = md.split("Fitted")[1]
    assert "| fused |" in fitted and "n/a" not in fitted  # a slope from two batch sizes
    assert "fit fused:" in res.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (out / "plot.png").exists() and "matplotlib is not installed" in md
    else:
        assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "work").exists()  # the generated data and models are removed


def test_bad_arguments_are_one_line_errors(tmp_path):
    with pytest.raises(SystemExit):
        mb.parse(["--variants", "adamw,nonsense", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        mb.parse(["--batch_sizes", "1,x", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # fp8 base weights: train_lora only
        mb.parse(["--method", "finetune", "--variants", "fp8", "--out", str(tmp_path)])
    assert mb.parse(["--method", "lora", "--variants", "fp8", "--out", str(tmp_path)]).variants == ["fp8"]
