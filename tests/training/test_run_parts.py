"""Typed parts, passed explicitly (library/run/run_state.py Components).

- Every field of the run's parts has its real type: none is ``Any`` or left unannotated.
- No function of the layers below the run's orchestration (library/training, library/outputs,
  library/distributed, library/data), nor of library/run outside its orchestrators, takes the
  whole run or its parts record: a parameter named ``run`` / ``r`` / ``c`` (``parts`` /
  ``components`` unless typed otherwise), or typed ``Run`` / ``Components``. Each takes the parts
  it uses, so its signature says what it may touch. The orchestrators that hold the run are an
  explicit, short allow-list.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import re

# (file, function) that may take the run: the orchestration of its stages (a dry run's, a training
# run's around the output lock, and inside it), the loop's entry (the loop's hooks get a LoopView,
# not the run).
ORCHESTRATORS = {
    ("library/run/stages.py", "dry_run"),
    ("library/run/stages.py", "train"),
    ("library/run/stages.py", "_train"),
    ("library/run/loop.py", "train"),
}
LAYERS = ("library/run", "library/training", "library/outputs", "library/distributed", "library/data")
RUN_NAMES = {"run", "r", "c"}          # whatever their annotation
RECORD_NAMES = {"parts", "components"}  # unless annotated as something else (a list of Parts)
RECORD_TYPES = ("Run", "Components")


def names_in(annotation) -> set[str]:
    """The names an annotation (a string under ``from __future__ import annotations``, or a
    type) is made of: ``"EMA | None"`` -> {"EMA", "None"}."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__",
                                                                   repr(annotation))
    return set(re.findall(r"\w+", text))


def whole_run_parameters(source: str) -> list[tuple[int, str, str]]:
    """(line, function, parameter) of every parameter that hands a function the whole run or
    its parts record."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # not a lambda's record
            continue
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is None:
                continue
            ann = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            typed_as_record = bool(names_in(ann) & set(RECORD_TYPES))
            if arg.arg in RUN_NAMES or typed_as_record or (arg.arg in RECORD_NAMES and not ann):
                found.append((node.lineno, node.name, arg.arg))
    return sorted(found)


def test_the_scan_finds_a_planted_whole_run_parameter():
    planted = ("def save(run, *, epoch=None):\n    pass\n"
               "def write(path, c):\n    pass\n"
               "def load(path, state: Components):\n    pass\n"
               "class S:\n    def prepare(self, parts, groups):\n        pass\n"
               "def stage(x: 'trainer.Run'):\n    pass\n"
               "def stop(what, r: Run | None = None):\n    pass\n")
    assert [(line, name, arg) for line, name, arg in whole_run_parameters(planted)] == [
        (1, "save", "run"), (3, "write", "c"), (5, "load", "state"), (8, "prepare", "parts"),
        (10, "stage", "x"), (12, "stop", "r")]
    fine = ("def save(progress, *, method, stepper):\n    pass\n"
            "def release(self, parts: list[Part]):\n    pass\n"
            "def loss(self, *, accelerator, bundle, runs: int, crc):\n    pass\n"
            "f = lambda r: r.getMessage()\n")
    assert whole_run_parameters(fine) == []


def test_no_function_below_the_run_takes_the_whole_run():
    from tests.helpers import ROOT

    found, allowed = [], set()
    for layer in LAYERS:
        for folder, _, files in os.walk(os.path.join(ROOT, layer)):
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
                for line, name, arg in whole_run_parameters(open(path, encoding="utf-8").read()):
                    if (rel, name) in ORCHESTRATORS:
                        allowed.add((rel, name))
                    else:
                        found.append(f"{rel}:{line}: {name}({arg}, ...)")
    assert not found, "take the parts used, not the run:\n" + "\n".join(found)
    assert allowed == ORCHESTRATORS  # each allowed orchestrator still exists (no stale entry)


def test_every_part_has_its_real_type():
    """Each field of Components is annotated with a type other than Any, and the annotation
    names a type that exists (resolved in the module's namespace and its annotation imports)."""
    import typing

    from library.run import run_state
    from library.run.run_state import Components

    fields = dataclasses.fields(Components)
    assert len(fields) >= 15
    for f in fields:
        assert names_in(f.type) and "Any" not in names_in(f.type), f"Components.{f.name}: {f.type}"
    # the annotation imports: run_state's "if TYPE_CHECKING:" block (its parts' modules import
    # torch, so the module imports them for annotations only), run here
    namespace = dict(vars(run_state))
    for node in ast.parse(open(run_state.__file__, encoding="utf-8").read()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            exec(compile(ast.Module(node.body, type_ignores=[]), run_state.__file__, "exec"), namespace)
    assert "Strategy" in namespace and "Accelerator" in namespace
    hints = typing.get_type_hints(Components, namespace)
    assert set(hints) == {f.name for f in fields}
    assert all(h is not typing.Any for h in hints.values())


def test_the_type_check_catches_a_planted_any():
    """The check above, on a planted record: a field typed Any (or not annotated as a type)."""
    from typing import Any

    @dataclasses.dataclass
    class Planted:
        method: Any = None
        stepper: "Any | None" = None

    assert all("Any" in names_in(f.type) for f in dataclasses.fields(Planted))


# -- one "main process" answer ----------------------------------------------------------------------
MAIN_ANSWER = "library/accelerator.py"  # is_main_process(): the launcher's global rank 0


def other_main_process_answers(source: str) -> list[int]:
    """Lines that decide "main process?" another way than ``is_main_process()``: the
    Accelerator's (or any object's) ``.is_main_process`` attribute, or a read of the launcher's
    RANK (``os.environ.get("RANK")``, ``os.environ["RANK"]``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "is_main_process" and \
                not (isinstance(node.value, ast.Name) and node.value.id == "accelerator"):
            found.append(node.lineno)  # acc.is_main_process (the module's function is fine)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("environ.get") and \
                node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "RANK":
            found.append(node.lineno)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ") and \
                isinstance(node.slice, ast.Constant) and node.slice.value == "RANK":
            found.append(node.lineno)
    return sorted(found)


def test_the_scan_finds_a_planted_main_process_decision():
    planted = ("if acc.is_main_process:\n    pass\n"
               "main = int(os.environ.get('RANK', '0')) == 0\n"
               "r = os.environ['RANK']\n"
               "x = self.c.accelerator.is_main_process\n")
    assert other_main_process_answers(planted) == [1, 3, 4, 5]
    fine = ("if is_main_process():\n    pass\n"
            "from library import accelerator\naccelerator.is_main_process()\n"
            "for k in ('WORLD_SIZE', 'RANK'):\n    env.pop(k, None)\n")
    assert other_main_process_answers(fine) == []


def test_one_main_process_answer():
    """Every module of the toolkit (library/, tools/, networks/, the entry scripts; not the
    benchmarks' workers, which seed by rank or run inside sd-scripts) asks
    library/accelerator.py ``is_main_process()``; only it reads the launcher's RANK
    (to answer, and to name a process in an error line)."""
    from tests.helpers import ROOT, source_files

    files = [p for p in source_files()
             if not os.path.relpath(p, ROOT).replace(os.sep, "/").startswith("benchmarks/")]
    assert os.path.join(ROOT, "library", "outputs", "checkpoints.py") in files
    found = [f"{os.path.relpath(p, ROOT)}:{line}" for p in files
             if os.path.relpath(p, ROOT).replace(os.sep, "/") != MAIN_ANSWER
             for line in other_main_process_answers(open(p, encoding="utf-8").read())]
    assert not found, "ask library.accelerator.is_main_process():\n" + "\n".join(found)
