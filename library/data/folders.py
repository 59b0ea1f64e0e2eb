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
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field

from PIL import Image

from library import symlinks, text_files
from library.config.dataset_config import CaptionOptions
from library.errors import DataError, first_line

logger = logging.getLogger(__name__)

# sd-scripts' IMAGE_EXTENSIONS (library/train_util.py) without the optional avif/jxl plugins.
# sd-scripts lists ".png" and ".PNG" only; we match any letter case.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")

# EXIF orientations that rotate by 90 or 270 degrees, i.e. swap width and height.
_EXIF_ORIENTATION = 0x0112
_SWAPPING_ORIENTATIONS = (5, 6, 7, 8)


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
    # per-subset settings (dataset config or the run options of the same names)
    captions: "CaptionOptions | None" = None  # None: the caption is used as it is
    flip_aug: bool = False
    random_crop: bool = False
    color_aug: bool = False  # sd-scripts' weak hue/brightness augmentation (library/data/color_aug.py)
    cache_dir: str | None = None  # None: <image_dir>/.sdcache
    # masked loss (library/data/images.py load_for_item): the image's alpha channel, or a mask image
    # (its first/red channel) of the same stem found in a conditioning_data_dir
    alpha_mask: bool = False
    mask_path: str | None = None
    # dataset config: the network multiplier while this image trains (its dataset's
    # network_multiplier, resolved down to the run's; None in folder mode), and custom_attributes' diff_output_preservation (the
    # target is the model's own prediction with the network disabled)
    network_multiplier: float | None = None
    dop: bool = False


def warmup_steps(o: CaptionOptions, total_steps: int | None) -> float:
    """sd-scripts' token_warmup_step in steps: below 1 a fraction of the run's steps (floored)."""
    w = o.token_warmup_step
    if 0 < w < 1:
        return math.floor(w * (total_steps or 0))
    return w


def draw_wildcards(caption: str, rng) -> str:
    """sd-scripts' wildcards: a multi-line caption is one line drawn from its lines; each
    ``{a|b|c}`` is one of its alternatives; ``{{`` and ``}}`` are literal braces."""
    if "\n" in caption:
        caption = rng.choice(caption.split("\n"))
    open_, close = "\u2985", "\u2986"  # placeholders not in the caption (as sd-scripts)
    while open_ in caption or close in caption:
        open_, close = open_ + "\u2985", close + "\u2986"
    caption = caption.replace("{{", open_).replace("}}", close)
    caption = re.sub(r"\{([^}]+)\}", lambda m: rng.choice(m.group(1).split("|")), caption)
    return caption.replace(open_, "{").replace(close, "}")


def process_caption(caption: str, o: CaptionOptions, epoch: int, rng, step: int | None = None,
                    total_steps: int | None = None) -> str:
    """sd-scripts' ``BaseDataset.process_caption``.

    ``rng`` is a ``random.Random`` keyed to the sample and epoch, so the result does not depend
    on the process count. Draw order as sd-scripts: the dropout draw (only when the rate is > 0),
    the wildcards (enable_wildcard), then the shuffle, then one draw per flexible tag for tag
    dropout. Tags are re-joined with ``", "`` as sd-scripts does, whatever the separator; then
    ``secondary_separator`` becomes ``caption_separator``. Token warmup keeps the first
    ``floor(step * (n - token_warmup_min) / warmup) + token_warmup_min`` of the n flexible tags
    while ``step`` (the optimizer steps done before this one) is below the warmup; ``step`` None
    (the text-encoder cache's variants, validation) is the caption after the warmup.
    """
    if o.caption_prefix:
        caption = o.caption_prefix + " " + caption
    if o.caption_suffix:
        caption = caption + " " + o.caption_suffix
    drop = o.caption_dropout_rate > 0 and rng.random() < o.caption_dropout_rate
    drop = drop or (o.caption_dropout_every_n_epochs > 0
                    and epoch % o.caption_dropout_every_n_epochs == 0)
    if drop:
        return ""
    caption = draw_wildcards(caption, rng) if o.enable_wildcard else caption.split("\n")[0]
    if o.shuffle_caption or o.token_warmup_step > 0 or o.caption_tag_dropout_rate > 0:
        caption = _shuffle_and_drop(caption, o, rng, step, total_steps)
    if o.secondary_separator:
        caption = caption.replace(o.secondary_separator, o.caption_separator)
    return caption


def _shuffle_and_drop(caption: str, o: CaptionOptions, rng, step, total_steps) -> str:
    sep = o.caption_separator
    fixed, flex, fixed_suffix = [], [], []
    if o.keep_tokens_separator and o.keep_tokens_separator in caption:
        fixed_part, flex_part = caption.split(o.keep_tokens_separator, 1)
        if o.keep_tokens_separator in flex_part:
            flex_part, suffix_part = flex_part.split(o.keep_tokens_separator, 1)
            fixed_suffix = [t.strip() for t in suffix_part.split(sep) if t.strip()]
        fixed = [t.strip() for t in fixed_part.split(sep) if t.strip()]
        flex = [t.strip() for t in flex_part.split(sep) if t.strip()]
    else:
        tokens = [t.strip() for t in caption.strip().split(sep)]
        flex = tokens[:]
        if o.keep_tokens > 0:
            fixed, flex = flex[:o.keep_tokens], tokens[o.keep_tokens:]
    warmup = warmup_steps(o, total_steps)
    if warmup and step is not None and step < warmup:
        n = math.floor(step * ((len(flex) - o.token_warmup_min) / warmup)) + o.token_warmup_min
        flex = flex[:n]
    if o.shuffle_caption:
        rng.shuffle(flex)
    if o.caption_tag_dropout_rate > 0:
        flex = [t for t in flex if rng.random() >= o.caption_tag_dropout_rate]
    return ", ".join(fixed + flex + fixed_suffix)


@dataclass
class ScanStats:
    """Files skipped while building the training set, reported once at the end."""
    unreadable: list = field(default_factory=list)
    too_small: list = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.unreadable) + len(self.too_small)

    def summary(self) -> str | None:
        if not self.total:
            return None
        parts = [f"{len(self.unreadable)} unreadable" if self.unreadable else "",
                 f"{len(self.too_small)} too small for any bucket" if self.too_small else ""]
        return f"skipped {self.total} image file(s) in total: " + ", ".join(p for p in parts if p)


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
        raise DataError(f"cannot decode image {path}: {first_line(e)}") from None
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


def read_caption(image_path: str, caption_extension: str, all_lines: bool = False) -> str | None:
    """The first line of ``<stem><caption_extension>``, stripped (sd-scripts without wildcards);
    with ``all_lines`` (enable_wildcard) its non-empty lines, stripped, joined with ``"\\n"``.

    Returns None when the file does not exist or holds only whitespace. A UTF-8 byte-order mark
    is dropped. A file that is not UTF-8 is an error naming it, raised while the dataset is
    scanned, before any weight loads (sd-scripts raises too; guessing an encoding would train on
    mojibake).
    """
    cap_path = os.path.splitext(image_path)[0] + caption_extension
    if not os.path.lexists(cap_path):
        return None
    text = text_files.read(cap_path, DataError, "caption file")
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # as readlines
    if all_lines:
        return "\n".join(ln.strip() for ln in lines if ln.strip()) or None
    return lines[0].strip() or None


def _list_images(folder: str, log: logging.Logger | None = logger) -> list[str]:
    names = [n for n in os.listdir(folder)
             if not n.startswith(".") and os.path.splitext(n)[1].lower() in IMAGE_EXTENSIONS]
    out = []
    for n in sorted(names):
        path = os.path.join(folder, n)
        if os.path.isfile(path):
            out.append(path)
        elif os.path.islink(path) and log is not None:  # an image meant to train: say why not
            log.warning(f"skipping {path}: {symlinks.problem(path)}")
    return out


def scan_image_folder(folder: str, *, num_repeats: int, class_tokens: str | None,
                      caption_extension: str = ".caption", is_reg: bool = False,
                      log: logging.Logger = logger, check_decode: bool = True,
                      stats: ScanStats | None = None, **item_fields) -> list[ImageItem]:
    """The images directly in ``folder`` (one sd-scripts subset) as ImageItems, sorted by name.

    Unreadable images are skipped with one warning line each (and counted in ``stats``); a
    missing or empty caption falls back to ``class_tokens`` (one line per folder with the
    count); images sharing a stem (``a.png``, ``a.jpg``) are all used and share the caption
    file, announced in one line. ``item_fields`` are set on every item (captions, flip_aug, ...).
    """
    stats = stats if stats is not None else ScanStats()
    items: list[ImageItem] = []
    paths = _list_images(folder, log)
    stems: dict[str, list[str]] = {}
    for path in paths:
        stems.setdefault(os.path.splitext(path)[0], []).append(os.path.basename(path))
    for stem, names in stems.items():
        if len(names) > 1:
            log.warning(f"images {', '.join(names)} in {folder} share the stem "
                        f"{os.path.basename(stem)!r}: all are used, with the one caption file "
                        f"{os.path.basename(stem)}{caption_extension}")
    missing = 0
    for path in paths:
        try:
            size = check_image(path) if check_decode else image_size(path)
        except DataError as e:
            log.warning(f"skipping image: {e}")
            stats.unreadable.append(path)
            continue
        except Exception as e:  # header-only read with check_decode=False
            log.warning(f"skipping image: cannot read {path}: {e}")
            stats.unreadable.append(path)
            continue
        captions = item_fields.get("captions")
        caption = read_caption(path, caption_extension,
                               all_lines=captions is not None and captions.enable_wildcard)
        if caption is None:
            missing += 1
            caption = class_tokens or ""
        items.append(ImageItem(path=path, caption=caption, num_repeats=num_repeats, is_reg=is_reg,
                               class_tokens=class_tokens, size=size, image_dir=folder,
                               **item_fields))
    if missing:
        fallback = f"the class tokens {class_tokens!r}" if class_tokens else "an empty caption"
        log.warning(f"{missing} image(s) in {folder} have no (or an empty) {caption_extension} "
                    f"caption file: using {fallback}")
    return items


def scan_concept_dirs(root: str, caption_extension: str = ".caption", is_reg: bool = False,
                      log: logging.Logger = logger, option: str | None = None,
                      check_decode: bool = True, stats: ScanStats | None = None,
                      **item_fields) -> list[ImageItem]:
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
    stats = stats if stats is not None else ScanStats()
    skipped_before = len(stats.unreadable)

    items: list[ImageItem] = []
    valid_folders = 0
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
        if not _list_images(folder, None):  # (scan_image_folder warns about broken links)
            log.warning(f"ignoring folder {folder}: no images ({', '.join(IMAGE_EXTENSIONS)})")
            continue
        items += scan_image_folder(folder, num_repeats=repeats, class_tokens=class_tokens,
                                   caption_extension=caption_extension, is_reg=is_reg, log=log,
                                   check_decode=check_decode, stats=stats, **item_fields)

    skipped_images = len(stats.unreadable) - skipped_before
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


# -- fine-tuning metadata files (in_json, a subset's metadata_file) -----------------------------
def _metadata_entries(path: str, option: str) -> list[tuple[str, dict]]:
    """(image key, entry) of a metadata file: JSON ``{key: {"caption", "tags"}}`` (sd-scripts'
    format) or JSONL, one ``{"image_path", "caption", "tags"}`` object per line."""
    if not os.path.isfile(path):
        raise DataError(f"{option} {path!r} does not exist or is not a file")

    text = text_files.read(path, DataError, option)
    if path.lower().endswith(".jsonl"):
        out = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError as e:
                raise DataError(f"{option} {path}: line {n} is not JSON ({e})") from None
            if not isinstance(entry, dict) or not isinstance(entry.get("image_path"), str):
                raise DataError(f"{option} {path}: line {n} is not an object with an image_path")
            out.append((entry["image_path"], entry))
        return out
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise DataError(f"{option} {path} is not JSON ({e}); JSON Lines files end in .jsonl") from None
    if not isinstance(doc, dict):
        raise DataError(f"{option} {path}: expected an object {{image: {{\"caption\": ..., "
                        "\"tags\": ...}}}}")
    return list(doc.items())


def _find_image(key: str, image_dir: str | None, base: str) -> str | None:
    """sd-scripts' lookup: the key as a path, else in image_dir (by name, or a stem with any image
    extension). Relative keys are tried in image_dir, next to the metadata file, then from the
    working folder (sd-scripts' only place for them: merge_captions_to_metadata.py --full_path
    writes the image's path as given)."""
    candidates = [key] if os.path.isabs(key) else \
        [os.path.join(d, key) for d in (image_dir, base) if d] + [key]
    for c in candidates:
        if os.path.isfile(c):
            return c
    if image_dir and os.path.isdir(image_dir):
        for ext in IMAGE_EXTENSIONS:
            for e in (ext, ext.upper()):
                c = os.path.join(image_dir, key + e)
                if os.path.isfile(c):
                    return c
    return None


def metadata_caption(entry, wildcard: bool = False) -> str | None:
    """sd-scripts' fine-tuning caption: the caption, then ``", "`` and the tags when there are
    tags; only tags when there is no caption; None when neither is there. With ``wildcard``
    (enable_wildcard) the caption's lines are alternatives: the tags (made one line) go after
    each non-empty line, as sd-scripts' FineTuningDataset does."""
    if not isinstance(entry, dict):
        return None
    caption, tags = entry.get("caption"), entry.get("tags")
    caption = caption.strip() if isinstance(caption, str) and caption.strip() else None
    tags = tags.strip() if isinstance(tags, str) and tags.strip() else None
    if caption is None:
        return tags.replace("\n", ", ") if tags and wildcard else tags
    if wildcard and tags:
        tags = tags.replace("\n", ", ")
        return "\n".join(f"{ln.strip()}, {tags}" for ln in caption.split("\n") if ln.strip())
    return caption + ", " + tags if tags else caption


def scan_metadata(path: str, image_dir: str | None, *, num_repeats: int, is_reg: bool = False,
                  option: str = "in_json", log: logging.Logger = logger,
                  stats: ScanStats | None = None, **item_fields) -> list[ImageItem]:
    """The images a metadata file lists, with their captions, in the file's order.

    Entries whose image cannot be found and entries without caption and tags are skipped, each
    kind reported in one warning line naming the file and the first keys; unreadable images are
    skipped as in folder scans. No usable entry at all is an error."""
    stats = stats if stats is not None else ScanStats()
    base = os.path.dirname(os.path.abspath(path))
    no_image, no_caption, items = [], [], []
    for key, entry in _metadata_entries(path, option):
        img = _find_image(str(key), image_dir, base)
        if img is None:
            no_image.append(str(key))
            continue
        captions = item_fields.get("captions")
        caption = metadata_caption(entry, captions is not None and captions.enable_wildcard)
        if caption is None:
            no_caption.append(str(key))
            continue
        try:
            size = check_image(img)
        except DataError as e:
            log.warning(f"skipping image: {e}")
            stats.unreadable.append(img)
            continue
        items.append(ImageItem(path=img, caption=caption, num_repeats=num_repeats, is_reg=is_reg,
                               class_tokens=None, size=size, image_dir=os.path.dirname(img),
                               **item_fields))

    def show(keys):
        n = f"{len(keys)} entr{'y' if len(keys) == 1 else 'ies'}"
        return n, ", ".join(repr(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")

    if no_image:
        where = f" in {image_dir}" if image_dir else ""
        n, keys = show(no_image)
        log.warning(f"{option} {path}: skipping {n} whose image is not found{where}: {keys}")
    if no_caption:
        n, keys = show(no_caption)
        log.warning(f"{option} {path}: skipping {n} without a caption or tags: {keys}")
    if not items:
        raise DataError(f"{option} {path}: no usable entry (an image that exists and a caption or "
                        "tags)")
    return items


# -- masked loss: mask images of the same stem in conditioning_data_dir ---------------------------
def mask_index(folder: str) -> dict[str, str]:
    """stem -> mask image path for the images in ``folder`` (sd-scripts' lookup by stem in
    conditioning_data_dir). Several files with one stem: the first by extension order (.png
    before .jpg ...), then name."""
    out: dict[str, str] = {}
    names = [n for n in os.listdir(folder) if os.path.splitext(n)[1].lower() in IMAGE_EXTENSIONS
             and os.path.isfile(os.path.join(folder, n))]
    names.sort(key=lambda n: (IMAGE_EXTENSIONS.index(os.path.splitext(n)[1].lower()), n))
    for n in names:
        out.setdefault(os.path.splitext(n)[0], os.path.join(folder, n))
    return out


def attach_masks(items: list[ImageItem], folder: str, where: str) -> None:
    """Set every item's ``mask_path`` from ``folder`` (conditioning_data_dir). A missing folder, a
    missing or undecodable mask image is an error naming the image and the folder (before any
    weight loads): training such an image unmasked would silently change what is learnt. Mask
    images without a training image are ignored."""
    if not os.path.isdir(folder):
        raise DataError(f"{where} {folder!r} does not exist or is not a directory")
    index = mask_index(folder)
    for it in items:
        stem = os.path.splitext(os.path.basename(it.path))[0]
        path = index.get(stem)
        if path is None:
            raise DataError(f"{where}: no mask image for {it.path} in {folder} (expected "
                            f"{stem}.png or another image extension)")
        try:
            mw, mh = check_image(path)
        except DataError as e:
            raise DataError(f"{where}: mask for {it.path}: {e}") from None
        iw, ih = it.size
        if abs(mw / mh - iw / ih) > 0.01 * iw / ih:
            # a scaled mask is stretched to the image (as sd-scripts); another shape would misalign
            raise DataError(f"{where}: mask {path} is {mw}x{mh} but its image {it.path} is "
                            f"{iw}x{ih}: a mask needs the image's size or aspect ratio")
        it.mask_path = path
