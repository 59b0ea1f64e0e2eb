"""Symlinks that do not resolve, named before anything reads through them (a cleaned hub cache
leaves a snapshot's links pointing at removed blobs; a copied folder may hold a link loop)."""
from __future__ import annotations

import errno
import os


def problem(path: str) -> str:
    """What is wrong with a symlink that does not resolve: a loop, or a missing target."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
    return f"a broken symlink (its target {os.readlink(path)} does not exist)"


def first_broken(folder: str) -> str | None:
    """The first symlink under ``folder`` that does not resolve, or None (links not followed)."""
    for root, dirs, files in os.walk(folder):
        for name in sorted(dirs) + sorted(files):
            path = os.path.join(root, name)
            if os.path.islink(path) and not os.path.exists(path):
                return path
    return None
