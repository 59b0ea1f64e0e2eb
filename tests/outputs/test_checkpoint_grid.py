"""tools/compare_checkpoints.py (library/outputs/checkpoint_grid.py) on tiny-sd15.

References: the layout is stated by hand from the files' names and metadata written here; each
cell is compared with the image gen_img.py renders for that file, multiplier, prompt line and seed
(a separate process-level run that loads the model and one network afresh), bit for bit on one
thread: the grid swaps networks on one loaded model, and a swap that left a hook behind or lost
the multiplier would change the pixels.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from library.models.families.sd_common.tiny_models import build_tiny_components
from library.outputs import checkpoint_grid
from networks import lora
from tests.outputs.test_gen_img import _tes, pixels, run, write_lora
from tools import compare_checkpoints

SIZE = ["--W", "64", "--H", "64", "--steps", "2", "--sampler", "euler"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run's output folder as the trainer leaves it (names and ss_* metadata), with different
    weights per file; names sort otherwise than training order."""
    d = tmp_path_factory.mktemp("run")
    c = build_tiny_components("sd15")
    net = lora.create_network(1.0, 4, 2.0, c["vae"], _tes(c), c["unet"])
    net.apply_to(_tes(c), c["unet"])
    saves = [("sks-000001", 1, 4), ("sks-step00000006", 2, 6), ("sks-000002", 2, 8), ("sks", 2, 8)]
    for i, (name, epoch, step) in enumerate(saves):
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for m in net.text_encoder_loras + net.unet_loras:
                m.lora_up.weight.copy_(torch.randn(m.lora_up.weight.shape, generator=g) * 0.5)
        net.save_weights(str(d / f"{name}.safetensors"), None, {"ss_epoch": str(epoch), "ss_steps": str(step)})
    (d / "sks-000001-state").mkdir()  # a state folder is no checkpoint
    return d


def test_files_are_ordered_by_metadata_and_by_name_without_it(run_dir, tmp_path):
    found = checkpoint_grid.find_checkpoints(str(run_dir))
    assert [(c.name, c.epoch, c.step) for c in found] == [
        ("sks-000001", 1, 4), ("sks-step00000006", 2, 6), ("sks-000002", 2, 8), ("sks", 2, 8)]
    assert found[1].label() == ["sks-step00000006", "epoch 2, step 6"]
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("a", "a-000010", "a-000002", "other-000001"):
        save_file({"x": torch.zeros(1)}, str(bare / f"{name}.safetensors"))
    found = checkpoint_grid.find_checkpoints(str(bare), "a")
    assert [(c.name, c.epoch, c.step) for c in found] == [("a-000002", 2, None), ("a-000010", 10, None),
                                                          ("a", None, None)]


def test_grid_layout_and_every_cell_is_gen_img_s_image(run_dir, tmp_path):
    torch.set_num_threads(1)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("red cube --n blue --d 3\n# comment\ngreen ball --s 3\n")
    out = tmp_path / "grid"
    files = [str(run_dir / "sks-000002.safetensors"), str(run_dir / "sks-000001.safetensors")]
    rc = compare_checkpoints.main(["--ckpt", "tiny-sd15", "--files", *files, "--from_file", str(prompts),
                                   "--multipliers", "0.5", "1", "--outdir", str(out), "--seed", "7",
                                   "--batch_size", "2", *SIZE])
    assert rc == 0
    layout = json.loads((out / "grid.json").read_text())
    assert [r["label"] for r in layout["rows"]] == [["sks-000002", "epoch 2, step 8"],
                                                    ["sks-000001", "epoch 1, step 4"]]
    assert [c["label"] for c in layout["columns"]] == [["prompt 1", "x0.5"], ["prompt 1", "x1"],
                                                       ["prompt 2", "x0.5"], ["prompt 2", "x1"]]
    assert [c["prompt"] for c in layout["columns"]] == ["red cube", "red cube", "green ball", "green ball"]
    assert [c["steps"] for c in layout["columns"]] == [2, 2, 3, 3]
    seeds = [c["seed"] for c in layout["columns"]]
    assert seeds[0] == seeds[1] == 3 and seeds[2] == seeds[3] != 3
    # the sheet: labels on the left and on top, the cells pasted in their slots
    sheet = pixels(out / "grid.png")
    w, h = layout["grid_size"]
    assert sheet.shape == (h, w, 3)
    left, top = w - 4 * 64, h - 2 * 64
    assert left > 40 and top >= 24
    cells = [[pixels(out / n) for n in row] for row in layout["cells"]]
    for i, row in enumerate(cells):
        assert (sheet[top + i * 64:top + i * 64 + 24, :left] < 128).any(), f"row {i} label"
        for j, cell in enumerate(row):
            assert np.array_equal(sheet[top + i * 64:top + (i + 1) * 64, left + j * 64:left + (j + 1) * 64], cell)
    for j in range(4):
        assert (sheet[:top, left + j * 64:left + j * 64 + 40] < 128).any(), f"column {j} label"
    assert (sheet[:top, :left] == 255).all()  # the corner stays empty
    # every cell distinct (files and multipliers show), and equal to gen_img's image
    flat = [c for row in cells for c in row]
    assert all(np.abs(a - b).max() > 0 for k, a in enumerate(flat) for b in flat[k + 1:])
    for (i, j) in [(0, 0), (1, 3), (0, 3)]:
        col = layout["columns"][j]
        line = f"{col['prompt']} --n {col['negative_prompt']}" if col["negative_prompt"] else col["prompt"]
        [ref] = run(tmp_path, f"ref{i}{j}", "--ckpt", "tiny-sd15", "--network_weights", files[i], "--network_mul",
                    col["multiplier"], "--prompt", f"{line} --d {col['seed']} --s {col['steps']}", *SIZE)
        assert np.array_equal(cells[i][j], pixels(ref)), f"cell {i},{j}"
    from PIL import Image
    with Image.open(out / layout["cells"][1][3]) as im:
        text = im.info["parameters"]
    assert text.startswith("green ball <lora:sks-000001:1>") and f"Seed: {seeds[3]}" in text


def _fails(capsys, tmp_path, *args) -> str:
    rc = compare_checkpoints.main(["--outdir", str(tmp_path / "bad"), *map(str, args)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_input_is_one_line(capsys, run_dir, tmp_path):
    sd15 = ["--ckpt", "tiny-sd15", *SIZE]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"--lora_dir {empty}: holds no .safetensors file" in _fails(capsys, tmp_path, *sd15, "--prompt", "x",
                                                                       "--lora_dir", empty)
    assert f"--lora_dir {tmp_path / 'nope'}: no such folder" in _fails(capsys, tmp_path, *sd15, "--prompt", "x",
                                                                       "--lora_dir", tmp_path / "nope")
    assert f"{tmp_path / 'none.txt'}: no such file" in _fails(capsys, tmp_path, *sd15, "--from_file",
                                                              tmp_path / "none.txt", "--lora_dir", run_dir)
    bad = tmp_path / "prompts.txt"
    bad.write_text("fine\nbroken --q 1\n")
    assert f"{bad}:2: unknown option --q" in _fails(capsys, tmp_path, *sd15, "--from_file", bad, "--lora_dir", run_dir)
    xl = write_lora("sdxl", str(tmp_path / "xl-000001.safetensors"))
    msg = _fails(capsys, tmp_path, *sd15, "--prompt", "x", "--files", run_dir / "sks.safetensors", xl)
    assert msg.startswith(f"error: --network_weights {xl}: ") and "another model family" in msg
    assert not (tmp_path / "bad" / "grid.png").exists() and not (tmp_path / "bad" / "cells").exists()
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    os.link(xl, mixed / "xl-000001.safetensors")
    os.link(run_dir / "sks.safetensors", mixed / "sks.safetensors")
    assert "several runs (sks, xl); choose one with --output_name" in _fails(capsys, tmp_path, *sd15, "--prompt",
                                                                             "x", "--lora_dir", mixed)
    assert "--network_weights: not a compare_checkpoints option" in _fails(
        capsys, tmp_path, *sd15, "--prompt", "x", "--lora_dir", run_dir, "--network_weights", xl)
    assert "give one of --lora_dir or --files" in _fails(capsys, tmp_path, *sd15, "--prompt", "x")


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux"])
def test_flow_families_cell_is_gen_img_s_image(model, tmp_path):
    """FLUX.1 / SD3: the family's LoRA module swapped per file; a cell equals gen_img's image."""
    from networks import lora_flux, lora_sd3
    from tests.outputs.test_gen_img_flow import _bundle, _lora

    torch.set_num_threads(1)
    b = _bundle(model)
    for i, name in enumerate(["x-000001", "x"]):
        _lora({"tiny-sd3": lora_sd3, "tiny-flux": lora_flux}[model], b, str(tmp_path / f"{name}.safetensors"), seed=i)
    common = ["--ckpt", model, "--prompt", "a cube --d 5", "--W", "64", "--H", "64", "--steps", "2"]
    assert compare_checkpoints.main([*common, "--lora_dir", str(tmp_path), "--outdir", str(tmp_path / "g"),
                                     "--multipliers", "0.5", "1"]) == 0
    layout = json.loads((tmp_path / "g" / "grid.json").read_text())
    assert [r["name"] for r in layout["rows"]] == ["x-000001", "x"]
    cells = [[pixels(tmp_path / "g" / n) for n in row] for row in layout["cells"]]
    [ref] = run(tmp_path, "ref", *common, "--network_weights", tmp_path / "x.safetensors", "--network_mul", "0.5")
    assert np.array_equal(cells[1][0], pixels(ref))
    assert np.abs(cells[1][0] - cells[0][0]).max() > 0 and np.abs(cells[1][0] - cells[1][1]).max() > 0
