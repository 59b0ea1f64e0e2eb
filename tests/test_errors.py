"""library/errors.py: the one helper for an exception's first line, used everywhere a message
quotes a library's error (torch, PIL and safetensors explain over several lines)."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# an exception's text cut to its first line by hand: str(e).splitlines()[0], str(err).strip().split("\n")[0], ...
BY_HAND = re.compile(r"str\(\w+\)(\.strip\(\))?\.(splitlines\(\)|split\([\"']\\n[\"']\))\[0\]")


def test_first_line():
    from library.errors import first_line

    e = RuntimeError("\n  Weights only load failed.\nIn PyTorch 2.6, we changed ...\n")
    assert first_line(e) == "Weights only load failed."
    assert first_line(e, typed=True) == "RuntimeError: Weights only load failed."
    assert first_line(ValueError()) == first_line(ValueError("  \n"), typed=True) == "ValueError"
    assert first_line(OSError(2, "No such file or directory")) == "[Errno 2] No such file or directory"


def _by_hand(text: str) -> list[str]:
    return [m.group(0) for m in BY_HAND.finditer(text)]


def test_no_module_cuts_a_message_by_hand():
    assert _by_hand('reason = str(e).splitlines()[0] if str(e) else "x"')  # the check finds one
    assert _by_hand("msg = str(exc).strip().split('\\n')[0]")
    found, files = [], 0
    for top in ("library", "networks"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            for n in names:
                if n.endswith(".py") and n != "errors.py":
                    files += 1
                    with open(os.path.join(dirpath, n), encoding="utf-8") as f:
                        found += [f"{n}: {x}" for x in _by_hand(f.read())]
    assert files > 50 and not found, found
