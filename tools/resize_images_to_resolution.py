"""Resize a folder's images to maximum resolutions (sd-scripts' tools/resize_images_to_resolution.py).

    python tools/resize_images_to_resolution.py SRC_IMG_FOLDER DST_IMG_FOLDER
        [--max_resolution 512x512,384x384,256x256,128x128] [--divisible_by 1]
        [--interpolation area|cubic|lanczos4|nearest|linear|box] [--save_as_png]
        [--copy_associated_files]

Each image becomes ``<stem>+<WxH>.jpg`` per resolution (library/dataset_tools/resize_images.py
has the sizes; docs/DATASET_TOOLS.md).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.dataset_tools import resize_images  # noqa: E402
from library.errors import run_tool  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Resize the images of a folder to maximum resolutions "
                                            "(area, aspect kept).")
    p.add_argument("src_img_folder", help="folder of the images")
    p.add_argument("dst_img_folder", help="folder for the resized images (created)")
    p.add_argument("--max_resolution", default=resize_images.DEFAULT_RESOLUTIONS,
                   help="maximum resolutions, e.g. 512x512,384x384: one output per image and resolution")
    p.add_argument("--divisible_by", type=int, default=1,
                   help="crop each side (centred) to a multiple of this")
    p.add_argument("--interpolation", choices=list(resize_images.RESAMPLING), default=None,
                   help="resampling (default: area to shrink)")
    p.add_argument("--save_as_png", action="store_true", help="save .png instead of .jpg")
    p.add_argument("--copy_associated_files", action="store_true",
                   help="copy each image's other files (captions) as <stem>+<WxH><ext> too")
    return p


def main(argv=None) -> int:
    a = setup_parser().parse_args(argv)
    return run_tool(resize_images.resize_images, a.src_img_folder, a.dst_img_folder, a.max_resolution,
                    a.divisible_by, a.interpolation, a.save_as_png, a.copy_associated_files)


if __name__ == "__main__":
    sys.exit(main())
