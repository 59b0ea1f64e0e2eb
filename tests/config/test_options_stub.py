"""Options are visible to editors and type checkers (library/config/options_stub.py): the
committed options_static.pyi declares exactly the run-time class's fields with their types,
and a type checker (mypy) reports a misspelt option and a wrongly typed use."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_committed_stub_is_the_generated_one():
    from library.config import options_stub

    with open(options_stub.STUB, encoding="utf-8") as f:
        committed = f.read()
    assert committed == options_stub.render(), "regenerate: python -m library.config.options_stub"


def test_the_stub_declares_the_run_time_fields():
    """Read from the stub's source (not from render()): the declared fields and annotations are
    the run-time dataclass's, in order, and its only methods are the two Options adds (no
    __getattr__, which would hide every typo from the checker)."""
    from library.config import options_stub

    tree = ast.parse(open(options_stub.STUB, encoding="utf-8").read())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    declared = [(n.target.id, ast.unparse(n.annotation)) for n in cls.body if isinstance(n, ast.AnnAssign)]
    runtime = options_stub.runtime_fields()
    assert len(runtime) > 150 and declared == runtime
    assert sorted(n.name for n in cls.body if isinstance(n, ast.FunctionDef)) == ["replace", "to_dict"]


SNIPPET = '''
from library.config.parse import parse_args

opts = parse_args("train_lora", [])
dim: int | None = opts.network_dim
res: tuple[int, int] | None = opts.resolution
wrong: str = opts.max_train_steps
opts.network_dimm
opts.replace(network_dim=4).to_dict()
'''


def test_a_type_checker_sees_the_options(tmp_path):
    pytest.importorskip("mypy")  # in the test extra
    snippet = tmp_path / "use_options.py"
    snippet.write_text(SNIPPET.strip("\n") + "\n")
    p = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
                        "--no-error-summary", "--cache-dir", str(tmp_path / "cache"), str(snippet)],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    errors = [line for line in p.stdout.splitlines() if ": error:" in line]
    lines = SNIPPET.strip("\n").splitlines()
    where = {int(e.split(":")[1]) for e in errors}
    assert where == {lines.index('wrong: str = opts.max_train_steps') + 1,
                     lines.index("opts.network_dimm") + 1}, p.stdout + p.stderr
    assert any('"Options" has no attribute "network_dimm"' in e for e in errors), errors
