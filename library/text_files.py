"""Reading the text files a user writes (captions, metadata JSON, sample prompts, TOML configs):
UTF-8 only, and any fault is one line naming the file (and, for bytes that are not UTF-8, the line
and column), raised as the caller's UserError class. Guessing another encoding would train on
mojibake; sd-scripts raises a UnicodeDecodeError traceback."""
from __future__ import annotations

import os

from library import symlinks


def decode(raw: bytes, path: str, error, what: str = "") -> str:
    """``raw`` as UTF-8 (a byte-order mark dropped), else ``error("<what> <path>: line N: not
    UTF-8 text (byte 0x.. at column C); save the file as UTF-8")``."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise error(f"{_name(what, path)}: line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} "
                    f"at column {column}); save the file as UTF-8") from None


def read(path: str, error, what: str = "") -> str:
    """The UTF-8 text of ``path``; a missing, unreadable or not-a-file path, or bytes that are
    not UTF-8, are ``error`` with one line naming it."""
    if os.path.isdir(path):
        raise error(f"{_name(what, path)} is a folder, not a file")
    if os.path.islink(path) and not os.path.exists(path):
        raise error(f"{_name(what, path)} is {symlinks.problem(path)}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise error(f"{_name(what, path)}: no such file") from None
    except OSError as e:
        raise error(f"{_name(what, path)}: cannot read it ({e.strerror or e})") from None
    return decode(raw, path, error, what)


def _name(what: str, path: str) -> str:
    return f"{what} {path}" if what else path
