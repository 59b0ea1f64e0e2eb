"""Check a dataset folder: unreadable or truncated images, caption files that are not UTF-8,
images with the same content; one line each.

    python tools/check_dataset.py FOLDER [--caption_extension .caption]

Exit status 0: no problem; 1: problems found (each printed); 2: the folder is missing
(library/dataset_tools/dataset_check.py; docs/DATASET_TOOLS.md).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.dataset_tools import dataset_check  # noqa: E402
from library.errors import run_tool  # noqa: E402


def run(a) -> int:
    problems = dataset_check.check_dataset(a.folder, a.caption_extension)
    for p in problems:
        print(f"{p.kind}: {p.message}")
    print(f"{len(problems)} problem(s) in {a.folder}", file=sys.stderr)
    return 1 if problems else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Check a dataset: unreadable images, captions that are "
                                            "not UTF-8, duplicate images.")
    p.add_argument("folder", help="the dataset folder (every subfolder is checked)")
    p.add_argument("--caption_extension", default=".caption", help="extension of the caption files")
    return run_tool(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
