"""Atomic saves: the old file survives a failed write; new files get ordinary permissions."""
import os
import stat

import pytest

from library.files import atomic_dir, atomic_path, output_file


def test_failed_write_keeps_the_previous_file(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"good")
    with pytest.raises(RuntimeError):
        with atomic_path(str(target)) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise RuntimeError("crash mid-write")
    assert target.read_bytes() == b"good"
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no stray temp file


def test_successful_write_replaces_and_respects_umask(tmp_path):
    target = tmp_path / "sub" / "model.safetensors"
    old = os.umask(0o022)
    try:
        with atomic_path(str(target)) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"new")
        with atomic_dir(str(tmp_path / "folder")) as d:
            with open(os.path.join(d, "x"), "w") as f:
                f.write("x")
    finally:
        os.umask(old)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "folder").st_mode) == 0o755


def test_failed_folder_write_keeps_the_previous_folder(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "a").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(str(target)) as d:
            (open(os.path.join(d, "a"), "w")).close()
            raise RuntimeError("crash")
    assert (target / "a").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_output_names_follow_sd_scripts():
    assert output_file("o", "last", ".safetensors") == os.path.join("o", "last.safetensors")
    assert output_file("o", "x", ".safetensors", epoch=1) == os.path.join("o", "x-000001.safetensors")
    assert output_file("o", "x", ".ckpt", step=100) == os.path.join("o", "x-step00000100.ckpt")
