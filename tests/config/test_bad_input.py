"""Bad input gets one clear line naming the option or file, exit status 2, no traceback."""
import os

import pytest


def args(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", "1", *extra]


def one_error_line(err):
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_missing_model_path(dataset, tmp_path, run_script):
    rc, _, err = run_script("train_lora", args(str(tmp_path / "nope" / "model.safetensors"),
                                               dataset, tmp_path / "out"))
    assert rc == 2
    line = one_error_line(err)
    assert "pretrained_model_name_or_path" in line and "model.safetensors" in line


def test_missing_data_dir(tmp_path, run_script):
    rc, _, err = run_script("train_lora", args("tiny-sd15", str(tmp_path / "missing"), tmp_path / "o"))
    assert rc == 2
    assert "train_data_dir" in one_error_line(err)


def test_empty_and_wrongly_named_data_folders(tmp_path, run_script):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run_script("train_lora", args("tiny-sd15", str(empty), tmp_path / "o"))
    assert rc == 2 and "N_concept" in one_error_line(err)
    wrong = tmp_path / "wrong"
    (wrong / "dogs").mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (64, 64)).save(wrong / "dogs" / "a.png")
    rc, _, err = run_script("train_lora", args("tiny-sd15", str(wrong), tmp_path / "o"))
    assert rc == 2 and "N_concept" in one_error_line(err)


def test_corrupt_image_is_skipped_with_a_warning_and_missing_caption_falls_back(
        dataset, tmp_path, run_script):
    folder = os.path.join(dataset, "2_sks shape")
    with open(os.path.join(folder, "broken.png"), "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + os.urandom(200))
    os.remove(os.path.join(folder, "shape_00.caption"))
    rc, out, err = run_script("train_lora", args("tiny-sd15", dataset, tmp_path / "o", "--dry_run"))
    assert rc == 0, err
    assert "broken.png" in err and "Traceback" not in err
    assert "caption" in err  # the fallback to class tokens is announced
    assert "images: 2" in out  # the corrupt file is not counted


def test_all_images_corrupt_is_an_error(tmp_path, run_script):
    folder = tmp_path / "d" / "1_x"
    folder.mkdir(parents=True)
    (folder / "a.png").write_bytes(b"not an image")
    rc, _, err = run_script("train_lora", args("tiny-sd15", str(tmp_path / "d"), tmp_path / "o"))
    assert rc == 2
    one_error_line(err)


@pytest.mark.parametrize("flag,value,needle", [
    ("--network_dimm", "4", "did you mean network_dim"),
    ("--train_batch_size", "0", "train_batch_size"),
    ("--mixed_precision", "fp8", "mixed_precision"),
])
def test_bad_options(dataset, tmp_path, run_script, flag, value, needle):
    rc, _, err = run_script("train_lora", args("tiny-sd15", dataset, tmp_path / "o", flag, value))
    assert rc == 2
    assert needle in one_error_line(err)


def test_bad_network_args_and_optimizer_args(dataset, tmp_path, run_script):
    rc, _, err = run_script("train_lora", args("tiny-sd15", dataset, tmp_path / "o",
                                               "--network_args", "conv_dimm=4"))
    assert rc == 2 and "conv_dimm" in one_error_line(err)
    rc, _, err = run_script("train_lora", args("tiny-sd15", dataset, tmp_path / "o",
                                               "--optimizer_args", "weight_decy=0.1"))
    assert rc == 2 and "weight_decy" in one_error_line(err)
    assert not os.path.exists(tmp_path / "o" / "last.safetensors")


def test_dry_run_imports_no_model_code(dataset, tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The plan comes before any model code is imported; the memory estimate that follows it
    # builds the model on fake tensors (library/training/memory_estimate.py), which needs torch.
    code = ("import sys; from library.run import trainer; real = trainer.print_plan\n"
            "def spy(*a, **k):\n"
            "    bad = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules]\n"
            "    print('heavy:', bad); real(*a, **k)\n"
            "trainer.print_plan = spy\n"
            "from library.cli import main; sys.exit(main('train_lora', sys.argv[1:]))")
    p = subprocess.run([sys.executable, "-c", code, *args("tiny-sd15", dataset, str(tmp_path / "o"),
                                                           "--dry_run")],
                       cwd=root, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "heavy: []" in p.stdout and "total_steps: 1" in p.stdout
    assert "memory estimate" in p.stdout.split("heavy: []", 1)[1]
