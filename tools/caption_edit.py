"""Bulk caption edits with undo, and the tags by frequency.

    python tools/caption_edit.py trigger FOLDER WORD        # WORD as every caption's first tag
    python tools/caption_edit.py replace FOLDER --find OLD --replace NEW [--regex]
    python tools/caption_edit.py remove FOLDER TAG          # the tag dropped from every caption
    python tools/caption_edit.py dedupe FOLDER              # repeated tags dropped
    python tools/caption_edit.py tags FOLDER [--top N]      # tags by the number of captions
    python tools/caption_edit.py undo FOLDER                # the newest edit undone
    common: [--caption_extension .caption] [--recursive]

Each edit is atomic per file and all-or-nothing over the folder, with an undo journal in
FOLDER/.sdtk-caption-undo/ (library/dataset_tools/captions.py; docs/DATASET_TOOLS.md).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.dataset_tools import captions  # noqa: E402
from library.errors import run_tool  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Bulk caption edits with undo, and tag frequencies.")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name, help):
        c = sub.add_parser(name, help=help)
        c.add_argument("folder", help="the folder of images and their caption files")
        c.add_argument("--caption_extension", default=".caption",
                       help="extension of the caption files (default .caption, as the trainer)")
        c.add_argument("--recursive", action="store_true", help="also the images of subfolders")
        return c

    command("trigger", "put a trigger word first in every caption").add_argument("word")
    r = command("replace", "find and replace text in every caption")
    r.add_argument("--find", required=True, help="the text (or, with --regex, the pattern) to find")
    r.add_argument("--replace", default="", help="what replaces it (default: nothing)")
    r.add_argument("--regex", action="store_true", help="--find is a Python regular expression")
    command("remove", "remove a tag from every caption").add_argument("tag")
    command("dedupe", "drop repeated tags in each caption")
    command("tags", "list the tags by the number of captions holding them").add_argument(
        "--top", type=int, default=0, help="only the N most frequent (default: all)")
    command("undo", "undo the newest edit of the folder")
    return p.parse_args(argv)


EDITS = {
    "trigger": lambda a: lambda text: captions.add_trigger(text, a.word),
    "replace": lambda a: captions.replacer(a.find, a.replace, a.regex),
    "remove": lambda a: lambda text: captions.remove_tag(text, a.tag),
    "dedupe": lambda a: captions.dedupe,
}


def run(args) -> None:
    if args.command == "undo":
        result = captions.undo(args.folder)
        print(f"undid {os.path.basename(result.journal)}: {len(result.changed)} caption(s) restored")
        for path in result.kept:
            print(f"kept {path}: changed since that edit, so it is left as it is")
        return
    paths = captions.caption_files(args.folder, args.caption_extension, args.recursive)
    if args.command == "tags":
        freq = captions.tag_frequencies(paths)
        for tag, n in freq[:args.top] if args.top > 0 else freq:
            print(f"{n}\t{tag}")
        return
    result = captions.edit_captions(args.folder, paths, EDITS[args.command](args), args.command)
    print(f"{args.command}: {len(result.changed)} caption(s) changed, {result.unchanged} unchanged"
          + (f" (undo: python tools/caption_edit.py undo {args.folder})" if result.changed else ""))


def main(argv=None) -> int:
    return run_tool(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
