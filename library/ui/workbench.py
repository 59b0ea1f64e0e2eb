"""The Dataset page's workbench as functions over the folders inside ``--allowed_paths``; the API
(library/ui/app.py) only translates requests and errors.

    inside(path, allowed, what) -> real path     Refused (403) when outside the allowed folders
    browse(path, allowed) -> {"path", "parent", "entries"}    the folder / file picker
    folder_view(folder, ext, tag, text) -> {"images": [...], "folders": [...], "tags", ...}
    thumbnail(image, cache_dir) -> the cached JPEG's path (keyed by path, mtime, size)
    prune_thumbnails(cache_dir, keep_bytes) -> removed   least recently used first (server start)
    save_caption(image, ext, text, base_hash) -> {"hash", "journal"}   Stale (409) when the caption
                                                 changed since the client read it
    bulk_tags(folder, ext, op, tag, new, images) -> EditResult    rename / remove / add, undoable
    make_concept(parent, name, repeats), set_repeats(folder, repeats), upload(folder, name, data)
    preview_config(folder, ext, resolution) -> TOML   the run whose dry-run check gives the bucket
                                                 histogram and the captions as trained

Captions are written through library/dataset_tools/captions.py (folder lock, undo journal, atomic
replace); an edit is checked against the hash of the text the client edited inside that lock, so
two edits of one caption cannot both win and nothing is lost. Errors are UserErrors, one line each.
"""
from __future__ import annotations

import hashlib
import os

from library import files
from library.data.folders import IMAGE_EXTENSIONS, parse_concept_dir_name
from library.dataset_tools import captions, folders_prep
from library.errors import DataError, UserError, first_line

THUMB_SIZE = 256
THUMB_VERSION = 1  # part of the cache key: a change of how thumbnails are made remakes them
THUMB_CACHE_BYTES = 1 << 30  # the cache is pruned to this, least recently used first, at start
MAX_UPLOAD = 32 << 20


class Refused(UserError):
    """A path outside the allowed folders (HTTP 403)."""


class Stale(UserError):
    """The caption changed since the client read it (HTTP 409); ``current`` is its text now."""

    def __init__(self, message: str, current: str | None, current_hash: str):
        super().__init__(message)
        self.current, self.current_hash = current, current_hash


class Exists(UserError):
    """The target exists and is kept (HTTP 409)."""


class Undecodable(DataError):
    """An image that cannot be decoded (HTTP 422): the message names the file once; ``reason`` is
    the rest, for a tile that already shows the file's name."""

    def __init__(self, path: str, reason: str):
        self.reason = f"cannot decode it ({reason})"
        super().__init__(f"image {path}: {self.reason}")


def _without_path(message: str, *paths: str) -> str:
    """A library's message without the file names it quotes (PIL: "cannot identify image file
    '/a/b.png'"): the caller names the file once."""
    for p in paths:
        for form in (repr(p), f'"{p}"', p):
            message = message.replace(form, "")
    return " ".join(message.split()).rstrip(" :") or "unknown error"


def text_hash(text: str | None) -> str:
    """What a client sends back with an edit: the SHA-256 of the caption it edited ("" for none)."""
    return "" if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def roots(allowed: list[str]) -> list[str]:
    return [_real(a) for a in allowed] if allowed else [os.getcwd()]


def inside(path: str, allowed: list[str], what: str = "path") -> str:
    """The real path of ``path``; Refused when ``allowed`` is set and it lies outside all of it."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise DataError(f"{what}: a path is required")
    real = _real(path)
    if allowed and not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots(allowed)):
        raise Refused(f"{what} {path} is outside the allowed paths ({', '.join(allowed)})")
    return real


def _folder(path: str, allowed: list[str], what: str = "folder") -> str:
    real = inside(path, allowed, what)
    if not os.path.isdir(real):
        raise DataError(f"{what} {path}: no such folder")
    return real


def browse(path: str | None, allowed: list[str]) -> dict:
    """A folder's entries for the picker (folders first, hidden names left out); no path: the
    allowed folders themselves (the server's working folder when any path is allowed)."""
    if not path:
        return {"path": None, "parent": None,
                "entries": [{"name": r, "path": r, "dir": True, "size": None} for r in roots(allowed)]}
    real = _folder(path, allowed)
    try:
        names = sorted(os.listdir(real))
    except OSError as e:
        raise DataError(f"folder {path}: cannot list it ({e.strerror or e})") from None
    entries: list[dict] = []
    for n in names:
        if n.startswith("."):
            continue
        p = os.path.join(real, n)
        is_dir = os.path.isdir(p)
        entries.append({"name": n, "path": p, "dir": is_dir,
                        "size": None if is_dir else os.path.getsize(p) if os.path.isfile(p) else None})
    entries.sort(key=lambda e: (not e["dir"], e["name"].lower()))
    parent: str | None = os.path.dirname(real)
    if parent == real or (allowed and real in roots(allowed)):
        parent = None
    return {"path": real, "parent": parent, "entries": entries}


def _caption_path(image: str, ext: str) -> str:
    captions.check_extension(ext)
    return os.path.splitext(image)[0] + ext


def folder_view(folder: str, allowed: list[str], ext: str = ".caption", tag: str = "",
                text: str = "") -> dict:
    """Every image of the folder with its caption (text, hash, or the one-line error of a file
    that cannot be read), filtered by a tag and / or a text (case-insensitive, caption or file
    name); its concept subfolders with their repeats; the tag frequencies of all its captions."""
    real = _folder(folder, allowed)
    images, freq_paths = [], []
    for p in captions.find_images(real):
        if p.name.startswith("."):
            continue
        cap = _caption_path(str(p), ext)
        entry = {"name": p.name, "path": str(p), "caption": None, "hash": "", "error": None}
        if os.path.lexists(cap):
            try:
                entry["caption"] = captions.read_text(cap)
                entry["hash"] = text_hash(entry["caption"])
                freq_paths.append(cap)
            except DataError as e:
                entry["error"], entry["hash"] = str(e), None
        images.append(entry)
    shown = [e for e in images if _matches(e, tag.strip(), text.strip().lower())]
    folders = []
    for n in sorted(os.listdir(real)):
        if n.startswith(".") or not os.path.isdir(os.path.join(real, n)):
            continue
        concept = parse_concept_dir_name(n)
        folders.append({"name": n, "path": os.path.join(real, n),
                        "repeats": concept[0] if concept else None,
                        "images": folders_prep.count_images(os.path.join(real, n))})
    concept = parse_concept_dir_name(os.path.basename(real))
    return {"folder": real, "caption_extension": ext, "writable": os.access(real, os.W_OK),
            "repeats": concept[0] if concept else None, "total": len(images), "images": shown,
            "folders": folders, "tags": [[t, n] for t, n in captions.tag_frequencies(freq_paths)],
            "undo": len(captions.journals(real))}


def _matches(entry: dict, tag: str, text: str) -> bool:
    cap = entry["caption"] or ""
    if tag and tag not in {t for line in cap.split("\n") for t in captions.split_tags(line)}:
        return False
    return not text or text in cap.lower() or text in entry["name"].lower()


def _image(path: str, allowed: list[str]) -> str:
    real = inside(path, allowed, "image")
    if os.path.splitext(real)[1].lower() not in IMAGE_EXTENSIONS or not os.path.isfile(real):
        raise DataError(f"image {path}: no such image ({', '.join(IMAGE_EXTENSIONS)})")
    return real


def thumbnail(path: str, allowed: list[str], cache_dir: str, size: int = THUMB_SIZE) -> str:
    """The image's thumbnail (longest side ``size``, EXIF orientation applied, alpha on white,
    JPEG), made once and kept in ``cache_dir`` under a key of its real path, modification time
    and byte size: an edited image gets a new one. A file that cannot be decoded is an
    Undecodable naming it once."""
    real = _image(path, allowed)
    st = os.stat(real)
    key = hashlib.sha256(f"{THUMB_VERSION}\0{size}\0{real}\0{st.st_mtime_ns}\0{st.st_size}".encode()).hexdigest()
    out = os.path.join(cache_dir, key[:2], key + ".jpg")
    if os.path.isfile(out):
        try:
            os.utime(out)  # used: kept by prune_thumbnails
        except OSError:
            pass
        return out
    # lazy: PIL only when a thumbnail is made (the server starts without it)
    from PIL import Image, ImageOps

    try:
        with Image.open(real) as opened:
            opened.draft("RGB", (size, size))
            img = ImageOps.exif_transpose(opened)  # turned as the trainer turns it
            img.thumbnail((size, size))
            rgba = img.convert("RGBA")
    except Exception as e:  # PIL raises many types for a bad file
        raise Undecodable(path, _without_path(first_line(e), real, path)) from None
    flat = Image.new("RGB", rgba.size, (255, 255, 255))
    flat.paste(rgba, mask=rgba.getchannel("A"))
    with files.atomic_path(out) as tmp:
        flat.save(tmp, format="JPEG", quality=85)
    return out


def prune_thumbnails(cache_dir: str, keep_bytes: int = THUMB_CACHE_BYTES) -> int:
    """Remove the least recently used thumbnails until the cache holds at most ``keep_bytes``;
    returns how many were removed."""
    found = []
    for d, _, names in os.walk(cache_dir):
        for n in names:
            p = os.path.join(d, n)
            try:
                st = os.stat(p)
            except OSError:
                continue
            found.append((st.st_mtime_ns, st.st_size, p))
    total, removed = sum(f[1] for f in found), 0
    for _, size, p in sorted(found):
        if total <= keep_bytes:
            break
        try:
            os.remove(p)
        except OSError:
            continue
        total, removed = total - size, removed + 1
    return removed


def save_caption(path: str, allowed: list[str], ext: str, text: str, base_hash: str) -> dict:
    """Write the image's caption (atomically, with an undo journal in its folder) if its current
    text still has ``base_hash`` (the hash of what the client edited); else Stale, nothing
    written. A caption that did not exist is created (base hash "")."""
    image = _image(path, allowed)
    if not isinstance(text, str):
        raise DataError("text: a string is required")
    if not isinstance(base_hash, str):
        raise DataError('base_hash: a string is required (the hash of the text edited; "" for a new caption)')
    cap = _caption_path(image, ext)

    def edit(before: str) -> str:
        now = captions.read_text(cap) if os.path.lexists(cap) else None
        if text_hash(now) != base_hash:
            raise Stale(f"caption {cap} was changed since you opened it; your text is not saved "
                        "(reload it and edit again)", now, text_hash(now))
        return text

    result = captions.edit_captions(os.path.dirname(image), [cap], edit, "edit")
    return {"caption_path": cap, "hash": text_hash(text), "changed": bool(result.changed),
            "journal": result.journal}


def undo(folder: str, allowed: list[str]) -> captions.EditResult:
    return captions.undo(_folder(folder, allowed))


BULK = {
    "rename": lambda tag, new: lambda text: captions.rename_tag(text, tag, new),
    "remove": lambda tag, new: lambda text: captions.remove_tag(text, tag),
    "add": lambda tag, new: lambda text: captions.add_trigger(text, tag),
}


def bulk_tags(folder: str, allowed: list[str], ext: str, op: str, tag: str, new: str = "",
              images: list[str] | None = None) -> captions.EditResult:
    """``op`` (rename ``tag`` to ``new``, remove ``tag``, add ``tag`` first) over the captions of
    the folder's images, or of ``images`` (names in the folder: a filtered view); one undo."""
    real = _folder(folder, allowed)
    if op not in BULK:
        raise DataError(f"op {op!r}: one of {', '.join(BULK)}")
    if not isinstance(tag, str) or not isinstance(new, str):
        raise DataError("tag, new: strings are required")
    edit = BULK[op](tag, new)
    if images is None:
        paths = captions.caption_files(real, ext)
    else:
        if not isinstance(images, list) or not all(isinstance(n, str) for n in images):
            raise DataError("images: a list of file names is required")
        known = {p.name: p for p in captions.find_images(real)}
        unknown = [n for n in images if n not in known]
        if unknown:
            raise DataError(f"images: {unknown[0]} is not an image of {folder}")
        paths = [_caption_path(str(known[n]), ext) for n in images]
        if op != "add":
            paths = [p for p in paths if os.path.lexists(p)]
    edit("")  # a bad tag is refused before the folder is locked
    return captions.edit_captions(real, paths, edit, f"tags-{op}")


def _concept_name(name: str) -> str:
    name = name.strip() if isinstance(name, str) else ""
    if not name or "/" in name or os.sep in name or "\0" in name or name.startswith("."):
        raise DataError(f"name {name!r}: a folder name (not empty, no '/', not hidden) is required")
    return name


def _repeats(repeats) -> int:
    if not isinstance(repeats, int) or isinstance(repeats, bool) or not 1 <= repeats <= 100000:
        raise DataError(f"repeats {repeats!r}: an integer from 1 is required")
    return repeats


def make_concept(parent: str, allowed: list[str], name: str, repeats: int) -> str:
    """``<parent>/<repeats>_<name>``, the trainer's concept folder (an existing one is refused)."""
    real = _folder(parent, allowed, "parent")
    path = os.path.join(real, f"{_repeats(repeats)}_{_concept_name(name)}")
    try:
        os.mkdir(path)
    except FileExistsError:
        raise Exists(f"{path} exists") from None
    except OSError as e:
        raise DataError(f"{path}: cannot create it ({e.strerror or e})") from None
    return path


def set_repeats(folder: str, allowed: list[str], repeats: int) -> str:
    """Rename ``<N>_<concept>`` to ``<repeats>_<concept>`` (folders_prep's rename, which puts the
    name back on a failure); returns the new path."""
    real = _folder(folder, allowed)
    parent, name = os.path.split(real)
    m = folders_prep.KOHYA_NAME.match(name)
    if not m:
        raise DataError(f"folder {folder}: not a <repeats>_<concept> folder")
    weight = folders_prep.WEIGHT.match(name)
    rest = name[weight.end():] if weight else name
    new = f"{weight.group(0) if weight else ''}{_repeats(repeats)}_{rest.split('_', 1)[1]}"
    if new != name and os.path.lexists(os.path.join(parent, new)):
        raise Exists(f"{os.path.join(parent, new)} exists; {name} keeps its name")
    folders_prep.apply_balance(parent, [folders_prep.Rename(name, new, folders_prep.count_images(real), repeats)])
    return os.path.join(parent, new)


def upload(folder: str, allowed: list[str], name: str, data: bytes, max_bytes: int = MAX_UPLOAD) -> str:
    """An image written into the folder (atomically; never over an existing file): an image
    extension, at most ``max_bytes``, and a file that decodes as an image."""
    real = _folder(folder, allowed)
    base = os.path.basename(name or "")
    if not base or base != name or base.startswith("."):
        raise DataError(f"name {name!r}: a plain file name is required")
    if os.path.splitext(base)[1].lower() not in IMAGE_EXTENSIONS:
        raise DataError(f"{base}: not an image type the trainer reads ({', '.join(IMAGE_EXTENSIONS)})")
    if len(data) > max_bytes:
        raise DataError(f"{base}: {len(data)} bytes, over the upload limit of {max_bytes}")
    # lazy: PIL only when an upload is checked (the server starts without it)
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
    except Exception as e:  # PIL raises many types for a bad file
        raise DataError(f"{base}: not a readable image ({first_line(e)})") from None
    target = os.path.join(real, base)
    if os.path.lexists(target):
        raise Exists(f"{target} exists; it is kept (rename the upload)")
    with files.atomic_path(target) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return target


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def preview_config(folder: str, allowed: list[str], ext: str, resolution: int, out_dir: str) -> str:
    """The run TOML (built-in tiny model, no weight is loaded by a check) whose dataset is this
    folder: its concept subfolders when it has some (a train_data_dir), else the folder itself
    as one subset with the repeats and class tokens of its ``N_concept`` name, buckets on at
    ``resolution``."""
    real = _folder(folder, allowed)
    captions.check_extension(ext)
    if not isinstance(resolution, int) or isinstance(resolution, bool) or not 64 <= resolution <= 4096:
        raise DataError(f"resolution {resolution!r}: an integer from 64 to 4096 is required")
    head = [f'pretrained_model_name_or_path = "tiny-sd15"', f"output_dir = {_toml_str(out_dir)}",
            "max_train_epochs = 1", ""]
    has_concepts = any(parse_concept_dir_name(n) and os.path.isdir(os.path.join(real, n))
                       for n in os.listdir(real) if not n.startswith("."))
    subset = ["[[datasets.subsets]]", f"caption_extension = {_toml_str(ext)}"]
    if has_concepts:
        return "\n".join(head + [f"train_data_dir = {_toml_str(real)}", f"resolution = {resolution}",
                                 "enable_bucket = true", f"caption_extension = {_toml_str(ext)}"]) + "\n"
    concept = parse_concept_dir_name(os.path.basename(real))
    subset += [f"image_dir = {_toml_str(real)}", f"num_repeats = {concept[0] if concept and concept[0] > 0 else 1}"]
    if concept and concept[1]:  # as the trainer reads the folder inside a train_data_dir
        subset.append(f"class_tokens = {_toml_str(concept[1])}")
    return "\n".join(head + ["[[datasets]]", f"resolution = {resolution}", "enable_bucket = true", ""]
                     + subset) + "\n"
