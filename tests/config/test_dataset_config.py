"""The dataset config: every key, its resolution order, errors naming file/table/key, caption and
image augmentation keyed to the sample, several datasets, and end-to-end LoRA runs from a TOML."""
import logging
import os
import random

import pytest
import torch
from PIL import Image

from library.config import dataset_config as dc
from library.config.parse import parse_args
from library.data.folders import process_caption
from library.config.dataset_config import CaptionOptions
from library.errors import DataError
from library.data.training_data import build_training_set
from tests.conftest import read
from tools.make_sample_dataset import make_sample_dataset

LOG = logging.getLogger("test_dataset_config")


def _folder(root, n=2, size=64, name="imgs"):
    """A plain image folder (a subset's image_dir) with n images and captions."""
    folder = os.path.join(str(root), name)
    os.makedirs(folder, exist_ok=True)
    src = make_sample_dataset(os.path.join(str(root), "_src_" + name), n_images=n, size=size, repeats=1)
    for f in sorted(os.listdir(src)):
        os.replace(os.path.join(src, f), os.path.join(folder, f))
    return folder


def _opts(tmp_path, toml_text, *extra):
    cfg = tmp_path / "run.toml"
    cfg.write_text("pretrained_model_name_or_path = \"tiny-sd15\"\nmax_train_steps = 1\n"
                   "dry_run = true\n" + toml_text)
    return parse_args("train_lora", ["--config", str(cfg), *map(str, extra)])


def _q(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return str(v)


# key -> (general, dataset, subset, run option on the command line or None)
SUBSET_CASES = {
    "num_repeats": (2, 3, 4, None),
    "caption_extension": (".g", ".d", ".s", ".txt"),
    "class_tokens": ("g", "d", "s", None),
    "keep_tokens": (1, 2, 3, 4),
    "keep_tokens_separator": ("|", "||", "|||", "#"),
    "shuffle_caption": (True, False, True, True),
    "caption_separator": (";", ":", "/", "."),
    "caption_prefix": ("pg", "pd", "ps", "pr"),
    "caption_suffix": ("sg", "sd", "ss", "sr"),
    "caption_dropout_rate": (0.1, 0.2, 0.3, 0.4),
    "caption_dropout_every_n_epochs": (1, 2, 3, 4),
    "caption_tag_dropout_rate": (0.1, 0.2, 0.3, 0.4),
    "flip_aug": (True, False, True, True),
    "random_crop": (True, False, True, True),
    "color_aug": (True, False, True, True),
    "alpha_mask": (True, False, True, True),
    "enable_wildcard": (True, False, True, True),
    "secondary_separator": (";;", "::", "//", "##"),
    "token_warmup_min": (2, 3, 4, 5),
    "token_warmup_step": (10, 0.5, 20, 30),
}


def _subset_value(sub, key):
    return getattr(sub.captions, key) if key in dc.CAPTION_FIELDS else getattr(sub, key)


def test_every_subset_key_is_covered():
    # metadata_file (fine-tuning subsets): tests/training/test_finetune_e2e.py; conditioning_data_dir
    # (subset only, masked loss): tests/training/test_masked_loss.py; custom_attributes (a table,
    # no run option): test_custom_attributes below
    assert set(SUBSET_CASES) | {"image_dir", "is_reg", "metadata_file", "conditioning_data_dir",
                                "custom_attributes"} == set(dc.SUBSET_KEYS)


def test_custom_attributes(tmp_path):
    """sd-scripts' custom_attributes: a table, inherited whole (subset -> dataset -> [general]);
    diff_output_preservation is the one key sd-scripts reads, any other is an error naming it."""
    f = _folder(tmp_path)
    text = ("[general]\nresolution = 64\ncustom_attributes = {diff_output_preservation = true}\n"
            f"[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"{f}\"\n"
            f"[[datasets.subsets]]\nimage_dir = \"{f}\"\ncustom_attributes = {{}}\n")
    opts = _opts(tmp_path, text)
    subs = dc.resolve_dataset_config(opts.dataset_config, None, opts)[0].subsets
    assert [s.custom_attributes for s in subs] == [{"diff_output_preservation": True}, {}]
    head = f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = \"{f}\"\n"
    assert _error(tmp_path, head + "custom_attributes = {preserve = true}\n") == (
        "datasets[0].subsets[0].custom_attributes.preserve: unknown attribute (sd-scripts reads "
        "only diff_output_preservation; another key would have no effect)")
    assert _error(tmp_path, head + "custom_attributes = {diff_output_preservation = 1}\n") == (
        "datasets[0].subsets[0].custom_attributes.diff_output_preservation: expected a boolean "
        "(true/false), got an integer (1)")
    assert _error(tmp_path, head + "custom_attributes = true\n") == (
        "datasets[0].subsets[0].custom_attributes: expected a table (e.g. "
        "{diff_output_preservation = true}), got a boolean (True)")


def test_subset_only_keys(tmp_path):
    """image_dir and is_reg belong to one subset (sd-scripts' "distinct" keys): not inherited."""
    f = _folder(tmp_path)
    text = f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = \"{f}\"\nis_reg = true\n" \
           f"[[datasets.subsets]]\nimage_dir = \"{f}\"\n"
    opts = _opts(tmp_path, text)
    subs = dc.resolve_dataset_config(opts.dataset_config, None, opts)[0].subsets
    assert [s.is_reg for s in subs] == [True, False] and subs[0].image_dir == f
    for level in ("[general]\n", "[[datasets]]\nresolution = 64\n"):
        for line in ("is_reg = true", f"image_dir = \"{f}\""):
            key = line.split(" =")[0]
            table = "general" if level.startswith("[general]") else "datasets[0]"
            body = level + line + "\n" + ("" if level.startswith("[[") else "[[datasets]]\nresolution = 64\n")
            assert _error(tmp_path, body + f"[[datasets.subsets]]\nimage_dir = \"{f}\"\n") == \
                f"{table}.{key}: is a subset key: put it in a [[datasets.subsets]] table"


@pytest.mark.parametrize("key", sorted(SUBSET_CASES))
def test_subset_key_resolution_order(tmp_path, key):
    g, d, s, run = SUBSET_CASES[key]
    folder = _folder(tmp_path)
    text = (f"[general]\n{key} = {_q(g)}\nresolution = 64\n"
            f"[[datasets]]\n{key} = {_q(d)}\n"
            f"[[datasets.subsets]]\nimage_dir = \"{folder}\"\n{key} = {_q(s)}\n"
            f"[[datasets.subsets]]\nimage_dir = \"{folder}\"\n"
            f"[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"{folder}\"\n")
    opts = _opts(tmp_path, text)
    ds = dc.resolve_dataset_config(opts.dataset_config, opts.dataset_config_path, opts)
    got = [_subset_value(ds[0].subsets[0], key), _subset_value(ds[0].subsets[1], key),
           _subset_value(ds[1].subsets[0], key)]
    assert got == [s, d, g]  # subset -> dataset -> [general]

    # nothing in the file: the run option of the same name, else the default
    text = f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = \"{folder}\"\n"
    extra = [] if run is None else [f"--{key}", run]
    opts = _opts(tmp_path, text, *extra)
    sub = dc.resolve_dataset_config(opts.dataset_config, opts.dataset_config_path, opts)[0].subsets[0]
    assert _subset_value(sub, key) == (run if run is not None else dc.SUBSET_KEYS[key][1])


DATASET_CASES = {  # key -> (general, dataset, run option or None, expected run value)
    "resolution": (64, [128, 64], "96", (96, 96)),
    "batch_size": (2, 3, None, None),
    "enable_bucket": (True, False, "true", True),
    "min_bucket_reso": (64, 128, "128", 128),
    "max_bucket_reso": (512, 256, "768", 768),
    "bucket_reso_steps": (32, 64, "16", 16),
    "bucket_no_upscale": (True, False, "true", True),
    "network_multiplier": (0.5, -1.0, "0.25", 0.25),
}


def test_every_dataset_key_is_covered():
    assert set(DATASET_CASES) == set(dc.DATASET_KEYS)


@pytest.mark.parametrize("key", sorted(DATASET_CASES))
def test_dataset_key_resolution_order(tmp_path, key):
    g, d, run, run_expected = DATASET_CASES[key]
    folder = _folder(tmp_path)
    res = "" if key == "resolution" else "resolution = 64\n"
    text = (f"[general]\n{key} = {_q(g)}\n{res}"
            f"[[datasets]]\n{key} = {_q(d)}\n[[datasets.subsets]]\nimage_dir = \"{folder}\"\n"
            f"[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"{folder}\"\n")
    opts = _opts(tmp_path, text)
    ds = dc.resolve_dataset_config(opts.dataset_config, opts.dataset_config_path, opts)
    norm = (lambda v: tuple(v) if isinstance(v, list) else (v, v)) if key == "resolution" else (lambda v: v)
    assert [getattr(ds[0], key), getattr(ds[1], key)] == [norm(d), norm(g)]

    text = f"[[datasets]]\n{res}[[datasets.subsets]]\nimage_dir = \"{folder}\"\n"
    if key == "batch_size":  # falls back to train_batch_size
        opts = _opts(tmp_path, text, "--train_batch_size", "5")
        expected = 5
    else:
        opts = _opts(tmp_path, text, f"--{key}", run)
        expected = run_expected
    assert getattr(dc.resolve_dataset_config(opts.dataset_config, None, opts)[0], key) == expected


def _error(tmp_path, text, *extra) -> str:
    opts = _opts(tmp_path, text, *extra)
    with pytest.raises(DataError) as e:
        build_training_set(opts, LOG)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(tmp_path / "run.toml") + ": ")
    return msg[len(str(tmp_path / "run.toml")) + 2:]


def test_errors_name_file_table_and_key(tmp_path):
    f = _folder(tmp_path)
    head = f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = \"{f}\"\n"
    assert _error(tmp_path, head + f"[[datasets.subsets]]\nimage_dir = \"{f}\"\nnum_repeat = 2\n") == \
        "datasets[0].subsets[1]: unknown key 'num_repeat'; did you mean num_repeats?"
    assert _error(tmp_path, "[general]\nshufle_caption = true\n" + head) == \
        "general: unknown key 'shufle_caption'; did you mean shuffle_caption?"
    assert _error(tmp_path, f"[[datasets]]\nresolution = 64\nflipaug = true\n[[datasets.subsets]]\n"
                            f"image_dir = \"{f}\"\n") == \
        "datasets[0]: unknown key 'flipaug'; did you mean flip_aug?"
    assert _error(tmp_path, head + "num_repeats = \"3\"\n") == \
        "datasets[0].subsets[0].num_repeats: expected an integer, got a string ('3')"
    assert _error(tmp_path, head + "flip_aug = 1\n") == \
        "datasets[0].subsets[0].flip_aug: expected a boolean (true/false), got an integer (1)"
    assert _error(tmp_path, head + "caption_dropout_rate = 1.5\n") == \
        "datasets[0].subsets[0].caption_dropout_rate: expected a number in [0, 1], got a number (1.5)"
    assert _error(tmp_path, head + "num_repeats = 0\n") == \
        "datasets[0].subsets[0].num_repeats: 0 is out of range: must be >= 1"
    assert _error(tmp_path, head + "resolution = 128\n") == \
        "datasets[0].subsets[0].resolution: is a dataset key: put it in its [[datasets]] table or in [general]"
    assert _error(tmp_path, f"[[datasets]]\nresolution = 0\n[[datasets.subsets]]\nimage_dir = \"{f}\"\n") \
        .startswith("datasets[0].resolution: 0x0: width and height must be positive")
    assert _error(tmp_path, "[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nnum_repeats = 2\n") == \
        "datasets[0].subsets[0].image_dir: is required (the folder of this subset's images)"
    missing = tmp_path / "nope"
    assert _error(tmp_path, f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = \"{missing}\"\n") == \
        f"datasets[0].subsets[0].image_dir: folder '{missing}' does not exist or is not a directory"
    assert _error(tmp_path, f"[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"{f}\"\n") == \
        "datasets[0].resolution: is not set (in this dataset, in [general] or as the run option resolution)"
    assert _error(tmp_path, "[[datasets]]\nresolution = 64\n") == \
        "datasets[0]: has no [[datasets.subsets]] table (each subset names an image_dir)"
    msg = _error(tmp_path, head + "metadata_file = \"meta.json\"\n")
    assert msg == "datasets[0].subsets[0].metadata_file: file 'meta.json' does not exist"
    assert _error(tmp_path, "[general]\nmetadata_file = \"meta.json\"\n" + head).startswith(
        "general.metadata_file: is a subset key")
    assert _error(tmp_path, head + "face_crop_aug_range = [0.2, 0.5]\n").startswith(
        "datasets[0].subsets[0].face_crop_aug_range: not supported yet")
    _opts(tmp_path, head + "cache_info = false\n")  # the off value is accepted
    build_training_set(_opts(tmp_path, head + "cache_info = false\ncaption_extention = \".caption\"\n"), LOG)
    # differing batch sizes cannot be honoured under the step contract
    msg = _error(tmp_path, head.replace("resolution = 64\n", "resolution = 64\nbatch_size = 2\n")
                 + f"[[datasets]]\nresolution = 64\nbatch_size = 3\n[[datasets.subsets]]\nimage_dir = \"{f}\"\n")
    assert msg.startswith("datasets have different batch_size (datasets[0]: 2, datasets[1]: 3)")
    # bucket settings are checked per dataset
    assert _error(tmp_path, head.replace("resolution = 64\n", "resolution = 64\nenable_bucket = true\n"
                                         "min_bucket_reso = 128\n")).startswith(
        "datasets[0]: --min_bucket_reso (128) must not exceed the resolution's short side (64)")


def test_image_dir_holding_concept_folders_gets_a_hint(tmp_path):
    root = tmp_path / "train"
    make_sample_dataset(str(root), n_images=1, size=64, repeats=2)
    msg = _error(tmp_path, f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = \"{root}\"\n")
    assert msg.startswith("datasets[0].subsets[0].image_dir: ") and "holds N_concept folders (2_sks shape" in msg


def test_cli_error_is_one_line_exit_2(tmp_path, run_script):
    f = _folder(tmp_path)
    ds = tmp_path / "ds.toml"
    ds.write_text(f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = \"{f}\"\nkeep_token = 1\n")
    rc, _, err = run_script("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15",
                                           "--dataset_config", ds, "--output_dir", tmp_path / "o",
                                           "--max_train_steps", "1"])
    assert rc == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert lines == [f"error: {ds}: datasets[0].subsets[0]: unknown key 'keep_token'; did you mean keep_tokens?"]


# ---- caption processing (sd-scripts' process_caption) ----------------------------------------

def test_process_caption_rules():
    rng = random.Random(0)
    o = CaptionOptions
    assert process_caption("a, b", o(caption_prefix="pre", caption_suffix="post"), 1, rng) == "pre a, b post"
    assert process_caption("a, b", o(caption_dropout_rate=1.0), 1, rng) == ""
    assert process_caption("a, b", o(caption_dropout_every_n_epochs=2), 2, rng) == ""
    assert process_caption("a, b", o(caption_dropout_every_n_epochs=2), 3, rng) == "a, b"
    # tag dropout drops every flexible tag at rate 1, never the kept ones
    assert process_caption("k1, k2, x, y", o(keep_tokens=2, caption_tag_dropout_rate=1.0), 1, rng) == "k1, k2"
    # keep_tokens_separator: fixed head and fixed tail, flexible middle
    cap = "head1, head2 ||| m1, m2, m3, m4 ||| tail"
    seen = set()
    for seed in range(40):
        out = process_caption(cap, o(shuffle_caption=True, keep_tokens_separator="|||"), 1, random.Random(seed))
        parts = out.split(", ")
        assert parts[:2] == ["head1", "head2"] and parts[-1] == "tail"
        assert sorted(parts[2:-1]) == ["m1", "m2", "m3", "m4"]
        seen.add(tuple(parts[2:-1]))
    assert len(seen) > 5  # it really shuffles
    # a custom separator splits, the join is ", " (as sd-scripts)
    assert process_caption("a;b", o(caption_separator=";", caption_tag_dropout_rate=0.0, shuffle_caption=True),
                           1, random.Random(1)) in ("a, b", "b, a")


def _tset(tmp_path, extra_toml, *extra_args, n=3):
    f = _folder(tmp_path, n=n)
    for i, name in enumerate(sorted(x for x in os.listdir(f) if x.endswith(".caption"))):
        (tmp_path / "imgs" / name).write_text(f"t0, t1, t2, t3, t4, t5 {i}")
    opts = _opts(tmp_path, f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = \"{f}\"\n"
                 f"num_repeats = 4\n{extra_toml}", *extra_args)
    return build_training_set(opts, LOG)


def test_caption_and_flip_augmentation_is_keyed_to_seed_epoch_and_sample(tmp_path):
    ts = _tset(tmp_path, "shuffle_caption = true\nkeep_tokens = 1\nflip_aug = true\n")
    n = len(ts.samples)
    assert n == 12
    e1 = [ts.caption(i, 1) for i in range(n)]
    assert e1 == [ts.caption(i, 1) for i in reversed(range(n))][::-1]  # no hidden state: order-free
    assert all(c.startswith("t0, ") for c in e1)
    assert e1 != [ts.caption(i, 2) for i in range(n)]  # another epoch, another shuffle
    assert len({c for c in e1 if c.endswith("0") or "0," in c}) > 1  # repeats of one image differ
    flips = [ts.flip(i, 1) for i in range(n)]
    assert 0 < sum(flips) < n and flips == [ts.flip(i, 1) for i in range(n)]
    # a flipped sample's pixels are the mirror of the unflipped preparation
    i = flips.index(True)
    p = ts.prepare(i, 1)
    from library.data.images import load_image, prepare_image

    s = ts.samples[i]
    plain = prepare_image(load_image(s.path), s.bucket, s.resized_size)
    assert torch.equal(p.pixels, torch.flip(plain.pixels, dims=[2]))
    # the same config with another seed draws differently
    ts2 = _tset(tmp_path, "shuffle_caption = true\nkeep_tokens = 1\nflip_aug = true\n", "--seed", "7")
    assert [ts2.caption(i, 1) for i in range(n)] != e1


def test_random_crop_is_per_sample_and_not_cacheable(tmp_path):
    f = _folder(tmp_path, n=1, size=64)
    Image.new("RGB", (128, 64), (10, 200, 10)).save(os.path.join(f, "wide.png"))
    opts = _opts(tmp_path, f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = \"{f}\"\n"
                 "num_repeats = 8\nrandom_crop = true\n")
    ts = build_training_set(opts, LOG)
    wide = [i for i, s in enumerate(ts.samples) if s.path.endswith("wide.png")]
    crops = {ts.prepare(i, 1).crop_top_left for i in wide}
    assert len(crops) > 1 and ts.prepare(wide[3], 1).crop_top_left == ts.prepare(wide[3], 1).crop_top_left
    opts = _opts(tmp_path, f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = \"{f}\"\n"
                 "random_crop = true\n", "--cache_latents")
    with pytest.raises(DataError, match="random_crop cannot be combined with cache_latents"):
        build_training_set(opts, LOG)


def test_several_datasets_buckets_reg_balance_and_batch_size(tmp_path, run_script):
    a = _folder(tmp_path, n=2, size=64, name="a")
    b = _folder(tmp_path, n=1, size=128, name="b")
    r = _folder(tmp_path, n=1, size=64, name="reg")
    text = (f"[general]\nbatch_size = 2\n"
            f"[[datasets]]\nresolution = 64\n"
            f"[[datasets.subsets]]\nimage_dir = \"{a}\"\nnum_repeats = 3\n"
            f"[[datasets.subsets]]\nimage_dir = \"{r}\"\nis_reg = true\n"
            f"[[datasets]]\nresolution = 128\n[[datasets.subsets]]\nimage_dir = \"{b}\"\nnum_repeats = 2\n")
    opts = _opts(tmp_path, text)
    ts = build_training_set(opts, LOG)
    # dataset 0: 6 train samples, reg balanced within it to 6; dataset 1: 2 samples at 128 px
    assert ts.bucket_sizes() == {(64, 64): 12, (128, 128): 2}
    assert ts.reg_samples == 6 and ts.repeats_total == 8 and ts.batch_size == 2
    cfg = tmp_path / "run.toml"
    rc, out, err = run_script("train_lora", ["--config", cfg, "--train_batch_size", "1"])
    assert rc == 0, err
    # the dataset's batch_size is the per-process batch: ceil(12/2) + ceil(2/2) steps per epoch
    assert "train_batch_size: 2" in out and "steps_per_epoch: 7" in out


# ---- end to end ------------------------------------------------------------------------------

def _train_args(tmp_path, out, *extra):
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--output_dir", tmp_path / out,
            "--max_train_steps", "2", "--learning_rate", "1e-3", "--optimizer_type", "SGDNesterov",
            "--network_dim", "2", *extra]


def test_dataset_toml_equals_the_folder_convention(tmp_path, dataset, train):
    """A subset per N_concept folder (num_repeats, class_tokens) is the same training set, so the
    same weights; the dataset config's caption and flip settings then change them."""
    folder = os.path.join(dataset, "2_sks shape")
    rc, _, err, _ = train("train_lora", _train_args(tmp_path, "a", "--train_data_dir", dataset,
                                                    "--resolution", "64"))
    assert rc == 0, err
    ds = tmp_path / "ds.toml"
    ds.write_text(f"[general]\nresolution = 64\n[[datasets]]\n[[datasets.subsets]]\n"
                  f"image_dir = \"{folder}\"\nnum_repeats = 2\nclass_tokens = \"sks shape\"\n")
    rc, out, err, run = train("train_lora", _train_args(tmp_path, "b", "--dataset_config", ds))
    assert rc == 0, err
    assert "samples_per_epoch: 4" in out
    a, _ = read(tmp_path / "a" / "last.safetensors")
    b, _ = read(tmp_path / "b" / "last.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    ds.write_text(f"[general]\nresolution = 64\nflip_aug = true\ncaption_prefix = \"photo of\"\n"
                  f"[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"{folder}\"\nnum_repeats = 2\n"
                  "shuffle_caption = true\n")
    rc, _, err, run = train("train_lora", _train_args(tmp_path, "c", "--dataset_config", ds, "--cache_latents"))
    assert rc == 0, err
    caps = [run.tset.caption(i, 1) for i in range(4)]
    # the prefix joins the caption before the shuffle (sd-scripts' order): keep_tokens pins it
    assert all("photo of sks shape" in c for c in caps)
    assert {c.startswith("photo of") for c in caps} == {True, False}
    c, _ = read(tmp_path / "c" / "last.safetensors")
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert len(run.parts.caches.latents) == 4  # 2 images x (plain, mirrored)
    # the cached run picks the variant the uncached run flips: the same weights
    rc, _, err, _ = train("train_lora", _train_args(tmp_path, "d", "--dataset_config", ds))
    assert rc == 0, err
    d, _ = read(tmp_path / "d" / "last.safetensors")
    assert all(torch.allclose(c[k], d[k], rtol=1e-4, atol=1e-6) for k in c)
