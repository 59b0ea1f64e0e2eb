"""The fine-tuning metadata JSON that finetune.py reads (library/data/folders.py
``scan_metadata``), as sd-scripts' finetune/ scripts write it: ``merge_texts`` (caption or tag
files into ``{key: {"caption": ..., "tags": ...}}``: merge_captions_to_metadata.py,
merge_dd_tags_to_metadata.py) and ``clean_metadata`` (clean_captions_and_tags.py).

The document is written as sd-scripts writes it (``json.dumps(..., indent=2)``), atomically. Where
sd-scripts stops with a traceback (a missing caption file, a caption that is not UTF-8, a missing
in_json) this says so in one line: a missing caption file is skipped with a warning, the others
are errors naming the file."""
from __future__ import annotations

import json
import logging
import os
import re

from library import files, text_files
from library.dataset_tools.captions import check_extension, find_images
from library.errors import DataError

logger = logging.getLogger("sdtk")


def read_metadata(path: str, what: str = "in_json") -> dict:
    """A metadata JSON object, or a one-line DataError naming ``path``."""
    text = text_files.read(path, DataError, what)
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise DataError(f"{what} {path} is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise DataError(f"{what} {path}: expected an object {{image: {{\"caption\": ..., \"tags\": ...}}}}")
    return doc


def write_metadata(path: str, doc: dict) -> None:
    """``doc`` as sd-scripts writes it (two-space indent, ASCII escapes), replacing ``path`` in one
    rename."""
    with files.atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(doc, indent=2))


def merge_texts(train_data_dir: str, out_json: str, *, field: str, caption_extension: str,
                in_json: str | None = None, full_path: bool = False, recursive: bool = False,
                debug: bool = False, log: logging.Logger = logger) -> dict:
    """Each image's ``<stem><caption_extension>`` text (stripped) as its entry's ``field``
    ("caption" or "tags"); the key is the image's stem, or its path with ``full_path``. Entries
    of ``in_json`` (default: out_json when it exists) are kept, their ``field`` replaced."""
    if recursive and not full_path:
        raise DataError("--recursive requires --full_path (stems of several folders would collide)")
    check_extension(caption_extension)
    images = find_images(train_data_dir, recursive)
    log.info(f"found {len(images)} images in {train_data_dir}")
    if in_json is None and os.path.isfile(out_json):
        in_json = out_json
    doc = read_metadata(in_json) if in_json is not None else {}
    if in_json is not None:
        log.info(f"loaded existing metadata {in_json}: the {field} of its images is replaced")
    missing = []
    for image in images:
        text_path = str(image.with_suffix(caption_extension))
        if not os.path.isfile(text_path):
            missing.append(text_path)
            continue
        text = text_files.read(text_path, DataError, "caption file").strip()
        key = str(image) if full_path else image.stem
        entry = doc.setdefault(key, {})
        if not isinstance(entry, dict):
            raise DataError(f"in_json {in_json}: the entry {key!r} is not an object")
        entry[field] = text
        if debug:
            log.info(f"{key}: {text}")
    if missing:
        log.warning(f"skipped {len(missing)} image(s) without a {caption_extension} file: "
                    + ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else ""))
    write_metadata(out_json, doc)
    log.info(f"wrote {out_json} ({len(doc)} entries)")
    return doc


# -- clean_captions_and_tags: sd-scripts' rules for WD14 / DeepDanbooru tags and BLIP captions --
# Tags are matched as ", tag, " in a string where every tag carries its own separators.
HAIR_LENGTH = re.compile(r", (long|short|medium) hair, ")
HAIR = re.compile(r", ([\w\-]+) hair, ")
WORD = re.compile(r", ([\w\-]+|hair ornament), ")
# With several people (a tag containing "girls" or "boys"), a kind of tag present more than once
# describes different people: all of that kind are dropped.
PER_PERSON = (
    HAIR_LENGTH,
    re.compile(r", (bob|hime) cut, "),
    re.compile(r", [\w\-]+ eyes, "),
    re.compile(r", ([\w\-]+ sleeves|sleeveless), "),
    re.compile(r", (ponytail|braid|ahoge|twintails|[\w\-]+ bun|single hair bun|single side bun"
               r"|two side up|two tails|[\w\-]+ braid|sidelocks), "),
)
HOLD = ", @@@, "

# (from, to), applied in this order, each until the caption no longer changes
CAPTION_REPLACEMENTS = tuple(pair.split(" -> ") for pair in (
    "anime anime -> anime", "young  -> ", "anime girl -> girl", "cartoon female -> girl",
    "cartoon lady -> girl", "cartoon character -> girl", "cartoon woman -> girl",
    "cartoon women -> girls", "cartoon girl -> girl", "anime female -> girl", "anime lady -> girl",
    "anime character -> girl", "anime woman -> girl", "anime women -> girls", "lady -> girl",
    "female -> girl", "woman -> girl", "women -> girls", "people -> girls", "person -> girl",
    "a cartoon figure -> a figure", "a cartoon image -> an image", "a cartoon picture -> a picture",
    "an anime cartoon image -> an image", "a cartoon anime drawing -> a drawing",
    "a cartoon drawing -> a drawing", "girl girl -> girl"))


def clean_tags(tags: str, key: str = "", log: logging.Logger = logger) -> str:
    """sd-scripts' tag cleaning: underscores to spaces (``^_^`` kept), DeepDanbooru's rating and
    what follows it dropped, per-person tags of several people dropped, a tag dropped when a
    longer tag ends with it (``shirt`` beside ``white shirt``)."""
    tags = tags.replace("^_^", "\0").replace("_", " ").replace("\0", "^_^")
    before_rating, *ratings = tags.split(", rating")
    if len(ratings) > 1:
        log.warning(f"{key}: several ratings in {tags!r}")
    s = ", " + before_rating.replace(", ", ", , ") + ", "
    if "girls" in s or "boys" in s:
        for pattern in PER_PERSON:
            if len(pattern.findall(s)) > 1:
                s = pattern.sub("", s)
        # one hair length (everyone's) is kept aside while several hair colours are dropped
        length = HAIR_LENGTH.search(s)
        if length:
            s = HAIR_LENGTH.sub(HOLD, s)
        if len(HAIR.findall(s)) > 1:
            s = HAIR.sub("", s)
        if length:
            s = s.replace(HOLD, length.group())
    for word in WORD.findall(s):
        if re.search(rf", ((\w+) )+{word}, ", s):
            s = s.replace(f", {word}, ", "")
    s = s.replace(", , ", ", ")
    return s[2:-2]


def clean_caption(caption: str) -> str:
    for old, new in CAPTION_REPLACEMENTS:
        while old in caption:
            caption = caption.replace(old, new)
    return caption


def clean_metadata(in_json: str, out_json: str, *, debug: bool = False,
                   log: logging.Logger = logger) -> dict:
    """Every entry's tags and caption cleaned (clean_tags, clean_caption); written to out_json."""
    if not os.path.isfile(in_json):
        raise DataError(f"in_json {in_json}: no such file")
    doc = read_metadata(in_json)
    for key, entry in doc.items():
        if not isinstance(entry, dict):
            raise DataError(f"in_json {in_json}: the entry {key!r} is not an object")
        for field, clean in (("tags", lambda t: clean_tags(t, key, log)), ("caption", clean_caption)):
            value = entry.get(field)
            if value is None:
                log.info(f"{key}: no {field}")
                continue
            if not isinstance(value, str):
                raise DataError(f"in_json {in_json}: {key!r} {field} is not a string")
            entry[field] = clean(value)
            if debug and entry[field] != value:
                log.info(f"{key}: {value!r} -> {entry[field]!r}")
    write_metadata(out_json, doc)
    log.info(f"wrote {out_json} ({len(doc)} entries)")
    return doc
