"""tools/dataset_folders.py: the kohya_ss GUI's folder preparation (the layout and the copies,
read back by the trainer's folder scan) and dataset balancing (repeats against the GUI's formula
computed by hand), with its refusals."""
import os

import pytest

from library.data import folders
from library.dataset_tools import folders_prep
from tests.dataset_tools.helpers import error_line, read_text, write_image, write_text
from tests.outputs.test_faults_paths import _read_only
from tools import dataset_folders


def run(argv, capsys):
    rc = dataset_folders.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def image_folder(path, n, start=0, captions=True):
    for i in range(n):
        write_image(str(path / f"im{i}.png"), (8, 8), seed=start + i)
        if captions:
            write_text(str(path / f"im{i}.caption"), f"caption {start + i}")
    return path


def tree(folder):
    return {os.path.relpath(os.path.join(r, n), folder): open(os.path.join(r, n), "rb").read()
            for r, _, names in os.walk(folder) for n in names}


def test_prepare_layout_copies_and_the_trainer_reads_it(tmp_path, capsys):
    photos = image_folder(tmp_path / "photos", 3)
    os.makedirs(photos / ".sdcache")
    write_text(str(photos / ".sdcache" / "x.safetensors"), "cache")
    reg = image_folder(tmp_path / "reg_src", 2, start=10, captions=False)
    out = tmp_path / "train"
    rc, stdout, err = run(["prepare", "--train_images", photos, "--repeats", 20, "--instance_prompt", " sks ",
                           "--class_prompt", "dog", "--out_dir", out, "--reg_images", reg, "--reg_repeats", 2],
                          capsys)
    assert rc == 0, err
    assert sorted(os.listdir(out)) == ["img", "log", "model", "reg"]
    assert os.listdir(out / "img") == ["20_sks dog"] and os.listdir(out / "reg") == ["2_dog"]
    assert os.listdir(out / "log") == [] and os.listdir(out / "model") == []
    expected = {k: v for k, v in tree(photos).items() if not k.startswith(".sdcache")}
    assert tree(out / "img" / "20_sks dog") == expected and tree(out / "reg" / "2_dog") == tree(reg)
    assert stdout.splitlines()[0] == f"made {out / 'img' / '20_sks dog'}"

    train = folders.scan_concept_dirs(str(out / "img"))
    assert [(it.num_repeats, it.class_tokens, it.caption) for it in train] == [
        (20, "sks dog", f"caption {i}") for i in range(3)]
    regs = folders.scan_concept_dirs(str(out / "reg"), is_reg=True)
    assert [(it.num_repeats, it.caption) for it in regs] == [(2, "dog"), (2, "dog")]


def test_prepare_refusals_change_nothing(tmp_path, capsys):
    photos = image_folder(tmp_path / "photos", 1)
    base = ["prepare", "--instance_prompt", "sks", "--class_prompt", "dog", "--repeats", 5]
    rc, _, err = run(base + ["--train_images", photos, "--out_dir", photos], capsys)
    assert rc == 2 and error_line(err) == (f"error: --train_images {photos}: the destination "
                                           f"{photos / 'img' / '5_sks dog'} is inside it")
    inner = image_folder(tmp_path / "train" / "img" / "5_sks dog", 1)
    rc, _, err = run(base + ["--train_images", inner, "--out_dir", tmp_path / "train"], capsys)
    assert rc == 2 and error_line(err) == f"error: --train_images {inner} is the destination {inner} itself"
    rc, _, err = run(base + ["--train_images", tmp_path / "none", "--out_dir", tmp_path / "t"], capsys)
    assert rc == 2 and error_line(err) == f"error: --train_images {tmp_path / 'none'}: no such folder"
    rc, _, err = run(["prepare", "--instance_prompt", "a/b", "--class_prompt", "dog", "--train_images", photos,
                      "--out_dir", tmp_path / "t"], capsys)
    assert rc == 2 and error_line(err) == "error: --instance_prompt 'a/b': a folder name cannot hold '/'"
    assert not os.path.exists(tmp_path / "t")

    # an existing concept folder is replaced only with --replace, and then completely
    out = tmp_path / "t2"
    old = image_folder(out / "img" / "5_sks dog", 2, start=50)
    before = tree(old)
    rc, _, err = run(base + ["--train_images", photos, "--out_dir", out], capsys)
    assert rc == 2 and "exists (pass --replace" in error_line(err) and tree(old) == before
    assert run(base + ["--train_images", photos, "--out_dir", out, "--replace"], capsys)[0] == 0
    assert tree(old) == tree(photos)


def test_balance_is_the_gui_formula(tmp_path, capsys):
    root = tmp_path / "img"
    image_folder(root / "10_alpha", 2)                 # round(10 / 2) = 5
    image_folder(root / "3_beta", 3)                   # round(10 / 3) = 3
    image_folder(root / "1_gamma", 40)                 # max(1, round(10 / 40)) = 1
    image_folder(root / "{2}7_delta", 4)               # round(10 / 4 x 2) = 5, the weight dropped
    image_folder(root / "eps", 4)                      # not N_concept: with --insecure round(2.5) = 2
    os.makedirs(root / "5_empty")                      # no images: kept as it is
    write_text(str(root / "5_empty" / "notes.gif"), "not counted")
    rc, out, err = run(["balance", root, "--steps", 10, "--dry_run"], capsys)
    assert rc == 0, err
    assert out.splitlines() == ["10_alpha -> 5_alpha: 2 images x 5 = 10 per epoch",
                                "1_gamma -> 1_gamma: 40 images x 1 = 40 per epoch",
                                "3_beta -> 3_beta: 3 images x 3 = 9 per epoch",
                                "{2}7_delta -> 5_delta: 4 images x 5 = 20 per epoch"]
    assert sorted(os.listdir(root)) == ["10_alpha", "1_gamma", "3_beta", "5_empty", "eps", "{2}7_delta"]
    assert run(["balance", root, "--steps", 10, "--insecure"], capsys)[0] == 0
    assert sorted(os.listdir(root)) == ["1_gamma", "2_eps", "3_beta", "5_alpha", "5_delta", "5_empty"]
    assert tree(root / "5_alpha") == tree(image_folder(tmp_path / "ref", 2))
    repeats = {os.path.basename(os.path.dirname(it.path)): it.num_repeats
               for it in folders.scan_concept_dirs(str(root))}
    assert repeats == {"5_alpha": 5, "3_beta": 3, "1_gamma": 1, "5_delta": 5, "2_eps": 2}


@pytest.mark.parametrize("steps,images,weight,expected", [
    (1000, 3, 1.0, 333), (5, 2, 1.0, 2), (7, 2, 1.0, 4), (1, 10, 1.0, 1), (100, 8, 1.5, 19)])
def test_balanced_repeats_rounds_as_python(steps, images, weight, expected):
    """The GUI's round(): halves to even (5 / 2 = 2.5 -> 2, 7 / 2 = 3.5 -> 4)."""
    assert folders_prep.balanced_repeats(steps, images, weight) == expected


def test_balance_refuses_collisions_and_swaps_names(tmp_path, capsys):
    root = tmp_path / "img"
    image_folder(root / "10_cat", 2)
    image_folder(root / "20_cat", 2, start=5)
    rc, _, err = run(["balance", root, "--steps", 4], capsys)
    assert rc == 2 and error_line(err) == f"error: {root}: several folders would be named '2_cat'; nothing was renamed"
    assert sorted(os.listdir(root)) == ["10_cat", "20_cat"]
    # two folders of one concept whose names swap: renamed through temporary names
    swap = tmp_path / "swap"
    few, many = tree(image_folder(swap / "1_a", 2)), tree(image_folder(swap / "2_a", 4, start=7))
    assert run(["balance", swap, "--steps", 4], capsys)[0] == 0
    assert tree(swap / "2_a") == few and tree(swap / "1_a") == many and len(os.listdir(swap)) == 2
    rc, _, err = run(["balance", tmp_path / "none"], capsys)
    assert rc == 2 and error_line(err) == f"error: {tmp_path / 'none'}: no such folder"
    rc, _, err = run(["balance", root, "--steps", 0], capsys)
    assert rc == 2 and error_line(err) == "error: --steps 0.0: must be above 0"
    assert read_text(root / "10_cat" / "im0.caption") == "caption 0"


def test_prepare_into_a_read_only_folder(tmp_path, capsys):
    photos = image_folder(tmp_path / "photos", 1)
    out = tmp_path / "train"
    os.makedirs(out)
    undo = _read_only(out)
    try:
        rc, _, err = run(["prepare", "--instance_prompt", "sks", "--class_prompt", "dog", "--train_images",
                          photos, "--out_dir", out], capsys)
    finally:
        undo()
    assert rc == 2 and error_line(err).startswith(f"error: cannot save {out / 'img' / '40_sks dog'}: ")
    assert os.listdir(out) == []
