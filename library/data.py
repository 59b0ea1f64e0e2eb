"""Dataset scan for the sd-scripts folder convention, captions, repeats and reg balancing.

``train_data_dir`` holds ``N_concept`` folders: ``N`` is the number of repeats, the text after
the first ``_`` is the class tokens (``10_sks dog`` -> 10 repeats, ``sks dog``). Each image's
caption comes from ``<stem><caption_extension>``; a missing caption falls back to the class tokens.

Pipeline order (so that every skip happens before the step plan is fixed):
``scan_concept_dirs`` (train, and reg with ``is_reg=True``) -> ``BucketManager.assign`` (sets
``bucket``/``resized_size``, skips images that fit no bucket) -> ``balance_regularization`` ->
``expand_repeats(train + balanced_reg)`` = the epoch's global list.

No torch import here: ``--dry_run`` scans the dataset and prints the step plan without torch.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from PIL import Image

from library.errors import UserError

logger = logging.getLogger(__name__)

# sd-scripts' IMAGE_EXTENSIONS (library/train_util.py) without the optional avif/jxl plugins.
# sd-scripts lists ".png" and ".PNG" only; we match any letter case.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")

# EXIF orientations that rotate by 90 or 270 degrees, i.e. swap width and height.
_EXIF_ORIENTATION = 0x0112
_SWAPPING_ORIENTATIONS = (5, 6, 7, 8)


class DataError(UserError):
    """Bad dataset input. The message is one line naming the file, folder or option."""


@dataclass
class ImageItem:
    path: str
    caption: str
    num_repeats: int
    is_reg: bool
    class_tokens: str | None
    size: tuple[int, int]  # (w, h) as displayed, i.e. after EXIF orientation
    bucket: tuple[int, int] | None = None  # (w, h), set by BucketManager.assign
    resized_size: tuple[int, int] | None = None  # (w, h) before the crop, set with bucket
    image_dir: str = ""  # the concept folder; for tag frequency metadata and disk caches


def image_size(path: str) -> tuple[int, int]:
    """(w, h) after EXIF orientation, from the header only (no pixel decode)."""
    with Image.open(path) as img:
        w, h = img.size
        try:
            orientation = img.getexif().get(_EXIF_ORIENTATION)
        except Exception:  # a broken EXIF block is not worth a skip: orientation is then unknown
            orientation = None
    return (h, w) if orientation in _SWAPPING_ORIENTATIONS else (w, h)


def check_image(path: str) -> tuple[int, int]:
    """Read the header and decode the pixels once; return (w, h). Raises DataError naming the file.

    Decoding every image at scan time costs about one image load per file (seconds for hundreds
    of images, minutes for tens of thousands), but it is the only way to skip a broken file
    before the step plan is fixed, so the plan stays exactly what then happens.
    """
    try:
        size = image_size(path)
        with Image.open(path) as img:
            img.load()
    # PIL raises many types for malformed files (OSError, SyntaxError, ValueError, struct.error,
    # DecompressionBombError ...); all of them mean "this file cannot be used".
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot decode image {path}: {reason}") from None
    if size[0] < 1 or size[1] < 1:
        raise DataError(f"cannot decode image {path}: empty image")
    return size


def parse_concept_dir_name(name: str) -> tuple[int, str | None] | None:
    """``"10_sks dog"`` -> ``(10, "sks dog")``; ``None`` when the name has no repeat count.

    As sd-scripts: repeats = the integer before the first ``_``, class tokens = the rest joined
    back with ``_``. ``"3"`` alone gives no class tokens.
    """
    head, _, rest = name.partition("_")
    try:
        repeats = int(head)
    except ValueError:
        return None
    return repeats, (rest if rest else None)


def read_caption(image_path: str, caption_extension: str) -> str | None:
    """The first line of ``<stem><caption_extension>``, stripped (sd-scripts without wildcards).

    Returns None when the file does not exist or holds only whitespace. A file that is not
    UTF-8 is an error naming it (sd-scripts raises too).
    """
    cap_path = os.path.splitext(image_path)[0] + caption_extension
    if not os.path.isfile(cap_path):
        return None
    try:
        with open(cap_path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError:
        raise DataError(f"caption file {cap_path} is not UTF-8 text") from None
    caption = lines[0].strip() if lines else ""
    return caption or None


def _list_images(folder: str) -> list[str]:
    names = [n for n in os.listdir(folder)
             if not n.startswith(".") and os.path.splitext(n)[1].lower() in IMAGE_EXTENSIONS]
    return [os.path.join(folder, n) for n in sorted(names) if os.path.isfile(os.path.join(folder, n))]


def scan_concept_dirs(root: str, caption_extension: str = ".caption", is_reg: bool = False,
                      log: logging.Logger = logger, option: str | None = None,
                      check_decode: bool = True) -> list[ImageItem]:
    """Scan ``root``'s ``N_concept`` folders into ImageItems, sorted by folder then file name.

    ``option`` names the run option in error messages (default ``train_data_dir``, or
    ``reg_data_dir`` when ``is_reg``). Warned, not fatal (as sd-scripts): folders without a
    repeat count or with N < 1, empty folders, missing captions (one line per folder with the
    count), images that fail to decode (one line per file, skipped). Fatal: a missing root, no
    ``N_concept`` folder at all, or no usable image.
    """
    option = option or ("reg_data_dir" if is_reg else "train_data_dir")
    if not root or not os.path.isdir(root):
        raise DataError(f"{option} {root!r} does not exist or is not a directory")

    items: list[ImageItem] = []
    valid_folders = 0
    skipped_images = 0
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(folder):
            continue  # hidden folders include our own .sdcache
        parsed = parse_concept_dir_name(name)
        if parsed is None or parsed[0] < 1:
            log.warning(f"ignoring folder {folder}: its name is not N_concept with N >= 1 repeats")
            continue
        valid_folders += 1
        repeats, class_tokens = parsed
        paths = _list_images(folder)
        if not paths:
            log.warning(f"ignoring folder {folder}: no images ({', '.join(IMAGE_EXTENSIONS)})")
            continue
        missing = 0
        for path in paths:
            try:
                size = check_image(path) if check_decode else image_size(path)
            except DataError as e:
                log.warning(f"skipping image: {e}")
                skipped_images += 1
                continue
            except Exception as e:  # header-only read with check_decode=False
                log.warning(f"skipping image: cannot read {path}: {e}")
                skipped_images += 1
                continue
            caption = read_caption(path, caption_extension)
            if caption is None:
                missing += 1
                caption = class_tokens or ""
            items.append(ImageItem(path=path, caption=caption, num_repeats=repeats, is_reg=is_reg,
                                   class_tokens=class_tokens, size=size, image_dir=folder))
        if missing:
            fallback = f"the class tokens {class_tokens!r}" if class_tokens else "an empty caption"
            log.warning(f"{missing} image(s) in {folder} have no {caption_extension} caption file: "
                        f"using {fallback}")

    if valid_folders == 0:
        raise DataError(f"{option} {root} has no N_concept folders (e.g. 10_sks dog)")
    if not items:
        raise DataError(f"{option} {root} has no usable images"
                        + (f" ({skipped_images} skipped as unreadable)" if skipped_images else ""))
    if skipped_images:
        log.warning(f"{skipped_images} unreadable image(s) skipped in {option} {root}")
    return items


def count_with_repeats(items: list[ImageItem]) -> int:
    return sum(it.num_repeats for it in items)


def balance_regularization(train_items: list[ImageItem], reg_items: list[ImageItem]) -> list[ImageItem]:
    """Reg items with their repeats raised to match the train count, exactly as sd-scripts.

    sd-scripts' DreamBoothDataset: ``n = 0``; first pass over the reg images in order, each
    registered with its own ``num_repeats`` (``n += num_repeats``); later passes add one repeat
    per image (``n += 1``); it stops as soon as ``n >= num_train_images`` (train count with
    repeats). So reg images not reached in the first pass are unused, and the reg total can
    exceed the train total when the first pass overshoots. Returns new items (inputs untouched),
    only the used ones, in order.
    """
    target = count_with_repeats(train_items)
    out: list[ImageItem] = []
    if not reg_items or target <= 0:
        return out
    n = 0
    for it in reg_items:  # first pass
        out.append(dataclasses.replace(it))
        n += it.num_repeats
        if n >= target:
            return out
    while n < target:  # later passes: one more repeat each, in order
        for it in out:
            it.num_repeats += 1
            n += 1
            if n >= target:
                break
    return out


def expand_repeats(items: list[ImageItem]) -> list[ImageItem]:
    """The epoch's global list: each item ``num_repeats`` times in a row, items in the given order.

    The same object appears several times; the trainer keys randomness by list position.
    """
    return [it for it in items for _ in range(it.num_repeats)]
