"""A dataset check: one line per problem the trainer would meet or a user would not want.

- an image that cannot be read or is truncated (its header read and its pixels decoded, as the
  trainer's scan does: library/data/folders.py ``check_image``);
- a caption file that is not UTF-8 text (the trainer stops on it: library/text_files.py);
- images with exactly the same content (SHA-256 of the file's bytes), named together.

Every subfolder is checked except hidden ones (the latent cache, undo journals)."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from library import text_files
from library.data.folders import IMAGE_EXTENSIONS, check_image
from library.errors import DataError


@dataclass(frozen=True)
class Problem:
    kind: str  # "image", "caption", "duplicate"
    path: str
    message: str  # one line, naming the file(s)


def _walk(folder: str):
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in sorted(names):
            if not n.startswith("."):
                yield os.path.join(root, n)


def file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_dataset(folder: str, caption_extension: str = ".caption") -> list[Problem]:
    """The problems of ``folder``'s images and ``caption_extension`` files, in path order
    (duplicates last, one line per group)."""
    if not os.path.isdir(folder):
        raise DataError(f"{folder}: no such folder")
    problems: list[Problem] = []
    by_hash: dict[str, list[str]] = {}
    for path in _walk(folder):
        ext = os.path.splitext(path)[1].lower()
        if ext in IMAGE_EXTENSIONS:
            try:
                check_image(path)
            except DataError as e:
                problems.append(Problem("image", path, str(e)))
                continue
            by_hash.setdefault(file_hash(path), []).append(path)
        elif ext == caption_extension.lower():
            try:
                text_files.read(path, DataError, "caption file")
            except DataError as e:
                problems.append(Problem("caption", path, str(e)))
    for paths in by_hash.values():
        if len(paths) > 1:
            problems.append(Problem("duplicate", paths[0], "same image content: " + ", ".join(paths)))
    return problems
