"""tools/check_dataset.py: one line per unreadable or truncated image, caption that is not UTF-8
and group of images with the same bytes; the exact lines are written out here."""
import io
import os
import shutil

import numpy as np
from PIL import Image

from tests.dataset_tools.helpers import error_line, write_image, write_text
from tools import check_dataset


def run(argv, capsys):
    rc = check_dataset.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def truncated(path, fmt):
    pixels = np.random.default_rng(5).integers(0, 256, (48, 48, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    with open(path, "wb") as f:
        f.write(buf.getvalue()[: len(buf.getvalue()) * 2 // 3])


def test_each_problem_is_one_line(tmp_path, capsys):
    root = tmp_path / "img"
    good = root / "10_a"
    write_image(str(good / "ok.png"), (16, 16), seed=1)
    write_text(str(good / "ok.caption"), "caf\u00e9, utf-8 is fine")
    truncated(str(good / "cut.jpg"), "JPEG")
    truncated(str(good / "cut.png"), "PNG")
    (good / "junk.webp").write_bytes(b"this is not an image")
    (good / "latin.caption").write_bytes("caf\xe9".encode("latin-1"))
    other = root / "5_b"
    os.makedirs(other / ".sdcache")
    shutil.copy(good / "ok.png", other / "same.png")
    shutil.copy(good / "ok.png", other / "SAME2.PNG")
    shutil.copy(good / "cut.png", other / ".sdcache" / "hidden.png")  # hidden folders are not checked
    write_image(str(other / "different.png"), (16, 16), seed=2)
    rc, out, err = run([root], capsys)
    assert rc == 1
    lines = out.splitlines()
    # in path order (10_a before 5_b, names sorted), the duplicate groups last
    assert lines[0].startswith(f"image: cannot decode image {good / 'cut.jpg'}: image file is truncated")
    assert lines[1].startswith(f"image: cannot decode image {good / 'cut.png'}: ")
    assert lines[2].startswith(f"image: cannot decode image {good / 'junk.webp'}: cannot identify image file")
    assert lines[3] == (f"caption: caption file {good / 'latin.caption'}: line 1: not UTF-8 text "
                        "(byte 0xe9 at column 4); save the file as UTF-8")
    assert lines[4] == f"duplicate: same image content: {good / 'ok.png'}, {other / 'SAME2.PNG'}, {other / 'same.png'}"
    assert len(lines) == 5 and f"5 problem(s) in {root}" in err


def test_clean_folder_and_missing_folder(tmp_path, capsys):
    write_image(str(tmp_path / "a" / "x.png"), (8, 8), seed=1)
    write_text(str(tmp_path / "a" / "x.txt"), "caf\u00e9")
    (tmp_path / "a" / "y.caption").write_bytes(b"\xff")  # not checked: the extension is .txt here
    rc, out, err = run([tmp_path / "a", "--caption_extension", ".txt"], capsys)
    assert rc == 0 and out == "" and "0 problem(s)" in err
    rc, _, err = run([tmp_path / "none"], capsys)
    assert rc == 2 and error_line(err) == f"error: {tmp_path / 'none'}: no such folder"
