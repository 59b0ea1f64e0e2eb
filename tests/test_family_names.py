"""No family or method is told apart by its name outside its home (issue 38 items 1 and 2).

Shared code asks a family's capabilities (library/models/families/, ``registry.get(name).flow``,
``.size_conditioning``, ...) and a method's (library/training/methods.py), never compares a name.
``name_comparisons`` parses every module of library/ and networks/ outside the family homes and
reports each comparison (``==``, ``!=``, ``in``, ``not in``) of an expression with a family name
(a string constant such as "sdxl", or a tuple / list / set holding one), and each comparison of a
method expression (an operand whose source names ``method``) with a method name. The test that
the scanner sees what it must plants violations in source text.

``NOT_YET_HOME`` lists the modules that are one family's own code but still sit beside the homes
(the model files of FLUX.1 and SD3, the SD loaders, ...): they move into their family's folder
next, and the list may only shrink (each entry must exist and must still hold a comparison).
"""
from __future__ import annotations

import ast
import os

import pytest

from library.config import method_kinds
from library.models.families import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOMES = os.path.join("library", "models", "families")
FAMILY_NAMES = frozenset(registry.FAMILIES)
METHOD_NAMES = frozenset(method_kinds.KINDS)  # lora, dreambooth, finetune, textual_inversion, leco
# one family's code not yet moved into its folder (path -> the family folder it belongs in)
NOT_YET_HOME = {
    "library/models/loading.py": "sd1 / sd2 / sdxl (the diffusers and single-file loader)",
    "library/models/sd_checkpoint.py": "sd1 / sd2 / sdxl (single-file layouts)",
}


def _is_name(node, names) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_name(e, names) for e in node.elts)
    return False


def name_comparisons(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, source text) of each comparison of a family or method name in ``source``."""
    tree = ast.parse(source, filename)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                continue
            a, b = operands[i], operands[i + 1]
            family = _is_name(a, FAMILY_NAMES) or _is_name(b, FAMILY_NAMES)
            method = any(_is_name(x, METHOD_NAMES) and "method" in ast.unparse(y).lower()
                         for x, y in ((a, b), (b, a)))
            if family or method:
                found.append((node.lineno, ast.get_source_segment(source, node) or ast.unparse(node)))
                break
    return found


def shared_modules() -> list[str]:
    out = []
    for top in ("library", "networks"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            rel = os.path.relpath(folder, ROOT)
            if rel == HOMES or rel.startswith(HOMES + os.sep):
                continue
            out += [os.path.join(rel, f).replace(os.sep, "/") for f in sorted(files) if f.endswith(".py")]
    return out


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def test_no_family_or_method_name_comparisons_outside_the_homes():
    bad = [f"{rel}:{line}: {text}" for rel in shared_modules() if rel not in NOT_YET_HOME
           for line, text in name_comparisons(_read(rel), rel)]
    assert not bad, ("compared with a family / method name outside its home (ask the family's or the "
                     "method's capability instead):\n" + "\n".join(bad))


def test_not_yet_home_list_only_shrinks():
    for rel in NOT_YET_HOME:
        assert os.path.isfile(os.path.join(ROOT, rel)), f"{rel} is gone: drop it from NOT_YET_HOME"
        assert name_comparisons(_read(rel), rel), f"{rel} compares no name now: drop it from NOT_YET_HOME"


@pytest.mark.parametrize("planted", [
    'if bundle.family == "sdxl":\n    pass\n',
    'x = fam != "flux"\n',
    'ok = family in ("flux", "sd3")\n',
    'ok = bundle.family not in {"sd1", "sd2"}\n',
    'ok = "sd3" == b.family\n',
    'if method_name == "lora":\n    pass\n',
    'ok = self.method_name in ("dreambooth", "finetune")\n',
])
def test_the_scan_reports_a_planted_comparison(planted):
    """Each kind of violation, planted into a real shared module's source, is reported at its line."""
    src = _read("library/training/batch_loss.py")
    lines = len(src.splitlines())
    found = name_comparisons(src + "\n" + planted)
    assert [line for line, _ in found] == [lines + 2]


def test_the_scan_leaves_capabilities_and_other_strings_alone():
    src = ('if registry.of(bundle).size_conditioning:\n    pass\n'
           'ok = tab == "finetune"\n'  # a GUI tab, not a method
           'ok = name.startswith("sdxl")\n'
           'ok = family is None\n')
    assert name_comparisons(src) == []
