"""num_class_images: the class images a reg folder lacks, made with the base model before training.

References, none of them the code under test: the step plan's counts from sd-scripts' balancing
rule worked by hand; gen_img.py's own image of the same prompt, seed and settings (the same
renderer, so equal pixel for pixel with one thread); file modification times and a spy on the
generator's constructor for "nothing made again". Tiny SD1 at 64 px, 2 sampling steps.
"""
from __future__ import annotations

import glob
import logging
import os

import numpy as np
import pytest
from PIL import Image

import gen_img
from library.config.parse import parse_args
from library.data.training_data import build_training_set
from library.outputs import generation
from tests.helpers import make_opts

CLASS = "shape"
LOG = logging.getLogger("test_class_images")


@pytest.fixture
def folders(tmp_path):
    """Instance images (2 x 2 repeats) and a reg folder ``1_shape`` holding one user image."""
    from tools.make_sample_dataset import make_sample_dataset

    make_sample_dataset(str(tmp_path / "data"), n_images=2, size=64, repeats=2)
    make_sample_dataset(str(tmp_path / "reg"), n_images=1, size=64, repeats=1, concept=CLASS)
    return tmp_path


def args(root, *extra):
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", root / "data",
            "--reg_data_dir", root / "reg", "--output_dir", root / "out", "--resolution", "64",
            "--max_train_steps", "1", "--num_class_images", "3", "--class_image_steps", "2", *extra]


def made(root) -> dict:
    paths = glob.glob(str(root / "reg" / f"1_{CLASS}" / ".sdcache" / "class_images" / "*.png"))
    return {p: os.stat(p).st_mtime_ns for p in paths}


def pixels(path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def test_dry_run_plans_them_and_loads_nothing(folders, run_script, monkeypatch):
    """The plan counts the 2 missing images: 3 reg images, balanced (sd-scripts: first pass 1 + 1
    + 1 = 3 < 4 train samples, then one more repeat of the first) to 4 reg samples; 2 x 2 + 4 = 8
    samples per epoch. A dry run builds no generator and writes no file."""
    def refuse(*a, **k):
        raise AssertionError("a dry run must not load a model")

    monkeypatch.setattr(generation.Generator, "__init__", refuse)
    monkeypatch.setattr(generation.flow_family, "load_from_options", refuse)
    rc, out, err = run_script("train_dreambooth", args(folders, "--dry_run"))
    assert rc == 0, err
    assert "reg_images: 3\n" in out and "reg_samples: 4\n" in out and "samples_per_epoch: 8\n" in out
    assert "class_images: 2 of the reg images (2 to generate before training)" in out
    assert "memory estimate" in out
    assert made(folders) == {}


def test_made_once_reused_equal_to_gen_img(folders, train, monkeypatch, tmp_path):
    user = folders / "reg" / f"1_{CLASS}" / "shape_00.png"
    user_bytes = user.read_bytes()
    rc, out, err, run = train("train_dreambooth", args(folders))
    assert rc == 0, err
    first = made(folders)
    assert len(first) == 2 and "reg_images: 3\n" in out
    assert user.read_bytes() == user_bytes  # the user's image is never written
    assert sum(it.path in first for it in run.tset.reg_items) == 2  # they are trained on

    # A second run reuses them: no generator is built, no file is written.
    built = []
    real = generation.Generator.__init__
    monkeypatch.setattr(generation.Generator, "__init__",
                        lambda self, a: (built.append(a), real(self, a))[1])
    rc, out, err, _ = train("train_dreambooth", args(folders, "--output_dir", folders / "out2"))
    assert rc == 0, err
    assert built == [] and made(folders) == first
    assert "(0 to generate before training)" in out

    # Image 1 of the folder is gen_img's image of the class prompt with seed + 1 (seed 42).
    by_seed = {int(Image.open(p).text["seed"]): p for p in first}
    assert sorted(by_seed) == [42, 43]
    rc = gen_img.main(["--ckpt", "tiny-sd15", "--prompt", CLASS, "--seed", "43", "--W", "64",
                       "--H", "64", "--steps", "2", "--sampler", "ddim", "--outdir",
                       str(tmp_path / "gen")])
    assert rc == 0
    (ref,) = glob.glob(str(tmp_path / "gen" / "*.png"))
    assert np.array_equal(pixels(by_seed[43]), pixels(ref))
    assert Image.open(by_seed[43]).text["parameters"] == Image.open(ref).text["parameters"]

    # A changed seed makes new images (one generator more); the old ones stay.
    before = len(built)  # gen_img's own generator counted too
    rc, out, err, _ = train("train_dreambooth", args(folders, "--seed", "7", "--output_dir",
                                                     folders / "out3"))
    assert rc == 0, err
    assert len(built) == before + 1
    now = made(folders)
    assert len(now) == 4 and all(now[p] == t for p, t in first.items())


def _opts(folders, **over):
    values = dict(pretrained_model_name_or_path="tiny-sd15", train_data_dir=str(folders / "data"),
                  reg_data_dir=str(folders / "reg"), output_dir=str(folders / "out"),
                  resolution=(64, 64), max_train_steps=1, num_class_images=3, class_image_steps=2)
    return make_opts("train_dreambooth", **{**values, **over})


def _planned(folders, **over):
    return [c.path for c in build_training_set(_opts(folders, **over), LOG).class_images]


def test_key_names_every_setting(folders):
    """Each setting of the key names other files; the same settings, the same files."""
    base = _planned(folders)
    assert base == _planned(folders) and len(set(base)) == 2
    for over in ({"seed": 1}, {"class_image_steps": 3}, {"class_image_scale": 5.0},
                 {"class_image_sampler": "euler"}, {"resolution": (64, 128)},
                 {"pretrained_model_name_or_path": "tiny-sd2"}):
        assert not set(_planned(folders, **over)) & set(base), over
    os.rename(folders / "reg" / f"1_{CLASS}", folders / "reg" / "1_red shape")  # the prompt
    assert not set(_planned(folders)) & set(base)
    # more user images: fewer to make (a prefix of the same files); enough: none
    assert len(_planned(folders, num_class_images=2)) == 1
    assert _planned(folders, num_class_images=1) == []


def test_dataset_config_subset_and_errors(folders, tmp_path):
    """A dataset's is_reg subset is filled from its class_tokens; a reg folder without class
    tokens is one line naming it."""
    from library.errors import DataError

    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""pretrained_model_name_or_path = "tiny-sd15"
max_train_steps = 1
output_dir = "{tmp_path / 'out'}"
num_class_images = 4
[[datasets]]
resolution = 64
[[datasets.subsets]]
image_dir = "{folders / 'data' / '2_sks shape'}"
num_repeats = 2
[[datasets.subsets]]
image_dir = "{folders / 'reg' / f'1_{CLASS}'}"
is_reg = true
class_tokens = "cube"
""")
    opts = parse_args("train_dreambooth", ["--config", str(cfg)])
    tset = build_training_set(opts, LOG)
    assert [c.prompt for c in tset.class_images] == ["cube"] * 3
    assert len(tset.reg_items) == 4 and all(it.is_reg for it in tset.reg_items)
    os.rename(folders / "reg" / f"1_{CLASS}", folders / "reg" / "1")
    with pytest.raises(DataError, match=r"num_class_images: reg_data_dir folder .*/1 has no class tokens"):
        _planned(folders)


def test_memory_estimate_counts_them(folders):
    """The estimate's cached latents include the planned class images: 2 more 64 px images are
    2 x (4 x 8 x 8) float32 latents = 2048 bytes (a hand count of tiny SD1's latent shape)."""
    from library.config.options import METHOD_OF_SCRIPT
    from library.training import memory_estimate

    def cached(n):
        opts = _opts(folders, cache_latents=True, num_class_images=n)
        tset = build_training_set(opts, LOG)
        return memory_estimate.estimate(opts, METHOD_OF_SCRIPT["train_dreambooth"], tset, 1).cached_data

    assert cached(3) - cached(0) == 2 * 4 * 8 * 8 * 4


def test_debug_dataset_before_they_exist_is_one_line(folders, run_script):
    rc, out, err = run_script("train_dreambooth", args(folders, "--debug_dataset"))
    assert rc == 2
    assert "debug_dataset: 2 class image(s) of num_class_images are not made yet" in err
    assert "Traceback" not in err and made(folders) == {}


def _two_process_worker(root, rank, port, queue):
    """One process of a gloo job of two: plan, make_missing, then report what this process made
    and which planned files it sees decodable right after the call returns."""
    import types
    from pathlib import Path

    import torch.distributed as dist

    from library.data.class_images import to_make
    from library.outputs.class_images import make_missing

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        planned = build_training_set(_opts(Path(root)), LOG).class_images
        acc = types.SimpleNamespace(is_main_process=rank == 0, wait_for_everyone=dist.barrier)
        n = make_missing(_opts(Path(root)), planned, acc, LOG)
        queue.put((rank, n, len(planned), len(to_make(planned))))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_main_makes_all_see_them(folders):
    """The main process makes the 2 images, the other makes none, and when make_missing returns
    in either process every planned file exists and decodes (the barrier)."""
    import functools

    from tests.helpers import run_with_one_spawned_process

    got = run_with_one_spawned_process(functools.partial(_two_process_worker, str(folders)), 240)
    assert sorted(got) == [(0, 2, 2, 0), (1, 0, 2, 0)]
