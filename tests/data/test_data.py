import logging
import os
import subprocess
import sys

import pytest
from PIL import Image

from library.data.folders import ImageItem, balance_regularization, expand_repeats, parse_concept_dir_name, scan_concept_dirs
from library.errors import DataError
from tools.make_sample_dataset import make_sample_dataset

LOG = "library.data.folders"


def _img(path, size=(32, 24), colour=(200, 10, 10), fmt=None, exif_orientation=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    img = Image.new("RGB", size, colour)
    kwargs = {}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kwargs["exif"] = exif
    img.save(path, format=fmt, **kwargs)
    return path


def _cap(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def test_folder_convention_repeats_class_tokens_and_captions(tmp_path):
    root = tmp_path / "train"
    _img(str(root / "10_sks dog" / "b.png"))
    _img(str(root / "10_sks dog" / "a.JPG"), fmt="JPEG")
    _img(str(root / "10_sks dog" / "c.webp"), fmt="WEBP")
    _img(str(root / "10_sks dog" / "d.bmp"), fmt="BMP")
    (root / "10_sks dog" / "notes.txt").write_text("not an image")
    _cap(str(root / "10_sks dog" / "b.caption"), "first line  \nsecond line\n")
    _cap(str(root / "10_sks dog" / "a.caption"), "photo of sks dog")
    _cap(str(root / "10_sks dog" / "c.caption"), "c cap")
    _cap(str(root / "10_sks dog" / "d.caption"), "d cap")
    _img(str(root / "2_my_style" / "x.jpeg"), fmt="JPEG")
    _cap(str(root / "2_my_style" / "x.txt"), "custom extension")

    items = scan_concept_dirs(str(root), caption_extension=".caption")
    names = [os.path.basename(i.path) for i in items]
    assert names == ["a.JPG", "b.png", "c.webp", "d.bmp", "x.jpeg"]  # folder, then file order
    a, b = items[0], items[1]
    assert (a.num_repeats, a.class_tokens, a.caption, a.is_reg) == (10, "sks dog", "photo of sks dog", False)
    assert b.caption == "first line"  # sd-scripts reads the first line only, stripped
    assert a.size == (32, 24) and a.bucket is None
    x = items[-1]
    assert (x.num_repeats, x.class_tokens) == (2, "my_style")  # rest joined back with "_"

    items_txt = scan_concept_dirs(str(root), caption_extension=".txt")
    assert items_txt[-1].caption == "custom extension"


def test_missing_caption_falls_back_to_class_tokens_with_one_warning(tmp_path, caplog):
    root = tmp_path / "train"
    for n in "abc":
        _img(str(root / "3_sks cat" / f"{n}.png"))
    _cap(str(root / "3_sks cat" / "a.caption"), "has caption")
    _cap(str(root / "3_sks cat" / "b.caption"), "   \n")  # blank counts as missing
    with caplog.at_level(logging.WARNING, logger=LOG):
        items = scan_concept_dirs(str(root))
    assert [i.caption for i in items] == ["has caption", "sks cat", "sks cat"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "2 image(s)" in warnings[0] and "3_sks cat" in warnings[0] and "sks cat" in warnings[0]


def test_exif_orientation_swaps_size(tmp_path):
    root = tmp_path / "train"
    _img(str(root / "1_x" / "r.jpg"), size=(40, 16), fmt="JPEG", exif_orientation=6)
    (item,) = scan_concept_dirs(str(root))
    assert item.size == (16, 40)


def test_badly_named_folders_are_skipped_with_warning(tmp_path, caplog):
    root = tmp_path / "train"
    _img(str(root / "5_ok" / "a.png"))
    _img(str(root / "dog" / "a.png"))
    _img(str(root / "0_zero" / "a.png"))
    os.makedirs(root / "4_empty")
    with caplog.at_level(logging.WARNING, logger=LOG):
        items = scan_concept_dirs(str(root))
    assert [os.path.basename(os.path.dirname(i.path)) for i in items] == ["5_ok"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "dog" in text and "0_zero" in text and "4_empty" in text


def test_no_concept_folders_is_one_line_error(tmp_path):
    root = tmp_path / "train"
    _img(str(root / "dog" / "a.png"))
    _img(str(root / "loose.png"))
    with pytest.raises(DataError) as e:
        scan_concept_dirs(str(root))
    msg = str(e.value)
    assert "\n" not in msg and str(root) in msg and "train_data_dir" in msg and "10_sks dog" in msg


def test_missing_root_and_reg_option_named(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(DataError, match="train_data_dir.*nope"):
        scan_concept_dirs(missing)
    with pytest.raises(DataError, match="reg_data_dir.*nope"):
        scan_concept_dirs(missing, is_reg=True)


def test_only_empty_folders_is_error(tmp_path):
    os.makedirs(tmp_path / "train" / "3_a")
    with pytest.raises(DataError, match="no usable images"):
        scan_concept_dirs(str(tmp_path / "train"))


def test_corrupt_images_are_skipped_with_a_warning_naming_each(tmp_path, caplog):
    folder = tmp_path / "train" / "2_c"
    good = _img(str(folder / "good.png"), size=(64, 64))
    (folder / "random.png").write_bytes(os.urandom(500))
    (folder / "empty.jpg").write_bytes(b"")
    # a real PNG of noise, cut in half: the header parses, the pixel data does not
    noise = Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3))
    noise.save(folder / "full.png")
    data = (folder / "full.png").read_bytes()
    (folder / "truncated.png").write_bytes(data[: len(data) // 2])
    os.remove(folder / "full.png")
    with caplog.at_level(logging.WARNING, logger=LOG):
        items = scan_concept_dirs(str(tmp_path / "train"))
    assert [i.path for i in items] == [good]
    per_file = [r.getMessage() for r in caplog.records if "skipping image" in r.getMessage()]
    assert len(per_file) == 3
    for name in ("random.png", "empty.jpg", "truncated.png"):
        assert sum(name in m for m in per_file) == 1
    assert all("\n" not in m for m in per_file)


def test_all_images_corrupt_is_error(tmp_path):
    folder = tmp_path / "train" / "2_c"
    os.makedirs(folder)
    (folder / "bad.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(DataError, match="no usable images.*1 skipped"):
        scan_concept_dirs(str(tmp_path / "train"))


def test_non_utf8_caption_is_error_naming_file(tmp_path):
    folder = tmp_path / "train" / "1_a"
    _img(str(folder / "a.png"))
    (folder / "a.caption").write_bytes(b"\xff\xfe\xfa caption")
    with pytest.raises(DataError, match="a.caption"):
        scan_concept_dirs(str(tmp_path / "train"))


def test_parse_concept_dir_name():
    assert parse_concept_dir_name("10_sks dog") == (10, "sks dog")
    assert parse_concept_dir_name("3") == (3, None)
    assert parse_concept_dir_name("x_3") is None


def _items(repeats, is_reg=False, tag="t"):
    return [ImageItem(path=f"{tag}{i}.png", caption="", num_repeats=r, is_reg=is_reg,
                      class_tokens=None, size=(8, 8)) for i, r in enumerate(repeats)]


def test_balance_regularization_matches_sd_scripts_rule():
    # train 2 x 10 = 20; reg 3 x 1: first pass n=3, then +1 each in turn until n=20:
    # 17 more = 5 full rounds + 2 -> repeats 7, 7, 6
    train = _items([10, 10])
    reg = _items([1, 1, 1], True, "r")
    out = balance_regularization(train, reg)
    assert [i.num_repeats for i in out] == [7, 7, 6]
    assert [i.num_repeats for i in reg] == [1, 1, 1]  # inputs untouched
    assert all(i.is_reg for i in out)

    # train 5 x 1 = 5; reg 4 x 3: first pass stops at n=6 after two images -> two used, 6 > 5
    out = balance_regularization(_items([1] * 5), _items([3, 3, 3, 3], True, "r"))
    assert [(i.path, i.num_repeats) for i in out] == [("r0.png", 3), ("r1.png", 3)]

    # exact fit in the first pass: train 4, reg 2 x 2
    assert [i.num_repeats for i in balance_regularization(_items([4]), _items([2, 2], True))] == [2, 2]
    assert balance_regularization(_items([4]), []) == []


def test_expand_repeats_order():
    a, b = _items([2, 3])
    assert [i.path for i in expand_repeats([a, b])] == ["t0.png"] * 2 + ["t1.png"] * 3


def test_sample_dataset_is_deterministic_and_scannable(tmp_path):
    f1 = make_sample_dataset(str(tmp_path / "d1"), n_images=3, size=48, repeats=2)
    f2 = make_sample_dataset(str(tmp_path / "d2"), n_images=3, size=48, repeats=2)
    for name in sorted(os.listdir(f1)):
        assert (open(os.path.join(f1, name), "rb").read() == open(os.path.join(f2, name), "rb").read())
    items = scan_concept_dirs(str(tmp_path / "d1"))
    assert len(items) == 3 and all(i.num_repeats == 2 and i.size == (48, 48) for i in items)
    assert all(i.caption.startswith("sks shape, a ") for i in items)
    assert len({open(i.path, "rb").read() for i in items}) == 3  # images differ


def test_sample_dataset_cli(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(repo, "tools", "make_sample_dataset.py"),
                        "--out", str(tmp_path / "d"), "--images", "2", "--size", "32"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "d" / "5_sks shape")) == [
        "shape_00.caption", "shape_00.png", "shape_01.caption", "shape_01.png"]


def test_data_module_imports_no_torch():
    code = "import sys, library.data.folders; assert 'torch' not in sys.modules, 'torch imported'"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ---- bad input: each case handled deliberately -------------------------------------------------

def _opts_for(root, *extra):
    from library.config.parse import parse_args

    return parse_args("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir",
                                     str(root), "--resolution", "64", "--max_train_steps", "1",
                                     "--dry_run", *map(str, extra)])


def test_image_modes_and_exif_rotation_are_converted(tmp_path):
    """CMYK, 16-bit grey, palette, RGBA and an EXIF-rotated JPEG are all used, as RGB, and the
    rotated one is bucketed by its displayed (rotated) size."""
    import numpy as np
    import torch

    from library.data.training_data import build_training_set

    folder = tmp_path / "train" / "1_x"
    os.makedirs(folder)
    Image.new("CMYK", (64, 64), (0, 255, 255, 0)).save(folder / "cmyk.jpg", quality=100)
    Image.fromarray(np.full((64, 64), 40000, dtype=np.uint16)).save(folder / "grey16.png")
    pal = Image.new("P", (64, 64), 1)
    pal.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    pal.save(folder / "palette.png")
    Image.new("RGBA", (64, 64), (255, 0, 0, 128)).save(folder / "rgba.png")
    _img(str(folder / "rotated.jpg"), size=(128, 64), fmt="JPEG", exif_orientation=6)
    ts = build_training_set(_opts_for(tmp_path / "train", "--enable_bucket", "--min_bucket_reso", "32",
                                      "--max_bucket_reso", "128", "--bucket_reso_steps", "32"),
                            logging.getLogger(LOG))
    by_name = {os.path.basename(s.path): i for i, s in enumerate(ts.samples)}
    assert sorted(by_name) == ["cmyk.jpg", "grey16.png", "palette.png", "rgba.png", "rotated.jpg"]
    rot = ts.samples[by_name["rotated.jpg"]]
    assert rot.size == (64, 128) and rot.bucket[0] < rot.bucket[1]  # portrait after rotation
    for name, i in by_name.items():
        p = ts.prepare(i, 1)
        w, h = ts.samples[i].bucket
        assert p.pixels.shape == (3, h, w) and torch.isfinite(p.pixels).all(), name
    px = lambda name: tuple(int(round((float(v) + 1) * 127.5)) for v in ts.prepare(by_name[name], 1).pixels[:, 8, 8])
    r, g, b = px("cmyk.jpg")
    assert r > 200 and g < 60 and b < 60
    assert px("palette.png") == (10, 200, 30)
    assert abs(px("grey16.png")[0] - round(40000 / 65535 * 255)) <= 1
    r, g, b = px("rgba.png")  # half-transparent red over white
    assert r == 255 and abs(g - 127) <= 1 and abs(b - 127) <= 1


def test_small_images_are_upscaled_or_skipped_and_skips_are_counted(tmp_path, caplog):
    from library.data.training_data import build_training_set

    folder = tmp_path / "train" / "1_x"
    _img(str(folder / "big.png"), size=(128, 128))
    _img(str(folder / "tiny.png"), size=(16, 16))
    (folder / "zero.png").write_bytes(b"")
    log = logging.getLogger(LOG)
    with caplog.at_level(logging.WARNING, logger=LOG):
        ts = build_training_set(_opts_for(tmp_path / "train", "--enable_bucket", "--min_bucket_reso", "64",
                                          "--max_bucket_reso", "128"), log)
    assert len(ts.train_items) == 2  # the tiny one is upscaled to its bucket, as sd-scripts
    msgs = [r.getMessage() for r in caplog.records]
    assert any("1 image(s) are smaller than their bucket and are upscaled" in m and "tiny.png" in m for m in msgs)
    assert msgs[-1] == "skipped 1 image file(s) in total: 1 unreadable"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOG):
        ts = build_training_set(_opts_for(tmp_path / "train", "--enable_bucket", "--bucket_no_upscale",
                                          "--bucket_reso_steps", "32"), log)
    assert [os.path.basename(it.path) for it in ts.train_items] == ["big.png"]
    msgs = [r.getMessage() for r in caplog.records]
    assert any("tiny.png" in m and "smaller than one bucket step" in m for m in msgs)
    assert msgs[-1] == "skipped 2 image file(s) in total: 1 unreadable, 1 too small for any bucket"


def test_same_stem_images_both_used_with_one_warning(tmp_path, caplog):
    folder = tmp_path / "train" / "1_x"
    _img(str(folder / "a.png"))
    _img(str(folder / "a.jpg"), fmt="JPEG")
    _cap(str(folder / "a.caption"), "shared")
    with caplog.at_level(logging.WARNING, logger=LOG):
        items = scan_concept_dirs(str(tmp_path / "train"))
    assert [os.path.basename(i.path) for i in items] == ["a.jpg", "a.png"]
    assert [i.caption for i in items] == ["shared", "shared"]
    warned = [r.getMessage() for r in caplog.records if "share the stem" in r.getMessage()]
    assert len(warned) == 1 and "a.jpg, a.png" in warned[0] and "a.caption" in warned[0]


def test_caption_bom_and_empty_caption(tmp_path):
    folder = tmp_path / "train" / "1_sks"
    _img(str(folder / "a.png"))
    _img(str(folder / "b.png"))
    (folder / "a.caption").write_bytes("\ufeffbom caption".encode("utf-8"))
    (folder / "b.caption").write_bytes(b"")
    items = scan_concept_dirs(str(tmp_path / "train"))
    assert [i.caption for i in items] == ["bom caption", "sks"]  # empty -> class tokens


def test_bad_files_never_give_a_traceback(tmp_path, run_script):
    folder = tmp_path / "train" / "2_x"
    _img(str(folder / "ok.png"), size=(64, 64))
    _img(str(folder / "ok2.jpg"), size=(64, 64), fmt="JPEG")
    data = (folder / "ok2.jpg").read_bytes()
    (folder / "cut.jpg").write_bytes(data[: len(data) // 3])
    (folder / "zero.webp").write_bytes(b"")
    rc, out, err = run_script("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15",
                                             "--train_data_dir", tmp_path / "train", "--resolution", "64",
                                             "--max_train_steps", "1", "--dry_run"])
    assert rc == 0 and "Traceback" not in err
    assert "images: 2" in out
    assert "cut.jpg" in err and "zero.webp" in err
    assert "skipped 2 image file(s) in total: 2 unreadable" in err
