"""tools/resize_images_to_resolution.py: sizes and names against a float64 computation written
out here, pixels against PIL's own resize and crop, every flag."""
import math
import os

import numpy as np
import pytest
from PIL import Image

from tests.dataset_tools.helpers import error_line, read_text, write_image, write_text
from tools import resize_images_to_resolution as tool


def expected_size(w, h, max_w, max_h, divisible_by):
    """sd-scripts' rule, by hand: scale by sqrt(area ratio) when larger, truncate, then floor each
    side to a multiple of divisible_by. Returns (scaled, cropped)."""
    if w * h > max_w * max_h:
        s = math.sqrt((max_w * max_h) / (w * h))
        w, h = int(w * s), int(h * s)
    return (w, h), (w // divisible_by * divisible_by, h // divisible_by * divisible_by)


def run(argv, capsys):
    rc = tool.main([str(a) for a in argv])
    _, err = capsys.readouterr()
    return rc, err


SIZES = {"wide.png": (301, 97), "tall.PNG": (50, 211), "small.jpg": (40, 30), "alpha.webp": (129, 129)}


@pytest.fixture
def src(tmp_path):
    folder = tmp_path / "src"
    for i, (name, size) in enumerate(SIZES.items()):
        write_image(str(folder / name), size, seed=i, mode="RGBA" if name == "alpha.webp" else "RGB")
    write_text(str(folder / "wide.txt"), "wide caption")
    write_text(str(folder / "wide.caption"), "wide other")
    write_text(str(folder / "readme.md"), "notes")
    os.makedirs(folder / "sub")  # skipped (sd-scripts stops on a folder)
    return folder


@pytest.mark.parametrize("divisible_by", [1, 8])
def test_sizes_names_and_pixels(src, tmp_path, capsys, divisible_by):
    dst = tmp_path / "dst"
    rc, err = run([src, dst, "--max_resolution", "100x100, 64x32", "--divisible_by", divisible_by,
                   "--save_as_png"], capsys)
    assert rc == 0, err
    for name, (w, h) in SIZES.items():
        stem = os.path.splitext(name)[0]
        original = Image.open(src / name).convert("RGB")
        for res, (mw, mh) in [("100x100", (100, 100)), ("64x32", (64, 32))]:
            (sw, sh), (cw, ch) = expected_size(w, h, mw, mh, divisible_by)
            assert cw * ch <= mw * mh
            out = Image.open(dst / f"{stem}+{res}.png")
            assert out.size == (cw, ch), (name, res)
            # PIL's own area resize (BOX) when shrinking, then the centred crop
            ref = original.resize((sw, sh), Image.Resampling.BOX) if (sw, sh) != (w, h) else original
            left, top = (sw - cw) // 2, (sh - ch) // 2
            ref = ref.crop((left, top, left + cw, top + ch))
            assert np.array_equal(np.asarray(out), np.asarray(ref)), (name, res)
    # files that are not images are copied as they are; no associated copies without the flag
    assert read_text(dst / "readme.md") == "notes" and read_text(dst / "wide.txt") == "wide caption"
    assert not any("+" in n and n.endswith((".txt", ".caption")) for n in os.listdir(dst))
    assert not os.path.exists(dst / "sub")


def test_jpg_default_and_associated_files(src, tmp_path, capsys):
    dst = tmp_path / "dst"
    assert run([src, dst, "--max_resolution", "64x64", "--copy_associated_files"], capsys)[0] == 0
    out = Image.open(dst / "wide+64x64.jpg")
    assert out.format == "JPEG" and out.size == expected_size(301, 97, 64, 64, 1)[1]
    assert read_text(dst / "wide+64x64.txt") == "wide caption"
    assert read_text(dst / "wide+64x64.caption") == "wide other"
    # the default resolutions: sd-scripts' four
    dst2 = tmp_path / "dst2"
    assert run([src, dst2], capsys)[0] == 0
    assert sorted(n for n in os.listdir(dst2) if n.startswith("wide+")) == [
        "wide+128x128.jpg", "wide+256x256.jpg", "wide+384x384.jpg", "wide+512x512.jpg"]


@pytest.mark.parametrize("name,method", [("area", Image.Resampling.BOX), ("box", Image.Resampling.BOX),
                                         ("cubic", Image.Resampling.BICUBIC),
                                         ("lanczos4", Image.Resampling.LANCZOS),
                                         ("nearest", Image.Resampling.NEAREST),
                                         ("linear", Image.Resampling.BILINEAR)])
def test_interpolation(tmp_path, capsys, name, method):
    img = write_image(str(tmp_path / "src" / "a.png"), (90, 60), seed=3)
    assert run([tmp_path / "src", tmp_path / "dst", "--max_resolution", "30x20", "--interpolation", name,
                "--save_as_png"], capsys)[0] == 0
    ref = img.resize(expected_size(90, 60, 30, 20, 1)[0], method)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "dst" / "a+30x20.png")), np.asarray(ref))


def test_each_resolution_from_the_original(tmp_path, capsys):
    """sd-scripts resizes each resolution from the previous one's result, so an ascending list
    saves the small image again as the large one; here each comes from the original."""
    write_image(str(tmp_path / "src" / "a.png"), (200, 200), seed=4)
    assert run([tmp_path / "src", tmp_path / "dst", "--max_resolution", "32x32,128x128"], capsys)[0] == 0
    assert Image.open(tmp_path / "dst" / "a+32x32.jpg").size == (32, 32)
    assert Image.open(tmp_path / "dst" / "a+128x128.jpg").size == (128, 128)


def test_bad_input(src, tmp_path, capsys):
    rc, err = run([src, tmp_path / "d", "--max_resolution", "512"], capsys)
    assert rc == 2 and error_line(err) == ("error: --max_resolution '512': '512' is not WxH "
                                           "(e.g. 512x512,384x384)")
    rc, err = run([src, tmp_path / "d", "--divisible_by", "0"], capsys)
    assert rc == 2 and error_line(err) == "error: --divisible_by 0: must be at least 1"
    rc, err = run([src, src], capsys)
    assert rc == 2 and error_line(err) == f"error: dst_img_folder {src} is src_img_folder: give another folder"
    rc, err = run([tmp_path / "none", tmp_path / "d"], capsys)
    assert rc == 2 and error_line(err) == f"error: src_img_folder {tmp_path / 'none'}: no such folder"
    # an unreadable image is named and skipped; the others are written
    (src / "broken.png").write_bytes(b"not a png")
    rc, err = run([src, tmp_path / "d", "--max_resolution", "64x64"], capsys)
    assert rc == 0 and f"skipping image {src / 'broken.png'}: cannot decode it" in err
    assert not os.path.exists(tmp_path / "d" / "broken+64x64.jpg")
    assert os.path.exists(tmp_path / "d" / "wide+64x64.jpg")
