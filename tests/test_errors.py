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


def test_run_tool_exit_codes(capsys):
    """The one tool main: 0 when the work returns, its int result (check_dataset's 1), 2 and one
    line for a UserError; any other exception is a bug and keeps its traceback."""
    import pytest

    from library.errors import UserError, run_tool, tool_main

    assert run_tool(lambda: None) == 0
    assert run_tool(lambda: 1) == 1
    assert run_tool(lambda x, y=0: x + y, 1, y=2) == 3
    assert run_tool(lambda: True) == 0  # a bool says nothing about the exit status
    assert run_tool(lambda: "done") == 0

    def bad(*_):
        raise UserError("--in_json x.json: no such file")

    assert run_tool(bad) == 2
    assert capsys.readouterr().err == "error: --in_json x.json: no such file\n"
    seen = []
    assert tool_main(lambda argv: argv, seen.append, ["a"]) == 0 and seen == [["a"]]
    assert tool_main(lambda argv: argv, bad, ["a"]) == 2
    assert capsys.readouterr().err == "error: --in_json x.json: no such file\n"
    with pytest.raises(ZeroDivisionError):
        run_tool(lambda: 1 / 0)


def _tool_main(path):
    import importlib

    return importlib.import_module(path.replace("/", ".")[:-3]).main


def test_tools_answer_a_user_error_with_one_line_and_2(tmp_path, capsys):
    """LoRA tools and dataset tools through the shared main: a missing input is exit 2 and one
    line naming it; check_dataset's problems are exit 1."""
    missing = str(tmp_path / "missing.safetensors")
    cases = {
        "networks/check_lora_weights.py": [missing],
        "networks/resize_lora.py": ["--model", missing, "--save_to", str(tmp_path / "o.safetensors")],
        "networks/merge_lora.py": ["--models", missing, "--save_to", str(tmp_path / "o.safetensors")],
        "finetune/clean_captions_and_tags.py": [str(tmp_path / "missing.json"), str(tmp_path / "o.json")],
        "tools/check_dataset.py": [str(tmp_path / "no_folder")],
        "finetune/make_captions_vlm.py": [str(tmp_path / "no_folder"), "--model", "m"],
    }
    for tool, argv in cases.items():
        assert _tool_main(tool)(argv) == 2, tool
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (tool, err)
        assert "missing" in err[0] or "no_folder" in err[0], (tool, err)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.png").write_bytes(b"not a png")
    assert _tool_main("tools/check_dataset.py")([str(tmp_path / "data")]) == 1


def test_every_tool_main_goes_through_the_shared_helper():
    """No LoRA or dataset tool answers a UserError by hand (the scan finds the old pattern)."""
    hand = re.compile(r"except \([^)]*UserError[^)]*\)|except UserError")
    tools = [os.path.join("networks", n) for n in os.listdir(os.path.join(ROOT, "networks"))]
    tools += [os.path.join("finetune", n) for n in os.listdir(os.path.join(ROOT, "finetune"))]
    tools += ["tools/caption_edit.py", "tools/check_dataset.py", "tools/dataset_folders.py",
              "tools/resize_images_to_resolution.py", "library/dataset_tools/caption_cli.py"]
    found = []
    for t in tools:
        if t.endswith(".py"):
            with open(os.path.join(ROOT, t), encoding="utf-8") as f:
                text = f.read()
            if "def main" in text and hand.search(text):
                found.append(t)
    assert len(tools) > 20 and not found, found
