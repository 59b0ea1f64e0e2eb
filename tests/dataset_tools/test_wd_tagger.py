"""finetune/tag_images_by_wd14_tagger.py on tiny WD taggers built offline (tests/dataset_tools/
wd_models.py): the model input against a preprocessing computed here with numpy / PIL, the
captions against thresholds applied by hand to onnxruntime's own output on that input, every
flag of sd-scripts' script, and bad input (one line each, nothing overwritten)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from finetune import tag_images_by_wd14_tagger as script
from library.data.folders import scan_metadata
from library.dataset_tools import wd_model, wd_tagger
from tests.conftest import ROOT
from tests.dataset_tools import wd_models as W

REPO = "SmilingWolf/wd-v1-4-convnext-tagger-v2"
MAPPING_REPO = "someone/tagger/v1"
N_RATING, N_GENERAL = len(W.RATINGS), len(W.GENERAL)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The two models under one --model_dir, the images, and onnxruntime's scores for them."""
    root = tmp_path_factory.mktemp("wd")
    models = root / "models"
    W.build_smilingwolf(str(models / REPO.replace("/", "_")))
    W.build_tag_mapping(str(models / "someone_tagger" / "v1"))
    images, sub = W.make_images(str(root / "images"))
    names = [os.path.basename(p) for p in images]
    ref = np.stack([W.reference_input(p) for p in images + [sub]])
    csv_p = W.onnx_scores(str(models / REPO.replace("/", "_") / "model.onnx"), ref)
    logits = W.onnx_scores(str(models / "someone_tagger" / "v1" / "model_optimized.onnx"), ref,
                           nchw=True)
    map_p = 1 / (1 + np.exp(-logits))
    return {"models": str(models), "images": root / "images", "names": names,
            "csv": dict(zip(names + ["sub/e.png"], csv_p)),
            "map": dict(zip(names + ["sub/e.png"], map_p))}


@pytest.fixture
def folder(built, tmp_path):
    """A fresh copy of the images (captions are written next to them)."""
    dst = tmp_path / "imgs"
    shutil.copytree(built["images"], dst)
    return dst


def tag(built, folder, *flags, repo=REPO) -> int:
    return script.main([str(folder), "--model_dir", built["models"], "--repo_id", repo, "--onnx",
                        *flags])


def captions(folder, ext=".txt", names=None) -> dict[str, str]:
    out = {}
    images = [n for n in sorted(os.listdir(folder)) if n.lower().endswith((".png", ".jpg"))]
    for name in names or images:
        path = folder / (os.path.splitext(name)[0] + ext)
        if path.exists():
            out[name] = path.read_text(encoding="utf-8")
    return out


def csv_tags(p, general=0.35, character=0.35) -> tuple[list[str], list[str]]:
    """By hand: the general and the character tags over their thresholds, in CSV order; no score
    may sit within 1e-4 of a threshold (then the test would hang on float rounding)."""
    g_scores, c_scores = p[N_RATING:N_RATING + N_GENERAL], p[N_RATING + N_GENERAL:]
    for s, t in [(s, general) for s in g_scores] + [(s, character) for s in c_scores]:
        assert abs(s - t) > 1e-4, "fixture score too close to a threshold"
    return ([n for n, s in zip(W.GENERAL, g_scores) if s >= general],
            [n for n, s in zip(W.CHARACTERS, c_scores) if s >= character])


# -- preprocessing --------------------------------------------------------------------------------
def test_preprocessing_matches_an_independent_computation(built):
    """RGB below 448 (Lanczos), RGBA at 448 (no resize), 896 px of 2x2 blocks (area: exact block
    means), a palette image with a transparent index: bit for bit."""
    for p in sorted(built["images"].rglob("*.*")):
        ours, size = wd_tagger.load_image(str(p), 448)
        assert size == Image.open(p).size
        np.testing.assert_array_equal(ours, W.reference_input(str(p)), err_msg=str(p))


def test_area_resize_at_a_fractional_factor_is_the_area_average():
    """700 px -> 448: each output pixel the overlap-weighted mean of the input pixels (float64
    here), within one level (OpenCV rounds its float32 sums)."""
    rng = np.random.default_rng(3)
    img = rng.integers(0, 256, (700, 700, 3), dtype=np.uint8)
    ours = wd_tagger.preprocess(Image.fromarray(img), 448)

    def weights(n_in, n_out):
        s, m = n_in / n_out, np.zeros((n_out, n_in))
        for i in range(n_out):
            lo, hi = i * s, (i + 1) * s
            for j in range(int(lo), min(int(np.ceil(hi)), n_in)):
                m[i, j] = (min(hi, j + 1) - max(lo, j)) / s
        return m

    m = weights(700, 448)
    bgr = img[..., ::-1].astype(np.float64)
    ref = np.stack([m @ bgr[..., c] @ m.T for c in range(3)], axis=-1)
    assert np.abs(ours - ref).max() <= 1.0


# -- captions (SmilingWolf layout) ----------------------------------------------------------------
def test_default_captions_are_the_thresholded_tags_general_then_character(built, folder):
    assert tag(built, folder) == 0
    got = captions(folder)
    assert list(got) == built["names"]  # not sub/e.png: no --recursive
    for name, text in got.items():
        general, chars = csv_tags(built["csv"][name])
        assert chars, "the fixture should pass character tags (sd-scripts 48d368fa crashes here)"
        assert text == ", ".join(general + chars) + "\n"


def test_thresholds_per_category(built, folder):
    assert tag(built, folder, "--thresh", "0.9", "--general_threshold", "0.6",
               "--character_threshold", "0.8") == 0
    for name, text in captions(folder).items():
        general, chars = csv_tags(built["csv"][name], 0.6, 0.8)
        assert text.strip() == ", ".join(general + chars)
    assert tag(built, folder, "--thresh", "0.7") == 0  # both default to --thresh
    for name, text in captions(folder).items():
        general, chars = csv_tags(built["csv"][name], 0.7, 0.7)
        assert text.strip() == ", ".join(general + chars)


def test_rating_tag_first_or_last_is_the_argmax_of_the_ratings(built, folder):
    assert tag(built, folder, "--use_rating_tags") == 0
    for name, text in captions(folder).items():
        p = built["csv"][name]
        general, chars = csv_tags(p)
        assert text.strip() == ", ".join([W.RATINGS[int(np.argmax(p[:4]))]] + general + chars)
    assert tag(built, folder, "--use_rating_tags_as_last_tag") == 0
    for name, text in captions(folder).items():
        p = built["csv"][name]
        general, chars = csv_tags(p)
        assert text.strip() == ", ".join(general + chars + [W.RATINGS[int(np.argmax(p[:4]))]])


def test_character_tags_first_expand_underscores_and_replacement(built, folder):
    """sd-scripts' order of preparing names: expand, underscores (``^_^`` kept: 3 characters),
    replacements (an escaped comma inside a tag); character tags inserted first one by one."""
    assert tag(built, folder, "--character_tags_first", "--character_tag_expand",
               "--remove_underscore", "--tag_replacement", "a\\,b,c\\;d;hatsune miku,miku") == 0
    names = {"hatsune_miku": "miku",
             "kafuu_chino_(gochuumon_wa_usagi_desu_ka?)": "kafuu chino, gochuumon wa usagi desu ka?",
             "saber_(fate)_(cosplay)": "saber (fate), cosplay", "zz_char": "zz char"}
    for name, text in captions(folder).items():
        general, chars = csv_tags(built["csv"][name])
        general = ["c;d" if g == "a,b" else g if g == "^_^" else g.replace("_", " ")
                   for g in general]
        assert text.strip() == ", ".join([names[c] for c in reversed(chars)] + general)


def test_undesired_always_first_and_separator(built, folder):
    assert tag(built, folder, "--caption_separator", " | ", "--undesired_tags", "solo| smile",
               "--always_first_tags", "hatsune_miku | 1girl") == 0
    for name, text in captions(folder).items():
        general, chars = csv_tags(built["csv"][name])
        tags = [t for t in general + chars if t not in ("solo", "smile")]
        for first in ("hatsune_miku", "1girl"):  # each moved to the front in turn
            if first in tags:
                tags.remove(first)
                tags.insert(0, first)
        assert text.strip() == " | ".join(tags)


def test_append_tags_keeps_the_existing_caption_first(built, folder):
    (folder / "a.txt").write_text("my_token, 1girl,\r\n", encoding="utf-8")
    assert tag(built, folder, "--append_tags") == 0
    general, chars = csv_tags(built["csv"]["a.png"])
    assert (folder / "a.txt").read_text() == ", ".join(
        ["my_token", "1girl"] + [t for t in general + chars if t != "1girl"]) + "\n"


def test_frequency_tags_and_debug(built, folder, capsys):
    assert tag(built, folder, "--frequency_tags", "--debug", "--recursive") == 0
    out, err = capsys.readouterr()
    counts = {}
    for name in built["names"] + ["sub/e.png"]:
        general, chars = csv_tags(built["csv"][name])
        for t in general + chars:
            counts[t] = counts.get(t, 0) + 1
    lines = out.splitlines()
    assert lines[0] == "Tag frequencies:"
    got = [tuple(ln.rsplit(": ", 1)) for ln in lines[1:]]
    assert {t: int(n) for t, n in got} == counts
    assert [int(n) for _, n in got] == sorted(counts.values(), reverse=True)
    general, chars = csv_tags(built["csv"]["b.png"])
    assert f"\tGeneral tags: {', '.join(general)}" in err
    assert f"\tCharacter tags: {', '.join(chars)}" in err
    assert (folder / "sub" / "e.txt").exists()  # --recursive


def test_batches_and_loader_threads_give_the_same_captions(built, folder, tmp_path):
    assert tag(built, folder) == 0
    one = captions(folder)
    other = tmp_path / "other"
    shutil.copytree(built["images"], other)
    assert tag(built, other, "--batch_size", "3", "--max_data_loader_n_workers", "2") == 0
    assert captions(other) == one


def test_a_fixed_batch_model_gets_its_batch_size_and_a_padded_last_batch(built, folder, tmp_path,
                                                                          capsys):
    models = tmp_path / "fixed"
    W.build_smilingwolf(str(models / REPO.replace("/", "_")), batch=3)
    assert script.main([str(folder), "--model_dir", str(models), "--onnx"]) == 0
    assert "does not match the model's batch size 3: using 3" in capsys.readouterr().err
    for name, text in captions(folder).items():  # 4 images: a batch of 3, then 1 padded to 3
        general, chars = csv_tags(built["csv"][name])
        assert text.strip() == ", ".join(general + chars)


def test_caption_extension_and_its_old_spelling(built, folder):
    assert tag(built, folder, "--caption_extension", ".tags") == 0
    assert set(captions(folder, ".tags")) == set(built["names"]) and not captions(folder)
    assert tag(built, folder, "--caption_extention", ".cap") == 0
    assert set(captions(folder, ".cap")) == set(built["names"])


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_output_path_metadata_is_read_back_by_the_fine_tuning_reader(built, folder, suffix):
    """sd-scripts' --output_path files (no caption files then); finetune.py's reader takes them."""
    path = folder.parent / f"meta{suffix}"
    assert tag(built, folder, "--output_path", str(path)) == 0
    assert not captions(folder)
    items = scan_metadata(str(path), None, num_repeats=1)
    assert [os.path.basename(i.path) for i in items] == built["names"]
    for item in items:
        name = os.path.basename(item.path)
        general, chars = csv_tags(built["csv"][name])
        assert item.caption == ", ".join(general + chars)
        assert item.size == Image.open(item.path).size
    text = path.read_text(encoding="utf-8")
    first = json.loads(text.splitlines()[0]) if suffix == ".jsonl" else json.loads(text)
    assert "image_size" in (first if suffix == ".jsonl" else next(iter(first.values())))


def test_tag_folder_reports_progress_and_returns_what_it_wrote(built, folder):
    """The library call a UI job makes: progress(done, total) rising to (total, total), and the
    summary's captions and frequencies are those of the files."""
    model = wd_model.load(os.path.join(built["models"], REPO.replace("/", "_")), wd_model.SMILINGWOLF)
    seen = []
    summary = wd_tagger.tag_folder(str(folder), model, script.TagOptions(),
                                   wd_tagger.OutputOptions(batch_size=3),
                                   progress=lambda done, total: seen.append((done, total)))
    assert seen == [(3, 4), (4, 4)]
    files = captions(folder)
    assert {os.path.basename(k): v + "\n" for k, v in summary.captions.items()} == files
    assert sum(summary.frequencies.values()) == sum(len(v.split(", ")) for v in files.values())
    assert summary.images == 4 and not summary.failed


# -- captions (tag_mapping layout) ----------------------------------------------------------------
def mapping_expected(p, thr: dict, thresh=0.35, rating=None, quality=None, characters_first=False):
    """By hand: tags of General / Character / Copyright / Meta / Model / Artist over their
    thresholds, by score; the best rating / quality among those over the lowest threshold."""
    lowest = min(min(thr.values()), thresh)
    rows = [(n, c, s) for (n, c, _), s in zip(W.MAPPING, p)]
    for n, c, s in rows:
        assert abs(s - thr.get(c, lowest)) > 1e-4 and abs(s - lowest) > 1e-4
    tags = sorted([(n, s) for n, c, s in rows if c in thr and s >= thr[c]], key=lambda t: -t[1])
    if characters_first:
        tags = ([t for t in tags if dict((n, c) for n, c, _ in rows)[t[0]] == "Character"]
                + [t for t in tags if dict((n, c) for n, c, _ in rows)[t[0]] != "Character"])
    tags = [n for n, _ in tags]

    def best(cat):
        cands = [(s, n) for n, c, s in rows if c == cat and s >= lowest]
        return max(cands)[1] if cands else None

    for which, cat in ((quality, "Quality"), (rating, "Rating")):
        if which and best(cat):
            tags = tags + [best(cat)] if which == "last" else [best(cat)] + tags
    return tags


def test_tag_mapping_layout_thresholds_order_rating_and_quality(built, folder):
    cats = ("General", "Character", "Copyright", "Meta", "Model", "Artist")
    assert tag(built, folder, repo=MAPPING_REPO) == 0
    for name, text in captions(folder).items():
        assert text.strip() == ", ".join(mapping_expected(built["map"][name],
                                                          {c: 0.35 for c in cats}))
    flags = ["--thresh", "0.3", "--general_threshold", "0.55", "--character_threshold", "0.75",
             "--copyright_threshold", "0.5", "--meta_threshold", "0.72", "--model_threshold",
             "0.2", "--artist_threshold", "0.9"]
    thr = dict(zip(cats, (0.55, 0.75, 0.5, 0.72, 0.2, 0.9)))
    assert tag(built, folder, *flags, "--use_rating_tags", "--use_quality_tags_as_last_tag",
               "--character_tags_first", repo=MAPPING_REPO) == 0
    for name, text in captions(folder).items():
        assert text.strip() == ", ".join(mapping_expected(
            built["map"][name], thr, 0.3, rating="first", quality="last",
            characters_first=True))
    assert tag(built, folder, *flags, "--use_rating_tags_as_last_tag", "--use_quality_tags",
               repo=MAPPING_REPO) == 0
    for name, text in captions(folder).items():
        assert text.strip() == ", ".join(mapping_expected(
            built["map"][name], thr, 0.3, rating="last", quality="first"))


# -- the model: location, download, providers -----------------------------------------------------
def test_model_dir_itself_may_hold_the_model(built, folder):
    direct = os.path.join(built["models"], REPO.replace("/", "_"))
    assert script.main([str(folder), "--model_dir", direct, "--onnx"]) == 0
    assert captions(folder)


def fake_hub(hub, calls, fail_on=None):
    def hf_hub_download(repo_id, filename, subfolder=None, local_dir=None, force_download=False):
        calls.append((repo_id, subfolder, filename, force_download))
        if filename == fail_on:
            raise OSError("503 Service Unavailable")
        rel = os.path.join(subfolder or "", filename)
        dst = os.path.join(local_dir, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy(os.path.join(hub, repo_id, rel), dst)
        return dst
    return hf_hub_download


def test_download_into_model_dir_in_both_layouts(built, folder, tmp_path, monkeypatch):
    """A missing model folder is fetched with huggingface_hub (here a local stand-in with the
    same signature): the layout's two files, into sd-scripts' folder."""
    import huggingface_hub

    hub, calls = tmp_path / "hub", []
    shutil.copytree(os.path.join(built["models"], REPO.replace("/", "_")), hub / REPO)
    shutil.copytree(os.path.join(built["models"], "someone_tagger", "v1"), hub / "someone/tagger/v1")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_hub(str(hub), calls))
    models = tmp_path / "dl"
    for repo in (REPO, MAPPING_REPO):
        assert script.main([str(folder), "--model_dir", str(models), "--repo_id", repo, "--onnx"]) == 0
    assert calls == [(REPO, None, "model.onnx", True), (REPO, None, "selected_tags.csv", True),
                     ("someone/tagger", "v1", "model_optimized.onnx", True),
                     ("someone/tagger", "v1", "tag_mapping.json", True)]
    assert sorted(os.listdir(models / "SmilingWolf_wd-v1-4-convnext-tagger-v2")) == [
        "model.onnx", "selected_tags.csv"]
    assert sorted(os.listdir(models / "someone_tagger" / "v1")) == [
        "model_optimized.onnx", "tag_mapping.json"]
    calls.clear()
    assert script.main([str(folder), "--model_dir", str(models), "--onnx"]) == 0
    assert calls == []  # present: not downloaded again


def test_a_failed_force_download_keeps_the_model_folder(built, folder, tmp_path, monkeypatch,
                                                        capsys):
    import huggingface_hub

    models = tmp_path / "m"
    local = models / REPO.replace("/", "_")
    shutil.copytree(os.path.join(built["models"], REPO.replace("/", "_")), local)
    (local / "notes.txt").write_text("mine")
    before = {f: (local / f).read_bytes() for f in os.listdir(local)}
    hub, calls = tmp_path / "hub", []
    shutil.copytree(local, hub / REPO)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        fake_hub(str(hub), calls, fail_on="selected_tags.csv"))
    assert script.main([str(folder), "--model_dir", str(models), "--onnx", "--force_download"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: cannot download model.onnx, selected_tags.csv of " + REPO)
    assert "503 Service Unavailable" in err[-1]
    assert {f: (local / f).read_bytes() for f in os.listdir(local)} == before
    assert not captions(folder)


def test_cuda_provider_when_onnxruntime_has_it():
    assert wd_model.providers(["CUDAExecutionProvider", "CPUExecutionProvider"]) == [
        "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert wd_model.providers(["AzureExecutionProvider", "CPUExecutionProvider"]) == [
        "CPUExecutionProvider"]


# -- bad input: one line each ---------------------------------------------------------------------
def test_a_corrupt_image_is_one_line_and_the_others_are_tagged(built, folder, capsys):
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    assert tag(built, folder, "--batch_size", "2", "--max_data_loader_n_workers", "1") == 0
    err = capsys.readouterr().err
    assert sum("cannot read image" in ln and "broken.png" in ln for ln in err.splitlines()) == 1
    assert "tagged 4 of 5 images; 1 skipped" in err
    assert set(captions(folder)) == set(built["names"])


def test_an_unreadable_existing_caption_is_kept_with_append_tags(built, folder, capsys):
    (folder / "a.txt").write_bytes(b"caf\xe9, 1girl\n")
    assert tag(built, folder, "--append_tags") == 0
    assert (folder / "a.txt").read_bytes() == b"caf\xe9, 1girl\n"
    assert "not UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("case, expected", [
    ("no_onnx_flag", "--onnx is required"),
    ("keras_folder", "holds a Keras SavedModel (saved_model.pb)"),
    ("csv_missing", "lacks selected_tags.csv"),
    ("rows_mismatch", "gives 20 scores per image but"),
    ("not_onnx", "cannot be loaded by onnxruntime"),
    ("bad_header", "expected tag_id,name,category"),
    ("bad_category", "has category 'Style'"),
    ("bad_replacement", "--tag_replacement: 'a,b,c' is not source,target"),
    ("no_folder", "not a folder"),
    ("bad_repo_id", "--repo_id 'justaname': expected owner/name"),
    ("batch_size", "--batch_size 0: must be 1 or more"),
])
def test_bad_input_is_one_line_exit_2(built, folder, tmp_path, capsys, case, expected):
    models = tmp_path / "bad"
    local = models / REPO.replace("/", "_")
    shutil.copytree(os.path.join(built["models"], REPO.replace("/", "_")), local)
    argv = [str(folder), "--model_dir", str(models), "--onnx"]
    if case == "no_onnx_flag":
        argv.remove("--onnx")
    elif case == "keras_folder":
        for f in os.listdir(local):
            os.remove(local / f)
        (local / "saved_model.pb").write_bytes(b"\0")
    elif case == "csv_missing":
        os.remove(local / "selected_tags.csv")
    elif case == "rows_mismatch":
        with open(local / "selected_tags.csv", "a", encoding="utf-8") as f:
            f.write("999,extra_tag,0,1\n")
    elif case == "not_onnx":
        (local / "model.onnx").write_bytes(b"not a model")
    elif case == "bad_header":
        (local / "selected_tags.csv").write_text("id,tag\n1,x\n")
    elif case == "bad_category":
        mapped = models / "someone_tagger" / "v1"
        shutil.copytree(os.path.join(built["models"], "someone_tagger", "v1"), mapped)
        (mapped / "tag_mapping.json").write_text(json.dumps({"0": {"tag": "x", "category": "Style"}}))
        argv += ["--repo_id", MAPPING_REPO]
    elif case == "bad_replacement":
        argv += ["--tag_replacement", "a,b,c"]
    elif case == "no_folder":
        argv[0] = str(tmp_path / "nowhere")
    elif case == "bad_repo_id":
        argv += ["--repo_id", "justaname"]
    elif case == "batch_size":
        argv += ["--batch_size", "0"]
    assert script.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and expected in err[-1], err
    assert "Traceback" not in "\n".join(err)
    assert not captions(folder)


def test_missing_model_offline_as_a_script(built, folder, tmp_path):
    """The script as users run it: a missing model folder with the hub offline is one line,
    exit 2 (HF_HUB_OFFLINE: the test never reaches the network)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "finetune", "tag_images_by_wd14_tagger.py"),
                        str(folder), "--model_dir", str(tmp_path / "none"), "--onnx"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot download model.onnx, selected_tags.csv of " + REPO)
    assert "Traceback" not in r.stderr
    assert not captions(folder)


def test_every_flag_of_the_script_is_exercised_here():
    """Each of the script's flags appears in this file's tests (or is the positional folder)."""
    with open(__file__, encoding="utf-8") as f:
        text = f.read()
    flags = [s for a in script.setup_parser()._actions for s in a.option_strings
             if s.startswith("--") and s != "--help"]
    missing = [f for f in flags if f'"{f}"' not in text]
    assert not missing, missing


def test_make_tiny_tagger_writes_either_layout(tmp_path):
    from tools import make_tiny_tagger

    assert make_tiny_tagger.main([str(tmp_path / "sw"), "--batch", "2"]) == 0
    assert make_tiny_tagger.main([str(tmp_path / "tm"), "--layout", "tag_mapping"]) == 0
    sw = wd_model.load(str(tmp_path / "sw"), wd_model.SMILINGWOLF)
    tm = wd_model.load(str(tmp_path / "tm"), wd_model.TAG_MAPPING)
    assert (sw.fixed_batch, tm.fixed_batch, sw.size, tm.size) == (2, None, 448, 448)
    assert len(sw.labels.names) == 20 and set(tm.labels.categories) == set(wd_model.CATEGORIES)


def test_the_side_by_side_check_refuses_a_folder_without_sd_scripts(tmp_path, capsys):
    from benchmarks import sd_scripts_tagger_check

    assert sd_scripts_tagger_check.main(["--sd_scripts", str(tmp_path)]) == 2
    assert "no finetune/tag_images_by_wd14_tagger.py" in capsys.readouterr().err
