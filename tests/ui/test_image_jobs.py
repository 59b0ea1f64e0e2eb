"""The Generate page's and the Compare panel's API (library/ui/image_routes.py, image_jobs.py): the
form becomes the argument list a user would type for gen_img.py / compare_checkpoints.py, queued
as a tool job (the queue held, so nothing runs unless a test releases it); bad fields are one
line naming the field, paths outside --allowed_paths are refused with nothing queued or written."""
from __future__ import annotations

import json
import os

import pytest

from library.ui import image_jobs
from tests.ui.conftest import UI, tiny_config


@pytest.fixture
def allowed(tmp_path):
    a = tmp_path / "allowed"
    (a / "data" / "2_sks").mkdir(parents=True)
    return a


@pytest.fixture
def held(tmp_path, allowed):
    u = UI(tmp_path / "ui", allowed_paths=[str(allowed)], gated=True)
    u.client.post("/api/queue", json={"held": True})
    yield u
    u.close()


def _config(ui, jid) -> dict:
    return json.loads(ui.store.get(jid)["config"])


def _finished_run(ui, allowed, script="train_lora", state="done") -> int:
    out = allowed / "out"
    out.mkdir(exist_ok=True)
    jid = ui.store.add(script, tiny_config(str(allowed / "data"), str(out), output_name="sks"), 1,
                       str(out), "sks")
    ui.store.update(jid, state=state)
    return jid


def test_generate_queues_gen_img_with_the_forms_flags(held, allowed):
    (allowed / "a.safetensors").write_bytes(b"x")
    (allowed / "b.safetensors").write_bytes(b"x")
    r = held.client.post("/api/generate", json={
        "model": "tiny-sd15", "prompt": "a red cube", "negative_prompt": "blurry",
        "loras": [{"path": str(allowed / "a.safetensors"), "weight": 0.5},
                  {"path": "b.safetensors", "weight": "-1"}],
        "seed": 7, "steps": "3", "width": 64, "height": 96, "sampler": "euler_a", "scale": 5, "images": 2})
    assert r.status_code == 201, r.text
    jid, outdir = r.json()["id"], r.json()["outdir"]
    job = held.store.get(jid)
    assert job["script"] == "gen_img.py" and job["state"] == "queued" and job["output_dir"] == outdir
    assert os.path.dirname(outdir) == os.path.join(os.path.realpath(allowed), "generated")
    assert os.path.basename(outdir).startswith("gen-")
    prompt_file = os.path.join(outdir, "prompt.txt")
    assert _config(held, jid) == {"cwd": os.path.realpath(allowed), "args": [
        "--ckpt", "tiny-sd15", "--outdir", outdir, "--from_file", prompt_file, "--seed", "7",
        "--steps", "3", "--W", "64", "--H", "96", "--sampler", "euler_a", "--scale", "5",
        "--images_per_prompt", "2", "--network_weights", str(allowed / "a.safetensors"), "b.safetensors", "--network_mul", "0.5", "-1"]}
    # the prompt line: the negative prompt as its --n (gen_img's prompt-line option)
    with open(prompt_file, encoding="utf-8") as f:
        assert f.read() == "a red cube --n blurry\n"
    # a second job gets its own folder
    r2 = held.client.post("/api/generate", json={"model": "tiny-sd15", "prompt": "x"})
    assert r2.json()["outdir"] != outdir and "--seed" not in _config(held, r2.json()["id"])["args"]


def test_generate_passes_a_single_file_models_parts_and_system_prompt(held, allowed):
    for name in ("lumina.safetensors", "gemma2.safetensors", "ae.safetensors"):
        (allowed / name).write_bytes(b"x")
    r = held.client.post("/api/generate", json={
        "model": "lumina.safetensors", "prompt": "x", "system_prompt": "-You are an assistant",
        "parts": {"gemma2": "gemma2.safetensors", "ae": str(allowed / "ae.safetensors"), "vae": ""}})
    assert r.status_code == 201, r.text
    args = _config(held, r.json()["id"])["args"]
    i = args.index("--gemma2")
    assert args[i:i + 5] == ["--gemma2", "gemma2.safetensors", "--ae", str(allowed / "ae.safetensors"),
                             "--system_prompt=-You are an assistant"]  # one argument: the text is no flag
    for form, status, message in (({"parts": {"t5": "x"}}, 422, "parts: unknown part 't5'"),
                                  ({"parts": {"qwen3": "--help"}}, 422, "qwen3: '--help' is not a file"),
                                  ({"parts": {"gemma2": "/etc/passwd"}}, 403, "outside the allowed paths")):
        r = held.client.post("/api/generate", json={"model": "tiny-lumina", "prompt": "x", **form})
        assert r.status_code == status and message in r.json()["error"], r.text


def test_a_runs_model_flags_carry_its_parts_and_system_prompt(tmp_path):
    from tests.helpers import options_from_values

    (tmp_path / "g.safetensors").write_bytes(b"x")
    opts = options_from_values("train_lora", {"pretrained_model_name_or_path": "tiny-lumina",
                                              "gemma2": str(tmp_path / "g.safetensors"), "system_prompt": "Be good"})
    m = image_jobs.run_model(opts, str(tmp_path), "sks")
    assert m.flags == (f"--gemma2={tmp_path / 'g.safetensors'}", "--system_prompt=Be good")


@pytest.mark.parametrize("form, status, message", [
    ({"prompt": "x"}, 422, "model: required"),
    ({"model": "tiny-sd15"}, 422, "prompt: required"),
    ({"model": "tiny-sd15", "prompt": "a\nb"}, 422, "prompt: one line is required"),
    ({"model": "tiny-sd15", "prompt": "x", "seed": -1}, 422, "seed: an integer from 0 to 4294967295 is required, got -1"),
    ({"model": "tiny-sd15", "prompt": "x", "steps": 1.5}, 422, "steps: an integer from 1 to 1000 is required, got 1.5"),
    ({"model": "tiny-sd15", "prompt": "x", "scale": "high"}, 422, "scale: a number is required, got 'high'"),
    ({"model": "tiny-sd15", "prompt": "x", "images": 17}, 422, "images: an integer from 1 to 16 is required, got 17"),
    ({"model": "tiny-sd15", "prompt": "x", "sampler": "ddim; rm"}, 422, "sampler: 'ddim; rm' is not a sampler name"),
    ({"model": "tiny-sd15", "prompt": "x", "loras": [{"weight": 1}]}, 422, "path: required"),
    ({"model": "--help", "prompt": "x"}, 422, "model: '--help' is not a model path or name"),
    ({"model": "/etc/x.safetensors", "prompt": "x"}, 403, "argument /etc/x.safetensors is outside the allowed paths"),
    ({"model": "tiny-sd15", "prompt": "x", "loras": [{"path": "/etc/passwd"}]}, 403, "outside the allowed paths"),
    ({"model": "tiny-sd15", "prompt": "x", "outdir": "/tmp"}, 403, "outdir /tmp is outside the allowed paths"),
])
def test_generate_refuses_a_bad_field_in_one_line(held, allowed, form, status, message):
    r = held.client.post("/api/generate", json=form)
    assert r.status_code == status and message in r.json()["error"], r.text
    assert "\n" not in r.json()["error"]
    assert held.store.all() == [] and not (allowed / "generated").exists()  # nothing queued or written


def test_compare_queues_the_grid_of_a_finished_run(held, allowed):
    run = _finished_run(held, allowed)
    r = held.client.post(f"/api/jobs/{run}/compare", json={
        "prompts": "a red cube --d 4\n# a comment\n\nblue sky", "multipliers": "0.5, 1", "steps": 2,
        "width": 64, "height": 64})
    assert r.status_code == 201, r.text
    jid, outdir = r.json()["id"], r.json()["outdir"]
    out = os.path.join(str(allowed), "out")
    assert os.path.dirname(outdir) == os.path.join(out, "compare")
    prompts = os.path.join(outdir, "prompts.txt")
    assert _config(held, jid) == {"cwd": os.path.realpath(allowed), "run": run, "args": [
        "--ckpt", "tiny-sd15", "--lora_dir", out, "--outdir", outdir, "--from_file", prompts,
        "--multipliers", "0.5", "1", "--output_name", "sks", "--steps", "2", "--W", "64", "--H", "64",
        "--seed", "0"]}
    with open(prompts, encoding="utf-8") as f:
        assert f.read() == "a red cube --d 4\nblue sky\n"
    assert held.client.get(f"/api/jobs/{jid}").json()["run"] == run  # the run page finds its grids


def test_compare_is_refused_for_what_it_cannot_compare(held, allowed):
    c = held.client
    assert c.post("/api/jobs/99/compare", json={"prompts": "x"}).status_code == 404
    running = _finished_run(held, allowed, state="running")
    r = c.post(f"/api/jobs/{running}/compare", json={"prompts": "x"})
    assert r.status_code == 409 and r.json()["error"] == f"job {running} is running: compare its files once it has finished"
    db = _finished_run(held, allowed, script="train_dreambooth")
    r = c.post(f"/api/jobs/{db}/compare", json={"prompts": "x"})
    assert r.status_code == 422 and "saves models, not LoRA files" in r.json()["error"]
    run = _finished_run(held, allowed)
    for form, message in (({"prompts": " \n# only a comment"}, "prompts: 1 to 16 prompt lines are required"),
                          ({"prompts": "x", "multipliers": "1 two"}, "multipliers: a number is required, got 'two'"),
                          ({"prompts": "x", "multipliers": []}, "multipliers: 1 to 8 numbers are required")):
        r = c.post(f"/api/jobs/{run}/compare", json=form)
        assert r.status_code == 422 and r.json()["error"] == message, r.text
    tool = c.post("/api/generate", json={"model": "tiny-sd15", "prompt": "x"}).json()["id"]
    r = c.post(f"/api/jobs/{tool}/compare", json={"prompts": "x"})
    assert r.status_code == 409 and "is a tool job (gen_img.py)" in r.json()["error"]
    assert not (allowed / "out" / "compare").exists()


def test_images_lists_pngs_with_their_text_and_the_grid(tmp_path):
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("parameters", "a cube\nSteps: 2, Seed: 1")
    (tmp_path / "cells").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "cells" / "r000_c000.png", pnginfo=info)
    Image.new("RGB", (8, 8)).save(tmp_path / "grid.png")
    (tmp_path / "grid.json").write_text('{"rows": []}')
    (tmp_path / "half.png").write_bytes(b"\x89PNG")
    got = image_jobs.images(str(tmp_path))
    assert got == {"grid": {"rows": []}, "images": [
        {"name": "half.png", "parameters": None},
        {"name": "cells/r000_c000.png", "parameters": "a cube\nSteps: 2, Seed: 1"}]}


@pytest.mark.slow  # two jobs that import torch and diffusers (30-60 s each on a loaded 2-core machine)
def test_generate_and_compare_jobs_render_what_the_command_line_renders(held, allowed, tmp_path):
    import numpy as np
    from PIL import Image

    import gen_img
    from tests.outputs.test_gen_img import write_lora

    c = held.client
    lora = write_lora("sd15", str(allowed / "l.safetensors"), seed=3)
    (allowed / "out").mkdir()
    write_lora("sd15", str(allowed / "out" / "sks-000001.safetensors"), seed=1)
    write_lora("sd15", str(allowed / "out" / "sks.safetensors"), seed=2)
    run = _finished_run(held, allowed)
    g = c.post("/api/generate", json={"model": "tiny-sd15", "prompt": "a red cube", "negative_prompt": "blurry",
                                      "loras": [{"path": lora, "weight": 0.5}], "seed": 7, "steps": 2,
                                      "width": 64, "height": 64}).json()
    k = c.post(f"/api/jobs/{run}/compare", json={"prompts": "a red cube", "multipliers": "0 1", "steps": 2,
                                                  "width": 64, "height": 64}).json()
    c.post("/api/queue", json={"held": False})
    for jid in (g["id"], k["id"]):
        j = held.wait(jid, lambda j: j["state"] in ("done", "failed"), timeout=300)
        assert j["state"] == "done", j
    [im] = c.get(f"/api/jobs/{g['id']}/images").json()["images"]
    assert im["parameters"].startswith("a red cube <lora:l:0.5>\nNegative prompt: blurry\nSteps: 2, ")
    assert "Seed: 7, Size: 64x64" in im["parameters"] and "Lora hashes: \"l: " in im["parameters"]
    ref = tmp_path / "ref"
    assert gen_img.main(["--ckpt", "tiny-sd15", "--outdir", str(ref), "--prompt", "a red cube --n blurry",
                         "--seed", "7", "--steps", "2", "--W", "64", "--H", "64",
                         "--network_weights", lora, "--network_mul", "0.5"]) == 0
    [ref_png] = os.listdir(ref)
    served = c.get(f"/api/jobs/{g['id']}/files/{im['name']}")
    assert served.status_code == 200
    with Image.open(ref / ref_png) as a, Image.open(os.path.join(g["outdir"], im["name"])) as b:
        assert np.array_equal(np.asarray(a), np.asarray(b))
        assert a.text["parameters"] == b.text["parameters"]
    got = c.get(f"/api/jobs/{k['id']}/images").json()
    assert [r["name"] for r in got["grid"]["rows"]] == ["sks-000001", "sks"]
    assert [col["label"] for col in got["grid"]["columns"]] == [["prompt 1", "x0"], ["prompt 1", "x1"]]
    assert len(got["images"]) == 4 and c.get(f"/api/jobs/{k['id']}/files/grid.png").status_code == 200


def test_the_generate_pages_part_fields_are_the_part_flags():
    """The page's "model parts" inputs (images.js GEN_PARTS) are GEN_IMG_PARTS, each once."""
    import re

    from library.config.options import GEN_IMG_PARTS

    with open(os.path.join(os.path.dirname(image_jobs.__file__), "static", "images.js"), encoding="utf-8") as f:
        js = f.read()
    block = js[js.index("const GEN_PARTS = ["):js.index("];", js.index("const GEN_PARTS = ["))]
    names = re.findall(r'\["(\w+)", "', block)
    assert sorted(names) == sorted(GEN_IMG_PARTS) and len(set(names)) == len(names)
