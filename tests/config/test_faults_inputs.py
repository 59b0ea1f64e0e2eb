"""User-written text files and hostile inputs: one line naming the file (and for bytes that are not
UTF-8 the line and column), before any weight loads, never a traceback."""
from __future__ import annotations

import os

import pytest

from tests.config.test_bad_input import one_error_line


def _args(data, tmp_path, *extra):
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", data,
            "--resolution", "64", "--network_dim", "4", "--max_train_steps", "1",
            "--output_dir", str(tmp_path / "out"), *extra]


def _first(data, ext):
    return sorted(os.path.join(dp, f) for dp, _, fs in os.walk(data) for f in fs if f.endswith(ext))[0]


def test_caption_with_bytes_that_are_not_utf8(dataset, tmp_path, run_script, no_weight_loading):
    cap = _first(dataset, ".caption")
    with open(cap, "wb") as f:
        f.write(b"a first line\r\nthe second \xe9t\xe9\n")  # latin-1
    rc, _, err = run_script("train_lora", _args(dataset, tmp_path))
    assert rc == 2
    assert one_error_line(err) == (f"error: caption file {cap}: line 2: not UTF-8 text (byte 0xe9 "
                                   "at column 12); save the file as UTF-8")


def test_caption_that_is_a_folder(dataset, tmp_path, run_script, no_weight_loading):
    cap = _first(dataset, ".caption")
    os.remove(cap)
    os.mkdir(cap)  # was silently ignored (the class tokens trained instead)
    rc, _, err = run_script("train_lora", _args(dataset, tmp_path))
    assert rc == 2 and one_error_line(err) == f"error: caption file {cap} is a folder, not a file"


def test_caption_that_is_a_broken_symlink(dataset, tmp_path, run_script, no_weight_loading):
    cap = _first(dataset, ".caption")
    os.remove(cap)
    os.symlink(tmp_path / "gone.caption", cap)  # was: silently no caption (the class tokens)
    rc, _, err = run_script("train_lora", _args(dataset, tmp_path))
    assert rc == 2 and one_error_line(err) == (f"error: caption file {cap} is a broken symlink "
                                               f"(its target {tmp_path / 'gone.caption'} does not exist)")


def test_caption_first_line_as_before(tmp_path):
    """The first line, split as readlines does (\\n, \\r\\n, \\r only), BOM dropped."""
    from library.data.folders import read_caption

    img = tmp_path / "a.png"
    for raw, want in [(b"\xef\xbb\xbfone\r\ntwo", "one"), (b"x\x1cy\rz", "x\x1cy"),
                      (b"  \n", None), (b"caf\xc3\xa9 \xe2\x80\xa8 ok\n", "caf\u00e9 \u2028 ok")]:
        (tmp_path / "a.caption").write_bytes(raw)
        assert read_caption(str(img), ".caption") == want, raw


def test_metadata_json_not_utf8(dataset, tmp_path, run_script, no_weight_loading):
    meta = tmp_path / "meta.json"
    meta.write_bytes(b'{\n  "img": {"caption": "caf\xe9"}\n}\n')
    rc, _, err = run_script("train_lora", _args(dataset, tmp_path, "--in_json", meta))
    assert rc == 2
    assert one_error_line(err).startswith(f"error: in_json {meta}: line 2: not UTF-8 text (byte "
                                          "0xe9 at column 26)")


@pytest.mark.parametrize("ext", [".txt", ".toml", ".json"])
def test_sample_prompts_not_utf8(ext, dataset, tmp_path, run_script, no_weight_loading):
    prompts = tmp_path / f"prompts{ext}"
    prompts.write_bytes(b"a cat\n\xff a dog\n")
    rc, _, err = run_script("train_lora", _args(dataset, tmp_path, "--sample_prompts", prompts,
                                                "--sample_every_n_steps", "1"))
    assert rc == 2
    assert one_error_line(err).startswith(f"error: sample_prompts {prompts}: line 2: not UTF-8 "
                                          "text (byte 0xff at column 1)")


# -- hostile inputs found by the battery (docs/RELIABILITY.md) --------------------------------------
def test_zero_byte_weights_file_in_a_diffusers_folder(dataset, tmp_path, run_script):
    """Was a SafetensorError traceback: now one line naming the folder and the component."""
    from library.models import sd_checkpoint
    from library.models.families.sd_common.tiny_models import build_tiny_components

    model = str(tmp_path / "model")
    sd_checkpoint.save_diffusers(build_tiny_components("sd15"), "sd1", model)
    open(os.path.join(model, "text_encoder", "model.safetensors"), "wb").close()
    args = _args(dataset, tmp_path)
    args[1] = model
    rc, _, err = run_script("train_lora", args)
    assert rc == 2 and "Traceback" not in err
    assert one_error_line(err).startswith(f"error: {model}: cannot load the diffusers folder "
                                          "(text_encoder): ")


def test_network_weights_that_is_a_folder(dataset, tmp_path, run_script):
    rc, _, err = run_script("train_lora", _args(dataset, tmp_path, "--network_weights", tmp_path))
    assert rc == 2
    assert one_error_line(err) == f"error: LoRA weights file {tmp_path} is a folder, not a file"


def test_ctrl_c_while_caching_leaves_no_temporaries(dataset, tmp_path, run_script, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) while latents are written to disk: exit 130, one line, no
    temporary cache file, no lock or temporary in output_dir. A killed run's temporaries in the
    cache folder are removed when caching starts."""
    from library.data import latent_cache

    real, calls = latent_cache.encode_pixels, []

    def encode(vae, pixels):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(vae, pixels)

    monkeypatch.setattr(latent_cache, "encode_pixels", encode)
    args = _args(dataset, tmp_path, "--cache_latents", "--cache_latents_to_disk",
                 "--vae_batch_size", "1")
    from tests.outputs.test_faults_paths import dead_pid

    folder = os.path.join(os.path.dirname(_first(dataset, ".png")), ".sdcache")
    os.makedirs(folder)
    stale = os.path.join(folder, f".{'0' * 64}.safetensors.sdtk{dead_pid()}.x1y2.tmp")
    open(stale, "wb").write(b"partial")  # left by a run killed (kill -9) while caching
    rc, _, err = run_script("train_lora", args)
    assert not os.path.exists(stale) and "stale temporary file(s) of killed runs" in err
    assert rc == 130 and err.strip().splitlines()[-1] == "interrupted", err[-2000:]
    assert "Traceback" not in err
    cache = [os.path.join(dp, f) for dp, _, fs in os.walk(dataset) for f in fs if ".sdcache" in dp]
    assert len(calls) == 2 and len(cache) <= 1  # the first entry at most, complete
    assert all(f.endswith(".safetensors") and not os.path.basename(f).startswith(".")
               for f in cache), cache
    assert os.listdir(tmp_path / "out") == []  # no lock, no temporary


def test_seed_beyond_numpys_range(dataset, tmp_path, run_script, no_weight_loading):
    """Was NumPy's ValueError traceback after the plan (accelerate's set_seed seeds NumPy)."""
    import numpy as np

    with pytest.raises(ValueError):
        np.random.seed(2**32)  # the range the option's bound stands for
    np.random.seed(2**32 - 1)
    rc, _, err = run_script("train_lora", _args(dataset, tmp_path, "--seed", 2**32))
    assert rc == 2 and one_error_line(err).startswith("error: --seed: 4294967296 is out of range")


@pytest.mark.parametrize("kind", ["missing", "lora file"])
def test_resume_of_something_that_is_not_a_state(kind, dataset, tmp_path, run_script,
                                                 no_weight_loading):
    target = tmp_path / "last-state"
    if kind == "lora file":
        target = tmp_path / "last.safetensors"
        target.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    rc, _, err = run_script("train_lora", _args(dataset, tmp_path, "--resume", target))
    want = (f"error: resume: no such training state folder: {target}" if kind == "missing" else
            f"error: resume: {target} is not a folder (give a training state folder")
    assert rc == 2 and one_error_line(err).startswith(want)


def test_vae_that_gives_nan_latents(dataset, tmp_path, run_script, monkeypatch):
    """An fp16 VAE that overflows: one line naming the image (was a RuntimeError traceback)."""
    import torch

    from library.data import latent_cache

    real = latent_cache.encode_pixels
    monkeypatch.setattr(latent_cache, "encode_pixels",
                        lambda vae, px: real(vae, px) * torch.tensor(float("nan")))
    rc, _, err = run_script("train_lora", _args(dataset, tmp_path, "--cache_latents"))
    assert rc == 3 and "Traceback" not in err
    assert one_error_line(err).startswith("error: non-finite latents from the VAE for ")
    assert one_error_line(err).endswith("try --no_half_vae")
