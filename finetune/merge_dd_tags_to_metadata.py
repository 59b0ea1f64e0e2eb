"""Merge tag files into the fine-tuning metadata JSON (sd-scripts' finetune/merge_dd_tags_to_metadata.py).

    python finetune/merge_dd_tags_to_metadata.py TRAIN_DATA_DIR OUT_JSON [--in_json IN_JSON]
        [--caption_extension .txt] [--full_path] [--recursive] [--debug]

Each image's ``<stem>.txt`` (a tagger's output) becomes its entry's "tags"; finetune.py trains on
the caption, then ", " and the tags (docs/DATASET_TOOLS.md).
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from finetune import merge_captions_to_metadata  # noqa: E402
from library.errors import run_tool  # noqa: E402


def main(argv=None) -> int:
    args = merge_captions_to_metadata.parse_args(argv, field="tags", default_extension=".txt")
    return run_tool(merge_captions_to_metadata.merge, args, "tags")


if __name__ == "__main__":
    sys.exit(main())
