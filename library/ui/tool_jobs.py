"""Dataset tools as jobs in the training queue: a tool script by its path in the checkout and its
sd-scripts-style argument list, checked against an allow-list and ``--allowed_paths``.

    tools() -> ["finetune/...py", "tools/...py", "gen_img.py"]   the allow-list: every script of
                                  finetune/ (the tagger and captioners plug in by name when they
                                  land), the dataset tools of tools/, compare_checkpoints.py and
                                  gen_img.py, those that exist in this checkout
    is_tool(script) -> bool       a job's ``script`` names a tool (an entry script has no ".py")
    check(script, args, allowed, extra=None) -> config   the stored job config (JSON: args, the
                                  working folder, and ``extra``: the run a grid compares), or a
                                  UserError / Refused naming the argument
    of_run(config) -> int | None  the run a job's config names
    command(python, script, config) -> (argv, cwd)
    log_progress(log_path) -> {"step", "total_steps"}   the last tqdm bar ("12/40") in the log

Paths in the arguments: with ``--allowed_paths``, the job runs in the first allowed folder, so a
relative name that does not exist (an output folder to create) lands inside it; every argument
(and the value of ``--flag=value`` or ``-Xvalue``) that is absolute, starts with "~", has a ".."
part or names an existing file or folder must lie inside the allowed folders. Words that are not
paths (a trigger word, a tag, a hub id) pass unchanged.
"""
from __future__ import annotations

import glob
import json
import os
import re

from library.errors import DataError
from library.ui.workbench import inside

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATASET_TOOLS = ("tools/caption_edit.py", "tools/check_dataset.py", "tools/dataset_folders.py",
                 "tools/resize_images_to_resolution.py")
# a run's saved files as a checkpoint grid; images from a model (the UI's Generate page)
OUTPUT_TOOLS = ("tools/compare_checkpoints.py", "gen_img.py")
MAX_ARGS = 200
# tqdm's bar: "... 12/40 [00:03<00:09, ...]" (the last one in the log is the current state)
_TQDM = re.compile(r"(\d+)/(\d+) \[")


def tools() -> list[str]:
    found = [os.path.relpath(p, ROOT) for p in sorted(glob.glob(os.path.join(ROOT, "finetune", "*.py")))]
    found = [p for p in found if not os.path.basename(p).startswith("_")]
    return found + [t for t in DATASET_TOOLS + OUTPUT_TOOLS if os.path.isfile(os.path.join(ROOT, t))]


def is_tool(script: str) -> bool:
    return script.endswith(".py")


def _path_like(arg: str, cwd: str) -> bool:
    return (os.path.isabs(arg) or arg.startswith("~") or ".." in arg.split("/")
            or os.path.lexists(os.path.join(cwd, arg)))


def _values(arg: str) -> list[str]:
    """What in one argument may be a path: the argument, ``--flag=value``'s value, ``-Xvalue``'s
    value."""
    if arg.startswith("--"):
        return [arg.split("=", 1)[1]] if "=" in arg else []
    if arg.startswith("-") and len(arg) > 2:
        return [arg[2:].lstrip("=")]
    return [arg]


def check(script: str, args, allowed: list[str], extra: dict | None = None) -> str:
    if script not in tools():
        raise DataError(f"tool {script!r}: not a dataset tool of this checkout (one of: {', '.join(tools())})")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args) or len(args) > MAX_ARGS:
        raise DataError(f"args: a list of at most {MAX_ARGS} strings is required")
    if any("\0" in a for a in args):
        raise DataError("args: a NUL character")
    cwd = os.path.realpath(allowed[0]) if allowed else os.getcwd()
    if allowed:
        for a in args:
            for value in _values(a):
                if value and _path_like(value, cwd):
                    inside(os.path.join(cwd, os.path.expanduser(value)), allowed, "argument")
    return json.dumps({"args": args, "cwd": cwd, **(extra or {})})


def of_run(config: str) -> int | None:
    try:
        return json.loads(config).get("run")
    except (ValueError, AttributeError):
        return None


def command(python: str, script: str, config: str) -> tuple[list[str], str]:
    c = json.loads(config)
    return [python, os.path.join(ROOT, script), *c["args"]], c["cwd"]


def log_progress(log_path: str) -> dict:
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - 4096))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return {"step": 0, "total_steps": None}
    bars = _TQDM.findall(tail)
    if not bars:
        return {"step": 0, "total_steps": None}
    done, total = bars[-1]
    return {"step": int(done), "total_steps": int(total)}
