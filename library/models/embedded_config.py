"""Architecture records carried in a weights file's metadata: files this toolkit writes for
non-standard (tiny) architectures hold their config and tokenizer files as JSON, so the loader
rebuilds them offline. Third-party files have none and load with the real architecture."""
from __future__ import annotations

import json
import os
import tempfile

from library.errors import ModelError


def read_record(meta: dict, key: str, path: str) -> dict | None:
    """The JSON object under ``key`` in the file's metadata, or None when there is none."""
    if key not in meta:
        return None
    try:
        record = json.loads(meta[key])
    except json.JSONDecodeError:
        record = None
    if not isinstance(record, dict):
        raise ModelError(f"{path}: metadata {key} is not a valid JSON object")
    return record


def tokenizer_files(tokenizer) -> dict[str, str]:
    """The files save_pretrained writes for ``tokenizer``, by name."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files = {}
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), encoding="utf-8") as f:
                files[name] = f.read()
    return files


def tokenizer_from_files(cls, files: dict[str, str]):
    """A tokenizer of class ``cls`` from the files tokenizer_files returned."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in files.items():
            with open(os.path.join(tmp, os.path.basename(name)), "w", encoding="utf-8") as f:
                f.write(text)
        return cls.from_pretrained(tmp, local_files_only=True)
