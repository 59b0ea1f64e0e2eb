"""Class images for prior preservation (``num_class_images``, diffusers' DreamBooth name): the
images a regularisation folder lacks, planned before any weight loads, keyed by content.

A reg folder (a ``reg_data_dir`` ``N_class`` folder or a dataset's ``is_reg`` subset) that holds
fewer than ``num_class_images`` images gets the missing ones generated with the base model before
training (library/outputs/class_images.py, through gen_img's ``Generator``), from its class
prompt (the folder's class tokens). Image ``i`` (0, 1, ...) of a folder is drawn with seed
``seed + i``; its file is ``<cache>/class_images/<key>.png`` where the key is the sha256 of the
base model's identity (``pretrained_model_name_or_path`` and the options gen_img renders with,
``GEN_IMG_RUN_OPTIONS``: ``vae``, a flow model's files, Lumina 2's ``system_prompt``, ...; a path by
each weights file's size and mtime, a built-in / hub name as it is), the prompt, the seed, the size, the sampler,
steps and CFG scale. So a second run finds the same files and generates nothing; a changed
setting names new files (the old ones stay). ``<cache>`` is the folder's ``.sdcache`` (or
``cache_dir``): the user's own images are never written, and the hidden folder is not scanned
as user images. The planned items are in the training set from the start, so the step plan and
the memory estimate count the images that will exist.

No torch import: the plan is made without it.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from library.config.options import GEN_IMG_RUN_OPTIONS
from library.data import folders
from library.errors import DataError

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

FOLDER = "class_images"


@dataclass(frozen=True)
class ClassImage:
    """One planned class image: its file and what it is drawn from."""
    path: str
    prompt: str
    seed: int
    width: int
    height: int
    steps: int | None  # None: gen_img's default for the model's family
    scale: float | None
    sampler: str


def _stat_identity(path: str) -> list:
    """A local model path as (file, size, mtime_ns) of its files: a file replaced or rewritten in
    place gets a new identity, without hashing gigabytes at every plan."""
    path = os.path.abspath(os.path.expanduser(path))
    files = [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(d, n) for d, dirs, names in os.walk(path, followlinks=True)
                       for n in names if not n.startswith(".") and "/." not in d[len(path):])
    out = []
    for f in files:
        st = os.stat(f)
        out.append([os.path.relpath(f, path) if f != path else f, st.st_size, st.st_mtime_ns])
    return out


def model_identity(opts: Options) -> list:
    """The base model's identity: built-in and hub names as they are, local paths by their files,
    with the other run options gen_img renders them with (its parts, text settings: a Lumina 2
    run's system_prompt)."""
    out = []
    for name in ("pretrained_model_name_or_path", *GEN_IMG_RUN_OPTIONS):
        value = getattr(opts, name)
        if isinstance(value, str) and value and os.path.exists(os.path.expanduser(value)):
            out.append([name, _stat_identity(value)])
        elif value not in (None, False, ""):
            out.append([name, value])
    return out


def image_key(identity: list, prompt: str, seed: int, width: int, height: int,
              steps: int | None, scale: float | None, sampler: str) -> str:
    text = json.dumps({"model": identity, "prompt": prompt, "seed": seed, "size": [width, height],
                       "steps": steps, "scale": scale, "sampler": sampler, "format": 1},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cache_folder(folder: str, cache_dir: str | None) -> str:
    return os.path.join(cache_dir or os.path.join(folder, ".sdcache"), FOLDER)


def plan_folder(opts: Options, folder: str, class_tokens: str | None, have: int, num_repeats: int,
                resolution, where: str, fields: dict) -> tuple[list, list]:
    """The missing class images of one reg folder holding ``have`` images: (ImageItems, the
    ClassImages to make). Files that exist and decode are reused; the others are to be made."""
    missing = opts.num_class_images - have
    if missing <= 0:
        return [], []
    if not class_tokens:
        raise DataError(f"num_class_images: {where} has no class tokens to prompt with (name the "
                        "folder N_class, e.g. 1_dog, or set the subset's class_tokens)")
    width, height = int(resolution[0]), int(resolution[1])
    identity = model_identity(opts)
    cache = cache_folder(folder, opts.cache_dir)
    items, planned = [], []
    for i in range(missing):
        seed = opts.seed + i
        args = (class_tokens, seed, width, height, opts.class_image_steps, opts.class_image_scale,
                opts.class_image_sampler)
        img = ClassImage(os.path.join(cache, image_key(identity, *args) + ".png"), *args)
        planned.append(img)
        items.append(folders.ImageItem(path=img.path, caption=class_tokens, num_repeats=num_repeats,
                                       is_reg=True, class_tokens=class_tokens, size=(width, height),
                                       image_dir=folder, **fields))
    return items, planned


def to_make(planned: list) -> list:
    """The planned images whose file is missing or does not decode (a broken file of ours is
    made again), each file once (with cache_dir, reg folders of one class prompt share them)."""
    out, seen = [], set()
    for img in planned:
        if img.path in seen:
            continue
        seen.add(img.path)
        if os.path.isfile(img.path):
            try:
                folders.check_image(img.path)
                continue
            except DataError:
                pass
        out.append(img)
    return out


def concept_folders(root: str) -> list[tuple[str, int, str | None]]:
    """(folder, repeats, class tokens) of ``reg_data_dir``'s N_class folders, sorted by name."""
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        parsed = folders.parse_concept_dir_name(name)
        if not name.startswith(".") and os.path.isdir(path) and parsed and parsed[0] >= 1:
            out.append((path, parsed[0], parsed[1]))
    return out
