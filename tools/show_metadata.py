"""Show the metadata of a .safetensors file (a LoRA, a model), readable or as JSON.

    python tools/show_metadata.py --model lora.safetensors [--json]

Keys are sorted; ss_* values that hold JSON (ss_tag_frequency, ss_network_args, ss_dataset_dirs,
...) are decoded, so they print as indented structures (and, with --json, as JSON values instead
of strings). sd-scripts' tools/show_metadata.py prints the raw strings.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.errors import UserError  # noqa: E402


class MetadataError(UserError, ValueError):
    """The file cannot be read as safetensors; the message is one line naming it."""


def read_header(path: str) -> dict:
    """The safetensors JSON header (no tensor is read, so huge models are shown instantly)."""
    if not os.path.isfile(path):
        raise MetadataError(f"--model {path}: file not found")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise MetadataError(f"--model {path}: not a safetensors file (shorter than its header)")
        n = struct.unpack("<Q", raw)[0]
        if n > size - 8 or n > 100_000_000:
            raise MetadataError(f"--model {path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise MetadataError(f"--model {path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise MetadataError(f"--model {path}: not a safetensors file (header is not a JSON object)")
    return header


def decoded_metadata(path: str) -> dict:
    """The __metadata__ strings, JSON-valued ss_* fields decoded (objects and arrays only: a value
    such as "4" or "True" stays the string the file holds)."""
    meta = read_header(path).get("__metadata__") or {}
    out = {}
    for key in sorted(meta):
        value = meta[key]
        if key.startswith("ss_") and isinstance(value, str) and value[:1] in ("{", "["):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        out[key] = value
    return out


def format_readable(meta: dict) -> str:
    lines = []
    for key, value in meta.items():
        if isinstance(value, (dict, list)):
            body = json.dumps(value, indent=2, ensure_ascii=False).replace("\n", "\n    ")
            lines.append(f"{key}:\n    {body}")
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Show the metadata of a .safetensors file.")
    p.add_argument("--model", required=True, help="a .safetensors file (LoRA or model)")
    p.add_argument("--json", action="store_true", help="print one JSON object (JSON-valued ss_* fields decoded)")
    args = p.parse_args(argv)
    try:
        meta = decoded_metadata(args.model)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(meta, indent=2, ensure_ascii=False))
    elif not meta:
        print(f"{args.model}: no metadata")
    else:
        print(format_readable(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
