"""Sample images: prompt files, files written and decodable, deterministic, process-count
invariant, and invisible to the training (weights identical with and without sampling)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from library.training.sampling import SamplingError, load_prompts, parse_line, settings
from tests.training.test_train_lora_e2e import base_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ("# a comment, then an empty line\n\n"
           "sks shape, red --n blurry, dark --w 64 --h 64 --s 2 --l 5\n"
           "a blue thing --w 72 --h 64 --d 123 --s 2 --ss euler_a\n")


def pixels(path):
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def test_prompt_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text(PROMPTS)
    a, b = load_prompts(str(txt))
    assert a == {"prompt": "sks shape, red", "negative_prompt": "blurry, dark", "width": 64,
                 "height": 64, "sample_steps": 2, "scale": 5.0, "seed": None, "sample_sampler": None,
                 "image": None, "guidance_scale": None, "cfg_trunc_ratio": None, "renorm_cfg": None}
    # steps and scale not given: the family's defaults (SD: 30, 7.5)
    assert (b["width"], b["seed"], b["sample_sampler"], b["scale"]) == (72, 123, "euler_a", None)
    assert settings(b, "sd1") == (2, 7.5, None)
    assert parse_line("x --w 100 --ss k_euler", "f")["width"] == 96  # multiple of 8; k_ alias
    toml = tmp_path / "p.toml"
    toml.write_text('[prompt]\nwidth = 64\nheight = 64\nsample_steps = 3\n\n'
                    '[[prompt.subset]]\nprompt = "one"\n\n[[prompt.subset]]\nprompt = "two"\nseed = 9\n')
    one, two = load_prompts(str(toml))
    assert (one["prompt"], one["sample_steps"], two["seed"], two["width"]) == ("one", 3, 9, 64)
    js = tmp_path / "p.json"
    js.write_text('[{"prompt": "j", "scale": 3, "sample_sampler": "dpmsolver++"}]')
    assert load_prompts(str(js))[0]["sample_sampler"] == "dpmsolver++"
    for line, msg in [("x --q 1", "unknown option --q"), ("x --w wide", "width must be a int"),
                      ("x --ss nope", "unknown sampler 'nope'"), (" --w 64", "empty prompt")]:
        with pytest.raises(SamplingError, match=msg):
            parse_line(line, "f")


def sample_args(data, out, prompts, *extra):
    return base_args("tiny-sd15", data, str(out), "--sample_prompts", str(prompts),
                     "--learning_rate", "1e-2", "--network_dropout", "0.3",
                     "--network_train_unet_only", *extra)


def test_samples_are_deterministic_show_the_lora_and_leave_training_untouched(train, dataset, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPTS)
    runs = []
    for name in ("a", "b"):
        rc, out, err, r = train("train_lora", sample_args(
            dataset, tmp_path / name, prompts, "--sample_every_n_steps", "2", "--sample_at_first"))
        assert rc == 0, err
        runs.append(r)
    files = sorted(os.listdir(tmp_path / "a" / "sample"))
    assert files == ["last_000000_00_42.png", "last_000000_01_123.png",
                     "last_000002_00_42.png", "last_000002_01_123.png"]
    for f in files:
        img = pixels(tmp_path / "a" / "sample" / f)
        assert img.shape == ((64, 64, 3) if "_00_" in f else (64, 72, 3)) and img.std() > 1
        assert np.array_equal(img, pixels(tmp_path / "b" / "sample" / f))  # identical across runs
    # the pipeline sees the trained LoRA (the base weights are frozen): the image changed
    before = pixels(tmp_path / "a" / "sample" / "last_000000_00_42.png").astype(int)
    after = pixels(tmp_path / "a" / "sample" / "last_000002_00_42.png").astype(int)
    assert np.abs(before - after).max() > 10
    # without sampling: identical weights (network dropout draws from the global RNG)
    rc, out, err, c = train("train_lora", base_args(
        "tiny-sd15", dataset, str(tmp_path / "c"), "--learning_rate", "1e-2",
        "--network_dropout", "0.3", "--network_train_unet_only"))
    assert rc == 0, err
    assert not (tmp_path / "c" / "sample").exists()
    wa, wc = runs[0].parts.method.network.state_dict(), c.parts.method.network.state_dict()
    assert all(torch.equal(wa[k], wc[k]) for k in wa) and runs[0].progress.loss_log == c.progress.loss_log
    assert runs[0].parts.method.network.training


def test_sampling_errors_before_loading(run_script, dataset, tmp_path):
    args = base_args("tiny-sd15", dataset, str(tmp_path / "o"))
    rc, out, err = run_script("train_lora", [*args, "--sample_every_n_steps", "1"])
    assert rc == 2 and "need sample_prompts" in err
    rc, out, err = run_script("train_lora", [*args, "--sample_prompts", str(tmp_path / "none.txt"),
                                             "--sample_at_first"])
    assert rc == 2 and "sample_prompts: no such file" in err
    bad = tmp_path / "bad.txt"
    bad.write_text("ok prompt\nbad --s zero\n")
    rc, out, err = run_script("train_lora", [*args, "--sample_prompts", str(bad), "--sample_at_first"])
    assert rc == 2 and f"{bad}:2: sample_steps must be a int" in err
    assert not (tmp_path / "o").exists()


def test_two_processes_render_the_same_images(run_script, dataset, tmp_path):
    """Prompts are split across 2 gloo processes (0 and 2 on rank 0, 1 on rank 1); the images
    of the starting weights are bit-identical to one process's."""
    import subprocess

    from tests.conftest import two_process_command

    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPTS + "a third one --w 64 --h 64 --s 2 --ss dpmsolver++\n")

    def args(out):
        return sample_args(dataset, out, prompts, "--sample_at_first", "--max_train_steps", "1")

    cmd, env = two_process_command(os.path.join(ROOT, "train_lora.py"), args(tmp_path / "two"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "processes: 2" in proc.stdout
    rc, out, err = run_script("train_lora", args(tmp_path / "one"))
    assert rc == 0, err
    names = ["last_000000_00_42.png", "last_000000_01_123.png", "last_000000_02_44.png"]
    assert sorted(os.listdir(tmp_path / "two" / "sample")) == names
    for n in names:
        assert np.array_equal(pixels(tmp_path / "two" / "sample" / n), pixels(tmp_path / "one" / "sample" / n))
