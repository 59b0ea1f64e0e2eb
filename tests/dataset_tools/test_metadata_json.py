"""finetune/merge_captions_to_metadata.py, merge_dd_tags_to_metadata.py and
clean_captions_and_tags.py: the document they write (sd-scripts' format, checked against the
expected document written out by hand), read back by finetune.py's own reader and trained on."""
import json
import os
import subprocess
import sys

import pytest

from finetune import clean_captions_and_tags, merge_captions_to_metadata, merge_dd_tags_to_metadata
from library.data import folders
from library.dataset_tools.metadata_json import clean_caption, clean_tags
from tests.conftest import ROOT
from tests.dataset_tools.helpers import error_line, read_text, write_image, write_text
from tests.outputs.test_faults_paths import _read_only


@pytest.fixture
def images(tmp_path):
    """b.JPG, a.png, c.webp with captions and tags; d.png with neither; notes.md (not an image)."""
    folder = tmp_path / "imgs"
    for i, name in enumerate(["b.JPG", "a.png", "c.webp", "d.png"]):
        write_image(str(folder / name), (16 + 8 * i, 16), seed=i)
    for stem, caption, tags in [("a", "a photo of sks", "dog, grass"), ("b", " a cat \n", "cat"),
                                ("c", "a bird", "bird, sky")]:
        write_text(str(folder / f"{stem}.caption"), caption)
        write_text(str(folder / f"{stem}.txt"), tags)
    write_text(str(folder / "notes.md"), "not an image")
    return str(folder)


def run(main, argv, capsys):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_merge_captions_then_tags_is_sd_scripts_document(images, tmp_path, capsys):
    out = tmp_path / "meta.json"
    assert run(merge_captions_to_metadata.main, [images, out], capsys)[0] == 0
    # sd-scripts: keys are stems in sorted path order, the text stripped, json.dumps(indent=2)
    expected = {"a": {"caption": "a photo of sks"}, "b": {"caption": "a cat"}, "c": {"caption": "a bird"}}
    assert read_text(out) == json.dumps(expected, indent=2)
    # the tags go into the same file (it is read as in_json because it exists)
    rc, _, err = run(merge_dd_tags_to_metadata.main, [images, out], capsys)
    assert rc == 0 and "without a .txt file: " in err and "d.txt" in err
    for key, tags in [("a", "dog, grass"), ("b", "cat"), ("c", "bird, sky")]:
        expected[key]["tags"] = tags
    assert read_text(out) == json.dumps(expected, indent=2)

    # finetune.py's reader: caption, ", ", tags (sd-scripts' FineTuningDataset), found by stem
    items = folders.scan_metadata(str(out), images, num_repeats=1)
    got = {os.path.basename(it.path): it.caption for it in items}
    assert got == {"a.png": "a photo of sks, dog, grass", "b.JPG": "a cat, cat", "c.webp": "a bird, bird, sky"}


def test_in_json_keeps_other_fields_and_old_spelling(images, tmp_path, capsys):
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"a": {"caption": "old", "tags": "kept", "train_resolution": [64, 64]},
                               "zz": {"caption": "other image"}}))
    out = tmp_path / "out.json"
    rc, out_text, err = run(merge_captions_to_metadata.main,
                            [images, out, "--in_json", src, "--caption_extention", ".txt", "--debug"], capsys)
    assert rc == 0 and "a: dog, grass" in err
    assert json.loads(read_text(out)) == {
        "a": {"caption": "dog, grass", "tags": "kept", "train_resolution": [64, 64]},
        "zz": {"caption": "other image"}, "b": {"caption": "cat"}, "c": {"caption": "bird, sky"}}


def test_full_path_recursive_round_trip(tmp_path, capsys, monkeypatch):
    """--full_path keys are the image paths as given (relative to the working folder, as
    sd-scripts writes them); finetune.py's reader finds them from there."""
    monkeypatch.chdir(tmp_path)
    for sub, seed in [("data/x", 1), ("data/y", 2)]:
        write_image(f"{sub}/img.png", (24, 16), seed=seed)
        write_text(f"{sub}/img.caption", f"caption {seed}")
    rc, _, err = run(merge_captions_to_metadata.main, ["data", "m.json", "--recursive"], capsys)
    assert rc == 2 and error_line(err) == "error: --recursive requires --full_path (stems of several " \
                                          "folders would collide)"
    assert not os.path.exists("m.json")
    os.makedirs("meta")
    assert run(merge_captions_to_metadata.main, ["data", "meta/m.json", "--recursive", "--full_path"], capsys)[0] == 0
    doc = json.loads(read_text("meta/m.json"))
    assert doc == {"data/x/img.png": {"caption": "caption 1"}, "data/y/img.png": {"caption": "caption 2"}}
    items = folders.scan_metadata("meta/m.json", None, num_repeats=1)
    assert [(os.path.abspath(it.path), it.caption) for it in items] == [
        (str(tmp_path / "data/x/img.png"), "caption 1"), (str(tmp_path / "data/y/img.png"), "caption 2")]


def test_merge_errors_are_one_line_and_keep_the_previous_file(images, tmp_path, capsys):
    out = tmp_path / "meta.json"
    write_text(str(out), "{}")
    rc, _, err = run(merge_captions_to_metadata.main, [tmp_path / "nope", out], capsys)
    assert rc == 2 and error_line(err) == f"error: {tmp_path / 'nope'}: no such folder"
    with open(os.path.join(images, "b.caption"), "wb") as f:
        f.write("caf\xe9".encode("latin-1"))
    rc, _, err = run(merge_captions_to_metadata.main, [images, out], capsys)
    assert rc == 2 and error_line(err) == (f"error: caption file {images}/b.caption: line 1: not UTF-8 text "
                                           "(byte 0xe9 at column 4); save the file as UTF-8")
    rc, _, err = run(merge_dd_tags_to_metadata.main, [images, out, "--caption_extension", "txt"], capsys)
    assert rc == 2 and error_line(err) == "error: --caption_extension 'txt': an extension starts with '.'"
    write_text(str(out), "[1, 2]")
    rc, _, err = run(merge_captions_to_metadata.main, [images, out], capsys)
    assert rc == 2 and "expected an object" in error_line(err)
    assert read_text(out) == "[1, 2]"


# sd-scripts' clean_tags (finetune/clean_captions_and_tags.py at 9d67f9d and 48d368fa) on these inputs, run
# separately and recorded here
SD_SCRIPTS_CLEAN_TAGS = [
    ("1girl, solo, long_hair, blue_eyes, shirt, white_shirt, smile, ^_^",
     "1girl, solo, long hair, blue eyes, white shirt, smile, ^_^"),
    ("2girls, long_hair, short_hair, blonde_hair, black_hair, blue_eyes, red_eyes, hair_ornament, smile, "
     "rating:safe, rating:questionable", "2girls, hair ornament, smile"),
    ("multiple_girls, long_hair, blonde_hair, black_hair, ponytail, twintails, long_sleeves, sleeveless, skirt",
     "multiple girls, long hair, skirt"),
    ("2boys, short_hair, black_hair, blue_eyes, jacket, black_jacket, rating:explicit",
     "2boys, short hair, black hair, blue eyes, black jacket"),
    ("1girl, hair_ornament, x_hair_ornament, bob_cut, hime_cut", "1girl, x hair ornament, bob cut, hime cut"),
    ("scenery, no_humans, sky, blue_sky, cloud, rating:safe", "scenery, no humans, blue sky, cloud"),
    ("2girls, long_hair, medium_hair, brown_hair", "2girls, brown hair"),
]


@pytest.mark.parametrize("tags,expected", SD_SCRIPTS_CLEAN_TAGS)
def test_clean_tags_as_sd_scripts(tags, expected):
    assert clean_tags(tags) == expected


def test_clean_caption_replacements():
    # by hand: each pair in order, repeated until it no longer applies
    assert clean_caption("an anime woman with a young young person") == "an girl with a girl"
    assert clean_caption("a cartoon drawing of anime anime anime women") == "a drawing of girls"
    assert clean_caption("a cartoon image of a lady") == "an image of a girl"


def test_clean_script_and_its_old_three_argument_form(tmp_path, capsys):
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"a": {"caption": "a woman", "tags": "blue_sky, sky"}, "b": {"tags": "1girl"},
                               "c": {"caption": "anime girl"}}))
    out = tmp_path / "out.json"
    expected = {"a": {"caption": "a girl", "tags": "blue sky"}, "b": {"tags": "1girl"}, "c": {"caption": "girl"}}
    rc, _, err = run(clean_captions_and_tags.main, [src, out, "--debug"], capsys)
    assert rc == 0 and "a: 'blue_sky, sky' -> 'blue sky'" in err and "c: 'anime girl' -> 'girl'" in err
    assert read_text(out) == json.dumps(expected, indent=2)
    out.unlink()
    rc, _, err = run(clean_captions_and_tags.main, [tmp_path, src, out], capsys)
    assert rc == 0 and "train_data_dir argument is no longer used" in err
    assert json.loads(read_text(out)) == expected
    rc, _, err = run(clean_captions_and_tags.main, [tmp_path / "none.json", out], capsys)
    assert rc == 2 and error_line(err) == f"error: in_json {tmp_path / 'none.json'}: no such file"


def test_scripts_run_from_the_command_line(images, tmp_path):
    """As the GUI calls them: python finetune/<script>.py from another working folder."""
    out = tmp_path / "meta.json"
    env = dict(os.environ, PYTHONPATH="")
    for script in ("merge_captions_to_metadata", "merge_dd_tags_to_metadata"):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "finetune", f"{script}.py"), images, str(out)],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, os.path.join(ROOT, "finetune", "clean_captions_and_tags.py"),
                        str(out), str(out)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert json.loads(read_text(out))["a"] == {"caption": "a photo of sks", "tags": "dog, grass"}


def test_finetune_trains_on_the_merged_metadata(images, tmp_path, capsys, run_script):
    out = tmp_path / "meta.json"
    assert run(merge_captions_to_metadata.main, [images, out], capsys)[0] == 0
    assert run(merge_dd_tags_to_metadata.main, [images, out], capsys)[0] == 0
    rc, stdout, err = run_script("finetune", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--in_json", out, "--train_data_dir", images,
        "--output_dir", tmp_path / "o", "--resolution", "64", "--max_train_steps", "1",
        "--learning_rate", "1e-4", "--dataset_repeats", "2", "--cache_latents"])
    assert rc == 0, err
    assert "  images: 3\n" in stdout and "  samples_per_epoch: 6\n" in stdout
    assert os.listdir(tmp_path / "o")


def test_read_only_output_folder_keeps_the_previous_file(images, tmp_path, capsys):
    meta = tmp_path / "meta"
    os.makedirs(meta)
    write_text(str(meta / "m.json"), "{}")
    undo = _read_only(meta)
    try:
        rc, _, err = run(merge_captions_to_metadata.main, [images, meta / "m.json"], capsys)
    finally:
        undo()
    assert rc == 2 and error_line(err).startswith(f"error: cannot save {meta / 'm.json'}: ")
    assert read_text(meta / "m.json") == "{}"
