"""sd-scripts' tools/resize_images_to_resolution.py as a function: each image of a folder saved
once per maximum resolution, scaled down (aspect kept) to at most that many pixels, then
center-cropped to sizes divisible by ``divisible_by``, as ``<stem>+<WxH>.jpg`` (or .png).

For an image of w x h pixels and a maximum of W x H: when w x h > W x H, the size becomes
(int(w s), int(h s)) with s = sqrt(W H / (w h)), else it stays; then each side loses its remainder
modulo ``divisible_by``, the crop centred (offset int(excess / 2)). Files that are not images are
copied as they are; with ``copy_associated_files`` an image's other files (``<stem>.*``: captions)
are also copied as ``<stem>+<WxH><ext>``.

Stronger than sd-scripts: each resolution is computed from the original image (sd-scripts resizes
the previous resolution's result, so "128x128,512x512" saves a 128-pixel image as +512x512), the
extension is matched in any letter case, subfolders are skipped (sd-scripts stops on them), an
unreadable image is named in one line and skipped, and every file is written atomically. PIL does
the resampling (sd-scripts uses OpenCV for area, cubic, nearest and linear), so pixel values
differ slightly from sd-scripts'; sizes and names are the same."""
from __future__ import annotations

import glob
import logging
import math
import os
import shutil
from dataclasses import dataclass

from PIL import Image
from tqdm import tqdm

from library import files
from library.data.folders import IMAGE_EXTENSIONS
from library.errors import DataError, first_line

logger = logging.getLogger("sdtk")

RESAMPLING = {"area": Image.Resampling.BOX, "box": Image.Resampling.BOX,
              "cubic": Image.Resampling.BICUBIC, "lanczos4": Image.Resampling.LANCZOS,
              "nearest": Image.Resampling.NEAREST, "linear": Image.Resampling.BILINEAR}
DEFAULT_RESOLUTIONS = "512x512,384x384,256x256,128x128"


@dataclass(frozen=True)
class Resolution:
    text: str  # as given: the file name's suffix
    pixels: int


def parse_resolutions(spec: str) -> list[Resolution]:
    out = []
    for part in (p.strip() for p in spec.split(",")):
        w, x, h = part.partition("x")
        if not (x and w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0):
            raise DataError(f"--max_resolution {spec!r}: {part!r} is not WxH (e.g. 512x512,384x384)")
        out.append(Resolution(part, int(w) * int(h)))
    return out


def target_size(w: int, h: int, max_pixels: int, divisible_by: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((scaled w, h), (cropped w, h)) for an image of w x h (see the module doc)."""
    if w * h > max_pixels:
        s = math.sqrt(max_pixels / (w * h))
        w, h = int(w * s), int(h * s)
    return (w, h), (w - w % divisible_by, h - h % divisible_by)


def _save_image(img: Image.Image, path: str, png: bool) -> None:
    with files.atomic_path(path) as tmp:
        img.save(tmp, format="PNG" if png else "JPEG", quality=100)


def _copy(src: str, dst: str) -> None:
    with files.atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def resize_images(src: str, dst: str, max_resolution: str = DEFAULT_RESOLUTIONS, divisible_by: int = 1,
                  interpolation: str | None = None, save_as_png: bool = False,
                  copy_associated_files: bool = False, log: logging.Logger = logger) -> list[str]:
    """Write the folder's resized images (and copies) into ``dst``; return the written paths."""
    resolutions = parse_resolutions(max_resolution)
    if divisible_by < 1:
        raise DataError(f"--divisible_by {divisible_by}: must be at least 1")
    if interpolation is not None and interpolation not in RESAMPLING:
        raise DataError(f"--interpolation {interpolation!r}: one of {', '.join(RESAMPLING)}")
    if not os.path.isdir(src):
        raise DataError(f"src_img_folder {src}: no such folder")
    if os.path.realpath(src) == os.path.realpath(dst):
        raise DataError(f"dst_img_folder {dst} is src_img_folder: give another folder")
    try:
        os.makedirs(dst, exist_ok=True)
    except OSError as e:
        raise DataError(f"dst_img_folder {dst}: cannot create it ({e.strerror or e})") from None
    written = []
    # a progress bar on stderr (the web UI's tool jobs read it from the log)
    for name in tqdm(sorted(os.listdir(src)), desc="resize", unit="file"):
        path = os.path.join(src, name)
        if not os.path.isfile(path):
            continue
        stem, ext = os.path.splitext(name)
        if ext.lower() not in IMAGE_EXTENSIONS:
            _copy(path, os.path.join(dst, name))
            written.append(os.path.join(dst, name))
            continue
        try:
            with Image.open(path) as opened:
                image = opened.convert("RGB") if opened.mode != "RGB" else opened.copy()
        except Exception as e:  # PIL raises many types for a bad file
            log.warning(f"skipping image {path}: cannot decode it ({first_line(e)})")
            continue
        for res in resolutions:
            (sw, sh), (cw, ch) = target_size(image.width, image.height, res.pixels, divisible_by)
            out = image
            if (sw, sh) != image.size:
                method = interpolation or ("area" if sw <= image.width and sh <= image.height else "lanczos4")
                out = image.resize((sw, sh), RESAMPLING[method])
            left, top = int((sw - cw) / 2), int((sh - ch) / 2)
            out = out.crop((left, top, left + cw, top + ch))
            target = os.path.join(dst, f"{stem}+{res.text}{'.png' if save_as_png else '.jpg'}")
            _save_image(out, target, save_as_png)
            written.append(target)
            log.info(f"{'resized' if (sw, sh) != image.size else 'saved'} {name} ({image.width}x{image.height}) "
                     f"as {os.path.basename(target)} ({cw}x{ch})")
        if copy_associated_files:
            for other in sorted(glob.glob(os.path.join(glob.escape(src), glob.escape(stem) + ".*"))):
                other_ext = os.path.splitext(other)[1]
                if other_ext.lower() in IMAGE_EXTENSIONS or not os.path.isfile(other):
                    continue
                for res in resolutions:
                    target = os.path.join(dst, f"{stem}+{res.text}{other_ext}")
                    _copy(other, target)
                    written.append(target)
    return written
