"""tools/caption_edit.py: each edit against the expected captions written out by hand, the undo
journal (exact bytes back, newer text never lost), all-or-nothing edits, and one-line refusals."""
import json
import os

import pytest

from library import files
from library.data import folders
from library.dataset_tools import captions
from tests.dataset_tools.helpers import error_line, read_text, write_image, write_text
from tests.outputs.test_faults_paths import _read_only
from tools import caption_edit

CAPTIONS = {
    "a": "dog, grass, dog, sky",
    "b": "sks, cat, sofa",
    "c": "a photo of a cat, cat\nsecond line, cat, cat",
    "d": "",
}


@pytest.fixture
def folder(tmp_path):
    f = tmp_path / "10_sks thing"
    for i, (stem, text) in enumerate(CAPTIONS.items()):
        write_image(str(f / f"{stem}.png"), (8, 8), seed=i)
        write_text(str(f / f"{stem}.caption"), text)
    write_text(str(f / "orphan.caption"), "no image, no edit")
    return f


def run(argv, capsys):
    rc = caption_edit.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def texts(folder):
    return {stem: read_text(folder / f"{stem}.caption") for stem in CAPTIONS}


@pytest.mark.parametrize("argv,expected", [
    (["trigger", "sks"], {"a": "sks, dog, grass, dog, sky", "b": "sks, cat, sofa",
                          "c": "sks, a photo of a cat, cat\nsks, second line, cat, cat", "d": "sks"}),
    (["remove", "cat"], {"a": "dog, grass, dog, sky", "b": "sks, sofa", "c": "a photo of a cat\nsecond line",
                         "d": ""}),
    (["dedupe"], {"a": "dog, grass, sky", "b": "sks, cat, sofa", "c": "a photo of a cat, cat\nsecond line, cat",
                  "d": ""}),
    (["replace", "--find", "cat", "--replace", "kitten"],
     {"a": "dog, grass, dog, sky", "b": "sks, kitten, sofa",
      "c": "a photo of a kitten, kitten\nsecond line, kitten, kitten", "d": ""}),
    (["replace", "--find", r"(\w+) of a (\w+)", "--replace", r"\2 \1", "--regex"],
     {"a": "dog, grass, dog, sky", "b": "sks, cat, sofa", "c": "a cat photo, cat\nsecond line, cat, cat",
      "d": ""}),
])
def test_edit_then_undo(folder, capsys, argv, expected):
    before = {n: (folder / n).read_bytes() for n in os.listdir(folder) if os.path.isfile(folder / n)}
    rc, out, _ = run([argv[0], folder, *argv[1:]], capsys)
    assert rc == 0
    assert texts(folder) == expected
    changed = sum(expected[s] != CAPTIONS[s] for s in CAPTIONS)
    assert out.startswith(f"{argv[0]}: {changed} caption(s) changed, {len(CAPTIONS) - changed} unchanged")
    assert read_text(folder / "orphan.caption") == "no image, no edit"
    rc, out, _ = run(["undo", folder], capsys)
    assert rc == 0 and f"{changed} caption(s) restored" in out
    assert {n: (folder / n).read_bytes() for n in before} == before
    assert captions.journals(str(folder)) == []


def test_undo_steps_back_and_keeps_newer_text(folder, capsys):
    assert run(["trigger", folder, "sks"], capsys)[0] == 0
    assert run(["remove", folder, "dog"], capsys)[0] == 0
    assert read_text(folder / "a.caption") == "sks, grass, sky"
    write_text(str(folder / "b.caption"), "edited by hand")  # after the remove (which left b alone)
    assert run(["undo", folder], capsys)[0] == 0
    assert read_text(folder / "a.caption") == "sks, dog, grass, dog, sky"
    write_text(str(folder / "c.caption"), "edited by hand too")
    rc, out, _ = run(["undo", folder], capsys)
    assert rc == 0 and f"kept {folder / 'c.caption'}: changed since that edit" in out
    assert texts(folder) == dict(CAPTIONS, b="edited by hand", c="edited by hand too")
    rc, _, err = run(["undo", folder], capsys)
    assert rc == 2 and error_line(err).startswith(f"error: {folder}: no caption edit to undo")


def test_journal_holds_relative_paths_and_the_trainer_ignores_it(folder, capsys):
    assert run(["trigger", folder, "sks"], capsys)[0] == 0
    [journal] = captions.journals(str(folder))
    doc = json.loads(read_text(journal))
    assert doc["operation"] == "trigger"
    assert {e["path"]: (e["before"], e["after"]) for e in doc["files"]} == {
        "a.caption": (CAPTIONS["a"], "sks, " + CAPTIONS["a"]), "c.caption": (CAPTIONS["c"], texts(folder)["c"]),
        "d.caption": ("", "sks")}
    items = folders.scan_concept_dirs(str(folder.parent))
    assert sorted(os.path.basename(it.path) for it in items) == ["a.png", "b.png", "c.png", "d.png"]


def test_tags_by_frequency(folder, capsys):
    rc, out, _ = run(["tags", folder], capsys)
    # by hand: captions holding each tag (a caption counts once)
    assert rc == 0 and out.splitlines() == ["2\tcat", "1\ta photo of a cat", "1\tdog", "1\tgrass",
                                            "1\tsecond line", "1\tsks", "1\tsky", "1\tsofa"]
    assert run(["tags", folder, "--top", "2"], capsys)[1].splitlines() == ["2\tcat", "1\ta photo of a cat"]


def test_not_utf8_changes_nothing(folder, capsys):
    (folder / "c.caption").write_bytes("caf\xe9, cat".encode("latin-1"))
    rc, _, err = run(["trigger", folder, "sks"], capsys)
    assert rc == 2 and error_line(err) == (f"error: caption file {folder / 'c.caption'}: line 1: not UTF-8 "
                                           "text (byte 0xe9 at column 4); save the file as UTF-8")
    assert read_text(folder / "a.caption") == CAPTIONS["a"] and captions.journals(str(folder)) == []


def test_a_failed_write_puts_back_the_written_files(folder, capsys, monkeypatch):
    real, calls = captions._write, []

    def failing(path, text):
        calls.append(path)
        if len(calls) == 2:
            raise files.SaveError(path, "No space left on device")
        real(path, text)

    monkeypatch.setattr(captions, "_write", failing)
    rc, _, err = run(["trigger", folder, "sks"], capsys)
    assert rc == 2 and "No space left on device" in error_line(err)
    assert texts(folder) == CAPTIONS and captions.journals(str(folder)) == []


def test_one_edit_at_a_time(folder, capsys):
    lock = folder / captions.JOURNAL_DIR / captions.LOCK
    os.makedirs(lock.parent)
    lock.write_text(str(os.getppid()))  # a live process holds it
    rc, _, err = run(["dedupe", folder], capsys)
    assert rc == 2 and error_line(err) == (f"error: {folder}: another caption edit is running "
                                           f"(pid {os.getppid()}); nothing was changed")
    assert texts(folder) == CAPTIONS
    lock.write_text("999999999")  # its writer is gone: the lock is taken over
    assert run(["dedupe", folder], capsys)[0] == 0 and not lock.exists()


def test_bad_input_is_one_line(folder, tmp_path, capsys):
    rc, _, err = run(["replace", folder, "--find", "(", "--regex"], capsys)
    assert rc == 2 and error_line(err).startswith("error: --find / --replace: not a valid regular expression")
    rc, _, err = run(["dedupe", tmp_path / "none"], capsys)
    assert rc == 2 and error_line(err) == f"error: {tmp_path / 'none'}: no such folder"
    rc, _, err = run(["dedupe", folder, "--caption_extension", "txt"], capsys)
    assert rc == 2 and error_line(err) == "error: --caption_extension 'txt': an extension starts with '.'"


def test_read_only_folder(folder, capsys):
    undo = _read_only(folder)
    try:
        rc, _, err = run(["trigger", folder, "sks"], capsys)
    finally:
        undo()
    assert rc == 2
    line = error_line(err)
    assert line.startswith(f"error: {folder}: cannot write there (") and line.endswith("); nothing was changed")
    assert texts(folder) == CAPTIONS


def test_recursive_and_caption_extension(folder, capsys):
    sub = folder / "more"
    write_image(str(sub / "e.png"), (8, 8), seed=9)
    write_text(str(sub / "e.txt"), "cat, cat")
    write_text(str(sub / "e.caption"), "cat, cat")
    assert run(["dedupe", folder, "--caption_extension", ".txt"], capsys)[1].startswith("dedupe: 0 caption(s)")
    rc, out, _ = run(["dedupe", folder, "--caption_extension", ".txt", "--recursive"], capsys)
    assert rc == 0 and out.startswith("dedupe: 1 caption(s) changed, 0 unchanged")
    assert read_text(sub / "e.txt") == "cat" and read_text(sub / "e.caption") == "cat, cat"
    assert texts(folder) == CAPTIONS
    assert run(["undo", folder], capsys)[0] == 0 and read_text(sub / "e.txt") == "cat, cat"


def test_crlf_lines_keep_their_ending(tmp_path, capsys):
    write_image(str(tmp_path / "a.png"), (8, 8))
    write_text(str(tmp_path / "a.caption"), "cat, cat\r\ndog, sky\r\n")
    assert run(["dedupe", tmp_path], capsys)[0] == 0
    assert read_text(tmp_path / "a.caption") == "cat\r\ndog, sky\r\n"


def test_several_trigger_tags_are_added_once(folder, capsys):
    assert run(["trigger", folder, "sks, thing"], capsys)[0] == 0
    assert read_text(folder / "b.caption") == "sks, thing, cat, sofa"
    rc, out, _ = run(["trigger", folder, "sks,thing"], capsys)
    assert rc == 0 and out.startswith("trigger: 0 caption(s) changed, 4 unchanged")
    assert run(["remove", folder, "thing, cat"], capsys)[0] == 0
    assert read_text(folder / "b.caption") == "sks, sofa"
    rc, _, err = run(["remove", folder, " , "], capsys)
    assert rc == 2 and error_line(err) == "error: tag ' , ': no tag"
