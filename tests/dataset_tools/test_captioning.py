"""The captioning job (library/dataset_tools/captioning.py) with a test captioner whose caption
is a function of the pixels: which images are captioned, skipped or refused, what is written
where, and the one-line errors; GIT's --remove_words phrases; the model source checks."""
import os

import numpy as np
import pytest
from PIL import Image

from library.dataset_tools import caption_models, captioning
from library.errors import ModelError
from tests.dataset_tools.tiny_captioners import write_images


class MeanCaptioner:
    """'mean N': the image's mean pixel value, so each caption is checked against its image."""

    def __init__(self):
        self.batches = []

    def caption(self, images):
        self.batches.append(len(images))
        return [f"mean {np.asarray(im).mean():.3f}\n\nsecond  paragraph" for im in images]


def expected(path):
    return f"mean {np.asarray(Image.open(path).convert('RGB')).mean():.3f} second paragraph"


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_captions_written_beside_each_image_with_prefix_and_suffix(tmp_path):
    paths = write_images(tmp_path, 3)
    captioner, seen = MeanCaptioner(), []
    job = captioning.CaptionJob(str(tmp_path), caption_extension=".txt", prefix="sks, ", suffix=", photo",
                                batch_size=2, workers=2)
    summary = captioning.run(job, captioner, lambda done, total, path: seen.append((done, total, path)))
    assert captioner.batches == [2, 1]
    for p in paths:
        # one line (the trainer reads the first), prefix and suffix verbatim, sd-scripts' newline
        assert read(p[:-4] + ".txt") == f"sks, {expected(p)}, photo\n"
    assert seen == [(1, 3, paths[0]), (2, 3, paths[1]), (3, 3, paths[2])]
    assert summary.written == [p[:-4] + ".txt" for p in paths]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary left


def test_decoding_threads_stay_a_bounded_window_ahead(tmp_path, monkeypatch):
    """--max_data_loader_n_workers decodes ahead, but never the whole folder before captioning:
    at most 2 x batch + workers images wait decoded (here 2 x 1 + 2 = 4), plus the batch at hand."""
    write_images(tmp_path, 12)
    decoded = []
    real = captioning.load_image
    monkeypatch.setattr(captioning, "load_image", lambda path: decoded.append(path) or real(path))

    class Watching(MeanCaptioner):
        def caption(self, images):
            waiting.append(len(decoded) - sum(self.batches))
            return super().caption(images)
    waiting = []
    captioning.run(captioning.CaptionJob(str(tmp_path), workers=2), Watching())
    assert len(waiting) == 12 and max(waiting) <= 5


def test_existing_captions_are_kept_unless_overwrite(tmp_path):
    paths = write_images(tmp_path, 2)
    (tmp_path / "img0.caption").write_text("my own caption\n", encoding="utf-8")
    summary = captioning.run(captioning.CaptionJob(str(tmp_path)), MeanCaptioner())
    assert read(tmp_path / "img0.caption") == "my own caption\n"
    assert read(tmp_path / "img1.caption") == expected(paths[1]) + "\n"
    assert summary.existing == [paths[0]] and len(summary.written) == 1
    summary = captioning.run(captioning.CaptionJob(str(tmp_path), overwrite=True), MeanCaptioner())
    assert read(tmp_path / "img0.caption") == expected(paths[0]) + "\n"
    assert len(summary.written) == 2 and not summary.existing


def test_corrupt_image_is_skipped_with_one_line_and_the_run_goes_on(tmp_path, caplog):
    paths = write_images(tmp_path, 2)
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
    summary = captioning.run(captioning.CaptionJob(str(tmp_path), batch_size=3), MeanCaptioner())
    assert summary.unreadable == [str(tmp_path / "broken.jpg")]
    assert not (tmp_path / "broken.caption").exists()
    assert all(os.path.exists(p[:-4] + ".caption") for p in paths)
    lines = [r.getMessage() for r in caplog.records if "broken.jpg" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and lines[0].startswith("skipping")


def test_nothing_to_do_is_said_before_a_model_loads(tmp_path):
    (tmp_path / "sub").mkdir()
    write_images(tmp_path / "sub", 1)
    assert captioning.nothing_to_do(captioning.CaptionJob(str(tmp_path))) == (
        f"no images (.png .jpg .jpeg .webp .bmp) in {tmp_path} (--recursive for its subfolders)")
    (tmp_path / "sub" / "img0.txt").write_text("mine\n")
    job = captioning.CaptionJob(str(tmp_path), recursive=True, caption_extension=".txt")
    assert captioning.nothing_to_do(job) == (f"all 1 image(s) in {tmp_path} already have a .txt file "
                                             "(--overwrite to caption them again)")
    assert captioning.nothing_to_do(captioning.CaptionJob(str(tmp_path), recursive=True)) is None


def test_recursive_and_hidden_folders(tmp_path):
    write_images(tmp_path, 1)
    (tmp_path / "sub").mkdir()
    (tmp_path / ".sdcache").mkdir()
    write_images(tmp_path / "sub", 1, seed=1)
    write_images(tmp_path / ".sdcache", 1, seed=2)
    assert captioning.find_images(str(tmp_path)) == [str(tmp_path / "img0.png")]
    found = captioning.find_images(str(tmp_path), recursive=True)
    assert found == [str(tmp_path / "img0.png"), str(tmp_path / "sub" / "img0.png")]
    captioning.run(captioning.CaptionJob(str(tmp_path), recursive=True), MeanCaptioner())
    assert read(tmp_path / "sub" / "img0.caption") == expected(tmp_path / "sub" / "img0.png") + "\n"


@pytest.mark.parametrize("job, message", [
    (dict(folder="missing"), "train_data_dir {tmp}/missing: no such folder"),
    (dict(caption_extension="txt"), "--caption_extension 'txt': must start with '.'"),
    (dict(batch_size=0), "--batch_size 0: must be >= 1"),
    (dict(workers=-1), "--max_data_loader_n_workers -1: must be >= 0"),
])
def test_bad_jobs_are_one_line(tmp_path, job, message):
    job = dict(dict(folder=str(tmp_path)), **job)
    if job["folder"] == "missing":
        job["folder"] = str(tmp_path / "missing")
    with pytest.raises(captioning.CaptionError) as e:
        captioning.check_job(captioning.CaptionJob(**job))
    assert str(e.value).startswith(message.format(tmp=tmp_path)) and "\n" not in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_read_only_folder_is_refused(tmp_path):
    write_images(tmp_path, 1)
    os.chmod(tmp_path, 0o555)
    try:
        with pytest.raises(captioning.CaptionError, match="captions cannot be written beside its images"):
            captioning.check_job(captioning.CaptionJob(str(tmp_path)))
    finally:
        os.chmod(tmp_path, 0o755)


def test_unwritable_folder_is_refused_before_any_caption(tmp_path, monkeypatch):
    """The probe (a file created and removed) fails as on a read-only mount, where root fails too."""
    write_images(tmp_path, 1)

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(captioning.tempfile, "mkstemp", read_only)
    captioner = MeanCaptioner()
    with pytest.raises(captioning.CaptionError) as e:
        captioning.run(captioning.CaptionJob(str(tmp_path)), captioner)
    assert str(e.value) == (f"{tmp_path}: captions cannot be written beside its images "
                            "(Read-only file system)")
    assert captioner.batches == []


# sd-scripts' --remove_words phrases, by hand: each removed span is what the phrase list says
@pytest.mark.parametrize("caption, kept", [
    ('a sign with the words "open now" on the door', "a sign"),
    ("a shirt that has the name bob in red", "a shirt that"),
    ("a poster that says hello on it", "a poster"),
    ("a book with a sign that says 'i'm here' on it", "a book"),
    ("a jersey with the number 23 on the front side", "a jersey side"),  # "on \w+ \w+"
    ("a mug with the word coffee", "a mug"),
    ("a red car on the road", "a red car on the road"),
])
def test_remove_words(caption, kept):
    assert captioning.one_line(caption_models.remove_words(caption)) == kept


def test_model_source(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert caption_models.model_source(str(tmp_path / "model"), "--model_id") == str(tmp_path / "model")
    assert caption_models.model_source("microsoft/git-large-textcaps", "--model_id") == "microsoft/git-large-textcaps"
    # the URL the kohya_ss GUI passes: the same weights, converted for transformers
    url = "https://storage.googleapis.com/sfr-vision-language-research/BLIP/models/model_large_caption.pth"
    assert caption_models.model_source(url, "--caption_weights") == "Salesforce/blip-image-captioning-large"
    (tmp_path / "empty").mkdir()
    (tmp_path / "model_large_caption.pth").write_bytes(b"x")
    for source, message in [
        (tmp_path / "empty", "not a transformers model folder (no config.json)"),
        (tmp_path / "model_large_caption.pth", "a .pth checkpoint is not read here"),
        (tmp_path / "model" / "config.json", "a file, not a model folder"),
        (tmp_path / "nothing", "no such model folder"),
    ]:
        with pytest.raises(ModelError) as e:
            caption_models.model_source(str(source), "--caption_weights")
        assert str(e.value).startswith(f"--caption_weights {source}: {message}"), str(e.value)
