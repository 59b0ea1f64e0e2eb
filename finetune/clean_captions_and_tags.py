"""Clean the captions and tags of a fine-tuning metadata JSON (sd-scripts' finetune/clean_captions_and_tags.py).

    python finetune/clean_captions_and_tags.py IN_JSON OUT_JSON [--debug]

Tags: underscores to spaces, DeepDanbooru's rating dropped, per-person tags (hair, eyes, sleeves)
of several people dropped, ``shirt`` dropped beside ``white shirt``. Captions: BLIP's "anime
woman", "cartoon character", ... become "girl" (library/dataset_tools/metadata_json.py). The old
three-argument form (TRAIN_DATA_DIR IN_JSON OUT_JSON) still works, with a warning.
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Clean the captions and tags of a metadata JSON.")
    p.add_argument("in_json", help="the metadata JSON to read")
    p.add_argument("out_json", help="the metadata JSON to write (may be in_json)")
    p.add_argument("legacy_out_json", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--debug", action="store_true", help="print every changed caption and tags")
    args = p.parse_args(argv)
    if args.legacy_out_json is not None:  # sd-scripts' old form: train_data_dir in_json out_json
        print("warning: the train_data_dir argument is no longer used; give IN_JSON OUT_JSON "
              "(every caption and tag of the metadata is cleaned)", file=sys.stderr)
        args.in_json, args.out_json = args.out_json, args.legacy_out_json
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_tool(metadata_json.clean_metadata, args.in_json, args.out_json, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
