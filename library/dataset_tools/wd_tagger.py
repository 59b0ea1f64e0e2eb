"""Tag a folder of images with a WD tagger: the images found as sd-scripts finds them, each
preprocessed as sd-scripts does (alpha composed on white, BGR, padded to a white square, resized
with OpenCV's area filter when larger than the model's size and PIL's Lanczos when smaller), scored
in batches, and written as caption files (or one metadata JSON / JSONL with ``output_path``).

``tag_folder`` is the one entry: finetune/tag_images_by_wd14_tagger.py calls it, and so can a UI
job (progress through ``progress(done, total)``). An image that cannot be read, or whose existing
caption cannot be read for ``append_tags``, is reported in one line and skipped; its caption file
is left as it was. Captions and the metadata file are replaced atomically.
"""
from __future__ import annotations

import collections
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from library import text_files
from library.data.folders import IMAGE_EXTENSIONS
from library.dataset_tools import wd_tags
from library.dataset_tools.wd_model import TaggerError, TaggerModel
from library.errors import first_line
from library.files import atomic_path
from library.log import logger



def list_images(folder: str, recursive: bool) -> list[str]:
    """The images under ``folder`` (its subfolders too with ``recursive``), sorted as pathlib
    sorts them (sd-scripts' glob_images_pathlib); any letter case of the extensions."""
    root = Path(folder)
    if not root.is_dir():
        raise TaggerError(f"train_data_dir {folder}: not a folder")
    found = root.rglob("*") if recursive else root.glob("*")
    return [str(p) for p in sorted(p for p in found
                                   if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())]


def preprocess(image: Image.Image, size: int) -> np.ndarray:
    """(size, size, 3) float32 BGR 0..255, as sd-scripts' preprocess_image."""
    import cv2  # lazy: an optional dependency (the [tagger] extra), OpenCV's INTER_AREA as sd-scripts

    if image.mode in ("RGBA", "LA") or "transparency" in image.info:
        image = image.convert("RGBA")
    elif image.mode != "RGB":
        image = image.convert("RGB")
    if image.mode == "RGBA":
        white = Image.new("RGB", image.size, (255, 255, 255))
        white.paste(image, mask=image.split()[3])
        image = white
    bgr = np.asarray(image)[:, :, ::-1]
    side = max(bgr.shape[:2])
    pad_y, pad_x = side - bgr.shape[0], side - bgr.shape[1]
    square = np.pad(bgr, ((pad_y // 2, pad_y - pad_y // 2), (pad_x // 2, pad_x - pad_x // 2), (0, 0)),
                    mode="constant", constant_values=255)
    if side >= size:
        square = cv2.resize(square, (size, size), interpolation=cv2.INTER_AREA)
    else:  # sd-scripts' resize_image: Lanczos through PIL on the RGB image
        rgb = Image.fromarray(np.ascontiguousarray(square[:, :, ::-1]))
        square = np.asarray(rgb.resize((size, size), resample=Image.LANCZOS))[:, :, ::-1]
    return square.astype(np.float32)


def load_image(path: str, size: int) -> tuple[np.ndarray, tuple[int, int]]:
    """The preprocessed image and its (w, h); a file PIL cannot decode is one TaggerError line."""
    try:
        with Image.open(path) as im:
            return preprocess(im, size), im.size
    except (TaggerError, MemoryError):
        raise
    except Exception as e:  # PIL raises many types for malformed files
        raise TaggerError(f"cannot read image {path}: {first_line(e)}") from None


@dataclass(frozen=True)
class OutputOptions:
    """Where and how the captions go (sd-scripts' flags of the same names)."""
    caption_extension: str = ".txt"
    append_tags: bool = False
    output_path: str | None = None  # one metadata file (.json, or .jsonl) instead of caption files
    recursive: bool = False
    batch_size: int = 1
    max_data_loader_n_workers: int | None = None  # None / 0: images are read in this thread
    debug: bool = False

    def __post_init__(self):
        if self.batch_size < 1:
            raise TaggerError(f"--batch_size {self.batch_size}: must be 1 or more")
        if self.max_data_loader_n_workers is not None and self.max_data_loader_n_workers < 0:
            raise TaggerError(f"--max_data_loader_n_workers {self.max_data_loader_n_workers}: "
                              "must be 0 or more")


@dataclass
class Summary:
    """What a run did: captions by image path, tag frequencies in first-seen order, failures."""
    captions: dict[str, str] = field(default_factory=dict)
    frequencies: dict[str, int] = field(default_factory=dict)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    images: int = 0

    def sorted_frequencies(self) -> list[tuple[str, int]]:
        return sorted(self.frequencies.items(), key=lambda kv: kv[1], reverse=True)


def _loaded(paths: list[str], size: int, workers: int | None):
    """(path, image or None, (w, h) or error line) in order; with workers, read ahead in threads
    (a bounded window, so a large folder is never held in memory at once)."""
    def one(path):
        try:
            img, wh = load_image(path, size)
            return path, img, wh
        except TaggerError as e:
            return path, None, str(e)

    if not workers:
        yield from map(one, paths)
        return
    window: collections.deque = collections.deque()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for path in paths:
            window.append(pool.submit(one, path))
            if len(window) > 4 * workers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


def _check_output_path(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise TaggerError(f"--output_path {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise TaggerError(f"--output_path {path}: folder {folder} is not writable")


def _write_text(path: str, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


def write_metadata(path: str, entries: dict[str, dict]) -> None:
    """sd-scripts' --output_path files: JSON ``{image: {"tags", "image_size"}}``, or for a
    ``.jsonl`` path one ``{"image_path", "caption", "image_size"}`` line per image."""
    if path.endswith(".jsonl"):
        text = "".join(json.dumps({"image_path": k, "caption": v["tags"],
                                   "image_size": v["image_size"]}) + "\n"
                       for k, v in entries.items())
    else:
        text = json.dumps(entries, ensure_ascii=False, indent=4)
    _write_text(path, text)


def _caption_text(tagged: wd_tags.Tagged, caption_path: str, append: bool, separator: str) -> str:
    """The tags joined, or with ``append`` (--append_tags) after an existing caption's tags."""
    if append and os.path.exists(caption_path):
        return wd_tags.appended(text_files.read(caption_path, TaggerError, "caption file"),
                                tagged.tags, separator)
    return separator.join(tagged.tags)


def tag_folder(folder: str, model: TaggerModel, tags: wd_tags.TagOptions, out: OutputOptions,
               progress: Callable[[int, int], None] | None = None,
               log: logging.Logger = logger) -> Summary:
    """Tag every image of ``folder``; returns what was written (``Summary``)."""
    paths = list_images(folder, out.recursive)
    if not paths:
        raise TaggerError(f"train_data_dir {folder}: no images ({', '.join(IMAGE_EXTENSIONS)}"
                          f"{'' if out.recursive else '; subfolders need --recursive'})")
    if out.output_path:
        _check_output_path(out.output_path)
    log.info(f"found {len(paths)} images.")
    batch = out.batch_size
    if model.fixed_batch and model.fixed_batch != batch:
        log.warning(f"--batch_size {batch} does not match the model's batch size "
                    f"{model.fixed_batch}: using {model.fixed_batch}")
        batch = model.fixed_batch
    labels = wd_tags.prepare_labels(model.labels, tags)
    assemble = (wd_tags.tags_of_mapping_layout if model.layout.logits
                else wd_tags.tags_of_csv_layout)
    sep = tags.caption_separator
    summary = Summary(images=len(paths))
    metadata: dict[str, dict] = {}
    pending: list = []

    def run_batch():
        probs = model.scores(np.stack([img for _, img, _ in pending]))
        for (path, _, wh), prob in zip(pending, probs):
            tagged = assemble(prob, labels, tags)
            caption_path = os.path.splitext(path)[0] + out.caption_extension
            try:
                text = _caption_text(tagged, caption_path, out.append_tags, sep)
            except TaggerError as e:  # an existing caption that cannot be read is kept as it is
                log.error(f"skipping {path}: {e}")
                summary.failed.append((path, str(e)))
                continue
            if out.output_path:
                metadata[path] = {"tags": text, "image_size": list(wh)}
            else:
                _write_text(caption_path, text + "\n")
            summary.captions[path] = text
            for t in tagged.counted:
                summary.frequencies[t] = summary.frequencies.get(t, 0) + 1
            if out.debug:
                for line in tagged.debug_lines(path, sep):
                    log.info(line)
        pending.clear()

    done = 0
    for path, img, info in _loaded(paths, model.size, out.max_data_loader_n_workers):
        done += 1
        if img is None:
            log.error(info)
            summary.failed.append((path, info))
        else:
            pending.append((path, img, info))
            if len(pending) >= batch:
                run_batch()
        if progress and not pending:
            progress(done, len(paths))
    if pending:
        run_batch()
        if progress:
            progress(done, len(paths))
    if out.output_path:
        write_metadata(out.output_path, metadata)
        log.info(f"captions saved to {out.output_path}")
    return summary
