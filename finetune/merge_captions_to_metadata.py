"""Merge caption files into the fine-tuning metadata JSON (sd-scripts' finetune/merge_captions_to_metadata.py).

    python finetune/merge_captions_to_metadata.py TRAIN_DATA_DIR OUT_JSON [--in_json IN_JSON]
        [--caption_extension .caption] [--full_path] [--recursive] [--debug]

Each image's ``<stem>.caption`` becomes its entry's "caption" in OUT_JSON, which finetune.py reads
as ``--in_json`` (library/dataset_tools/metadata_json.py; docs/DATASET_TOOLS.md).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.dataset_tools import metadata_json  # noqa: E402
from library.errors import run_tool  # noqa: E402


def parse_args(argv=None, *, field: str = "caption", default_extension: str = ".caption"):
    """The flags of sd-scripts' two merge scripts (they differ in the field and the default
    extension; the caption script also takes the old misspelling --caption_extention)."""
    p = argparse.ArgumentParser(description=f"Merge {field} files into a fine-tuning metadata JSON.")
    p.add_argument("train_data_dir", help="folder of the training images")
    p.add_argument("out_json", help="the metadata JSON to write")
    p.add_argument("--in_json", help="metadata JSON to start from (default: out_json when it exists)")
    if field == "caption":
        p.add_argument("--caption_extention", default=None,
                       help="old spelling of --caption_extension, kept for old command lines")
    p.add_argument("--caption_extension", default=default_extension,
                   help=f"extension of the {field} files (default {default_extension})")
    p.add_argument("--full_path", action="store_true",
                   help="key entries by the image's path instead of its stem (several folders)")
    p.add_argument("--recursive", action="store_true",
                   help="also the images of subfolders (requires --full_path)")
    p.add_argument("--debug", action="store_true", help="print every key and its text")
    args = p.parse_args(argv)
    if getattr(args, "caption_extention", None) is not None:
        args.caption_extension = args.caption_extention
    return args


def merge(args, field: str) -> None:
    metadata_json.merge_texts(args.train_data_dir, args.out_json, field=field,
                              caption_extension=args.caption_extension, in_json=args.in_json,
                              full_path=args.full_path, recursive=args.recursive, debug=args.debug)


def main(argv=None) -> int:
    return run_tool(merge, parse_args(argv), "caption")


if __name__ == "__main__":
    sys.exit(main())
