"""Narrow signatures (issue 38): no function in library/ takes more than MAX_PARAMETERS
parameters. Values that travel together are one small frozen record, made where they originate
(``step_plan.EpochSamples`` / ``BatchShape`` / ``RunLength``, ``metadata.ModelKind``,
``leco.Denoiser`` / ``Guidance``, ``SaveTargets``, ``Evaluated``, ``ProcessShare``,
``PromptBatch``), not ten keywords."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The most parameters a function may take: self / cls not counted, *args and **kwargs one each.
MAX_PARAMETERS = 10

# "path:qualname" -> why it is legitimately wider than MAX_PARAMETERS. Empty today; a constructor
# that mirrors a model's config one keyword per field would belong here.
WIDE = {
}


def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def wide_functions(root: str, limit: int) -> dict[str, int]:
    """"path:qualname" -> parameter count of every function under ``root`` over ``limit``."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            rel = os.path.relpath(path, os.path.dirname(root)).replace(os.sep, "/")
            for qualname, fn in _functions(tree):
                n = parameter_count(fn)
                if n > limit:
                    out[f"{rel}:{qualname}"] = n
    return out


def test_no_function_in_library_is_wider_than_the_limit():
    wide = {k: n for k, n in wide_functions(os.path.join(ROOT, "library"), MAX_PARAMETERS).items()
            if k not in WIDE}
    assert not wide, (f"functions with more than {MAX_PARAMETERS} parameters (group the values that "
                      f"travel together into a frozen record, or list the function in WIDE with why): {wide}")


def test_every_listed_exception_is_still_wide():
    found = wide_functions(os.path.join(ROOT, "library"), MAX_PARAMETERS)
    assert not set(WIDE) - set(found), f"WIDE lists functions that are no longer wide: {set(WIDE) - set(found)}"


def test_a_planted_wide_function_is_found(tmp_path):
    pkg = tmp_path / "library"
    (pkg / "sub").mkdir(parents=True)
    args = ", ".join(f"a{i}" for i in range(MAX_PARAMETERS))
    (pkg / "sub" / "planted.py").write_text(
        f"class Saver:\n"
        f"    def __init__(self, {args}):\n        pass\n\n"
        f"    def fits(self, {args[:-4]}):\n        pass\n\n\n"
        f"def wide({args}, *, extra=None):\n    pass\n\n\n"
        f"def star({args[:-4]}, *args, **kwargs):\n    pass\n")
    assert wide_functions(str(pkg), MAX_PARAMETERS) == {
        "library/sub/planted.py:wide": MAX_PARAMETERS + 1,
        "library/sub/planted.py:star": MAX_PARAMETERS + 1}
    # the same limit the repository test applies: one parameter fewer would flag Saver.__init__ too
    assert "library/sub/planted.py:Saver.__init__" in wide_functions(str(pkg), MAX_PARAMETERS - 1)
