"""Store the kohya_ss GUI's presets as the test fixture tests/config/kohya_gui_presets.json.

    python tools/update_gui_presets.py --kohya_ss /path/to/kohya_ss [--commit SHA] [--out FILE]

Reads every preset the GUI ships for its training tabs (``presets/<tab>/*.json``; a user's own
presets under ``presets/<tab>/user_presets/`` are not read) from a checkout of bmaltais/kohya_ss and
writes them, unchanged, with the kohya_ss commit they come from, into one JSON file the GUI-preset
tests (tests/config/test_kohya_gui.py) read. The commit is read from the checkout's git, or given
with --commit (a folder exported with ``git archive`` has none). Rerun it when the GUI's presets
change; the diff of the fixture then shows what changed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.errors import UserError  # noqa: E402

TABS = ("lora", "dreambooth", "finetune", "textual_inversion")
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "tests", "config", "kohya_gui_presets.json")


class PresetError(UserError, ValueError):
    """The checkout or a preset cannot be read; the message is one line naming it."""


def checkout_commit(root: str) -> str:
    """The commit of a kohya_ss git checkout, or '' where `root` is not one."""
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                             text=True, check=False)
    except OSError:
        return ""
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and len(sha) == 40 else ""


def read_presets(root: str) -> dict[str, dict[str, dict]]:
    """{tab: {preset name: the preset's JSON}} for every tab folder the checkout has."""
    folder = os.path.join(root, "presets")
    if not os.path.isdir(folder):
        raise PresetError(f"--kohya_ss {root}: no presets/ folder (not a kohya_ss checkout)")
    out: dict[str, dict[str, dict]] = {}
    for tab in TABS:
        tab_dir = os.path.join(folder, tab)
        if not os.path.isdir(tab_dir):  # the GUI ships no textual-inversion presets
            continue
        out[tab] = {}
        for name in sorted(os.listdir(tab_dir)):
            path = os.path.join(tab_dir, name)
            if not name.endswith(".json") or not os.path.isfile(path):
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    out[tab][name[:-len(".json")]] = json.load(f)
            except (OSError, ValueError) as e:
                raise PresetError(f"{path}: cannot read the preset ({e})") from None
    if not any(out.values()):
        raise PresetError(f"--kohya_ss {root}: no preset under presets/{{{','.join(TABS)}}}")
    return out


def write_fixture(path: str, presets: dict, commit: str) -> int:
    """Write the fixture; returns the number of presets."""
    data = {"source": "bmaltais/kohya_ss", "commit": commit, "presets": presets}
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)
    return sum(len(v) for v in presets.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kohya_ss", required=True, help="a checkout of bmaltais/kohya_ss")
    p.add_argument("--commit", default="", help="the kohya_ss commit (default: the checkout's HEAD)")
    p.add_argument("--out", default=DEFAULT_OUT, help="the fixture to write")
    a = p.parse_args(argv)
    try:
        commit = a.commit or checkout_commit(a.kohya_ss)
        if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit.lower()):
            raise PresetError(f"--commit: a 40-digit kohya_ss commit is required "
                              f"({a.kohya_ss} is not a git checkout)" if not a.commit else
                              f"--commit {a.commit}: not a 40-digit commit")
        n = write_fixture(a.out, read_presets(a.kohya_ss), commit.lower())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a.out}: {n} presets from bmaltais/kohya_ss {commit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
