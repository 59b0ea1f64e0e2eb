"""Bulk caption edits with undo: a trigger word first, find / replace (plain or regex), a tag
removed, repeated tags dropped; tags listed by frequency.

A caption is the text file ``<image stem><caption_extension>`` beside an image (the captions the
trainer reads). An edit reads every caption first (a file that is not UTF-8 stops it before
anything is written), then writes its undo journal, then replaces each changed file atomically
(library/files.py): a caption is never half-written. If a write fails, the files already written
are put back, so an edit happens to all of its files or to none.

The undo journal: ``<folder>/.sdtk-caption-undo/<time>-<operation>.json`` holds each changed
file's path (relative to the folder) and its text before and after the edit. ``undo(folder)`` restores the newest journal's files and
removes it (undo again for the edit before); a file changed since (by hand, by another tool) is
left as it is and named, so no newer text is lost. One edit at a time per folder: a lock file in
the journal folder; a second edit meanwhile is refused in one line. The trainer never reads the
journal folder (folder scans skip hidden folders)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from library import files, text_files
from library.data.folders import IMAGE_EXTENSIONS
from library.errors import DataError

JOURNAL_DIR = ".sdtk-caption-undo"
LOCK = "lock"


def find_images(folder: str, recursive: bool = False) -> list[Path]:
    """The images of ``folder`` (its subfolders too with ``recursive``), sorted as sd-scripts'
    ``glob_images_pathlib`` sorts them; the extension in any letter case."""
    if not os.path.isdir(folder):
        raise DataError(f"{folder}: no such folder")
    root = Path(folder)
    found = root.rglob("*") if recursive else root.glob("*")
    return sorted(p for p in found if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())


def check_extension(caption_extension: str) -> None:
    if not isinstance(caption_extension, str) or not caption_extension.startswith(".") \
            or len(caption_extension) < 2 or "/" in caption_extension:
        raise DataError(f"--caption_extension {caption_extension!r}: an extension starts with '.'")


def caption_files(folder: str, caption_extension: str = ".caption", recursive: bool = False) -> list[str]:
    """The caption files of the folder's images (images without one are not listed)."""
    check_extension(caption_extension)
    paths = (str(p.with_suffix(caption_extension)) for p in find_images(folder, recursive))
    return [p for p in paths if os.path.isfile(p)]


def read_text(path: str) -> str:
    return text_files.read(path, DataError, "caption file")


# -- the edits: text in, text out ----------------------------------------------------------------
def split_tags(line: str) -> list[str]:
    return [t.strip() for t in line.split(",") if t.strip()]


def _per_line(text: str, edit: Callable[[list[str]], list[str]]) -> str:
    """``edit`` on each line's tags; a line whose tags do not change keeps its exact text."""
    out = []
    for line in text.split("\n"):
        tags = split_tags(line)
        new = edit(tags)
        out.append(line if new == tags else ", ".join(new) + ("\r" if line.endswith("\r") else ""))
    return "\n".join(out)


def _tags_given(value: str, what: str) -> list[str]:
    tags = split_tags(value)
    if not tags:
        raise DataError(f"{what} {value!r}: no tag")
    return tags


def add_trigger(text: str, word: str) -> str:
    """``word`` (one tag, or several separated by commas) first in each line, moved there where
    it is elsewhere in the line; a line that already starts with it is left as it is."""
    first = _tags_given(word, "trigger word")
    if not text.strip():
        return ", ".join(first)
    n = len(first)
    return _per_line(text, lambda tags: tags if tags[:n] == first else first + [t for t in tags if t not in first])


def remove_tag(text: str, tag: str) -> str:
    """Every tag equal to ``tag`` (several: separated by commas) dropped."""
    gone = set(_tags_given(tag, "tag"))
    return _per_line(text, lambda tags: [t for t in tags if t not in gone])


def rename_tag(text: str, old: str, new: str) -> str:
    """Every tag equal to ``old`` becomes ``new`` (one tag each); a tag then repeated in a line is
    kept once, where it first stands."""
    (src,), (dst,) = _one_tag(old, "tag"), _one_tag(new, "new tag")
    return _per_line(text, lambda tags: list(dict.fromkeys(dst if t == src else t for t in tags)))


def _one_tag(value: str, what: str) -> list[str]:
    tags = _tags_given(value, what)
    if len(tags) != 1:
        raise DataError(f"{what} {value!r}: one tag (no comma)")
    return tags


def dedupe(text: str) -> str:
    """Each line's repeated tags dropped, the first of each kept in place."""
    return _per_line(text, lambda tags: list(dict.fromkeys(tags)))


def replacer(find: str, replace: str, regex: bool = False) -> Callable[[str], str]:
    """Plain text or a Python regular expression (``\\1`` groups in ``replace``) over the whole
    caption."""
    if not find:
        raise DataError("--find: empty text")
    if not regex:
        return lambda text: text.replace(find, replace)
    try:
        pattern = re.compile(find)
        pattern.sub(replace, "")  # a bad group reference in replace fails here, not mid-edit
    except re.error as e:
        raise DataError(f"--find / --replace: not a valid regular expression ({e})") from None
    return lambda text: pattern.sub(replace, text)


def tag_frequencies(paths: list[str]) -> list[tuple[str, int]]:
    """(tag, number of captions holding it), most frequent first, then by name."""
    counts: Counter[str] = Counter()
    for path in paths:
        counts.update({t for line in read_text(path).split("\n") for t in split_tags(line)})
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


# -- applying an edit: lock, journal, atomic writes, undo ----------------------------------------
@dataclass
class EditResult:
    changed: list[str] = field(default_factory=list)
    unchanged: int = 0
    journal: str | None = None
    kept: list[str] = field(default_factory=list)  # undo: files changed since the edit, left as they are


def _journal_dir(folder: str) -> str:
    return os.path.join(os.path.abspath(folder), JOURNAL_DIR)


@contextlib.contextmanager
def folder_lock(folder: str):
    """The folder's edit lock; a live holder is a DataError, a dead one's lock is taken over.
    Creating it is also the check that the folder can be written to."""
    if not os.path.isdir(folder):
        raise DataError(f"{folder}: no such folder")
    jdir = _journal_dir(folder)
    lock = os.path.join(jdir, LOCK)
    for _ in range(2):
        try:
            os.makedirs(jdir, exist_ok=True)
            _create_with_pid(lock)
            break
        except FileExistsError:
            try:
                with open(lock, encoding="utf-8") as f:
                    pid = int(f.read().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and files.pid_alive(pid):
                raise DataError(f"{folder}: another caption edit is running (pid {pid}); "
                                "nothing was changed") from None
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock)  # its writer was killed
        except OSError as e:
            raise DataError(f"{folder}: cannot write there ({e.strerror or e}); nothing was changed") from None
    else:
        raise DataError(f"{folder}: cannot take the edit lock {lock}; nothing was changed")
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(lock)


def _create_with_pid(lock: str) -> None:
    """The lock file, holding this process's pid from the moment it exists (FileExistsError:
    held). Written beside it and hard-linked into place: a lock created empty and written after
    would let another taker read no pid in between, take it for a dead writer's and remove it,
    and both edits would run."""
    tmp = f"{lock}.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))
    try:
        os.link(tmp, lock)
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links (exFAT, some network shares): create, then write
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    finally:
        os.remove(tmp)


def _write(path: str, text: str | None) -> None:
    """``text`` atomically; None: the file removed (a caption that did not exist before)."""
    if text is None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise files.SaveError(path, e.strerror or str(e)) from None
        return
    with files.atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)


def _write_all(pairs: list[tuple[str, str | None, str | None]]) -> None:
    """Write each (path, before, after)'s after (None: no file); on a failure put back what was
    written."""
    done: list[tuple[str, str | None, str | None]] = []
    for path, before, after in pairs:
        try:
            _write(path, after)
        except files.SaveError:
            for p, b, _ in reversed(done):
                with contextlib.suppress(files.SaveError):
                    _write(p, b)
            raise
        done.append((path, before, after))


def edit_captions(folder: str, paths: list[str], edit: Callable[[str], str], operation: str) -> EditResult:
    """Apply ``edit`` to each caption file of ``paths`` (under ``folder``), with an undo journal
    in ``folder``; files whose text does not change are not written. A path without a file is
    edited from "" and written only when the edit gives text (undo removes it again)."""
    with folder_lock(folder):
        pairs: list[tuple[str, str | None, str | None]] = []
        for path in paths:
            before = read_text(path) if os.path.lexists(path) else None
            after = edit(before or "")
            if after != (before or ""):
                pairs.append((path, before, after))
        result = EditResult(unchanged=len(paths) - len(pairs))
        if not pairs:
            return result
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{time.time_ns() % 10**9:09d}"
        result.journal = os.path.join(_journal_dir(folder), f"{stamp}-{operation}.json")
        root = os.path.abspath(folder)
        doc = {"operation": operation, "created_utc": stamp,
               "files": [{"path": os.path.relpath(os.path.abspath(p), root), "before": b, "after": a}
                         for p, b, a in pairs]}
        with files.atomic_path(result.journal) as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(doc, f, ensure_ascii=False, indent=1)
        try:
            _write_all(pairs)
        except files.SaveError:
            os.remove(result.journal)
            raise
        result.changed = [p for p, _, _ in pairs]
        return result


def journals(folder: str) -> list[str]:
    """The folder's undo journals, oldest first."""
    jdir = _journal_dir(folder)
    if not os.path.isdir(jdir):
        return []
    return [os.path.join(jdir, n) for n in sorted(os.listdir(jdir)) if n.endswith(".json")]


def undo(folder: str) -> EditResult:
    """Undo the folder's newest edit (see the module doc)."""
    with folder_lock(folder):
        found = journals(folder)
        if not found:
            raise DataError(f"{folder}: no caption edit to undo (no journal in {_journal_dir(folder)})")
        journal = found[-1]
        try:
            doc = json.loads(text_files.read(journal, DataError, "undo journal"))
            entries = [(os.path.join(folder, e["path"]), e["before"], e["after"]) for e in doc["files"]]
        except (ValueError, KeyError, TypeError):
            raise DataError(f"undo journal {journal}: not a journal this tool wrote") from None
        result = EditResult(journal=journal)
        pairs: list[tuple[str, str | None, str | None]] = []
        for path, before, after in entries:
            current = read_text(path) if os.path.isfile(path) else None
            if current == after:
                pairs.append((path, after, before))
            elif current != before:
                result.kept.append(path)
        _write_all(pairs)
        os.remove(journal)
        result.changed = [p for p, _, _ in pairs]
        return result
