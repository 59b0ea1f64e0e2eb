"""benchmarks/gpu.py's generation rows (benchmarks/gen_img_rate.py ``gpu_row``) in a dry run: the
tiny SD1.5 / SDXL models through gen_img's renderer and through diffusers' own pipeline on the same
components; the full-size cases' settings (architecture, size, 30 steps) as the issue asks."""
from __future__ import annotations

import json

from benchmarks import gen_img_rate, gpu


def test_gpu_generation_rows_dry_run(capsys, tmp_path):
    assert gen_img_rate.GPU_CASES == {"sd15-gen-512": ("sd15-arch", "tiny-sd15", 512),
                                      "sdxl-gen-1024": ("sdxl-arch", "tiny-sdxl", 1024)}
    assert gen_img_rate.GPU_STEPS == 30
    out = tmp_path / "rows.json"
    assert gpu.main(["--dry-run", "--no-compile", "--only", "sd15-gen-512", "sdxl-gen-1024",
                     "--json", str(out), "--work", str(tmp_path / "w")]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["model"], r["size"], r["steps"]) for r in rows] == [
        ("sd15-gen-512", "tiny-sd15", 64, 2), ("sdxl-gen-1024", "tiny-sdxl", 64, 2)]
    assert all(r["images_s"] > 0 and r["diffusers_images_s"] > 0 and r["peak_alloc_gib"] is None for r in rows)
    text = capsys.readouterr().out
    assert "sdxl-gen-1024     gen_img " in text and "diffusers' pipeline" in text and "peak n/a" in text
