"""The images ``validation_split`` holds out of training, and the fixed caption they are evaluated
with (library/training/validation.py computes their loss; building the training set and the cache
stage need only these)."""
from __future__ import annotations

import dataclasses
import hashlib
import os

from library.data.folders import process_caption
from library.errors import UserError


class ValidationError(UserError):
    pass


def split_items(items: list, fraction: float, seed: int, where: str) -> tuple[list, list]:
    """(train, held out) of one dataset's images, keyed by (seed, place_in_dataset); both keep
    scan order."""
    if not fraction:
        return items, []
    n = len(items)
    if n < 2:
        raise ValidationError(f"validation_split: {where} has {n} image(s); holding some out "
                              "needs at least 2 (one to train, one to validate)")
    k = min(n - 1, max(1, round(n * fraction)))

    def key(it):
        return hashlib.sha256(f"{seed}\0{place_in_dataset(it)}".encode()).hexdigest()

    held = {id(it) for it in sorted(items, key=key)[:k]}
    return [it for it in items if id(it) not in held], [it for it in items if id(it) in held]


def place_in_dataset(item) -> str:
    """The image's concept folder name and its path inside that folder ("1_sks/a/x.png"), with /
    separators: what stays when a dataset is moved (the absolute path where it has no folder)."""
    if not item.image_dir:
        return item.path
    inside = os.path.relpath(item.path, item.image_dir)
    if inside.startswith(os.pardir):
        return item.path
    name = os.path.basename(os.path.normpath(item.image_dir))
    return "/".join((name, *inside.split(os.sep)))


def caption(item) -> str:
    o = item.captions
    if o is None:
        return item.caption
    fixed = dataclasses.replace(o, shuffle_caption=False, caption_dropout_rate=0.0,
                                caption_dropout_every_n_epochs=0, caption_tag_dropout_rate=0.0)
    return process_caption(item.caption, fixed, 0, None)
