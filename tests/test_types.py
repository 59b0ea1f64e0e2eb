"""mypy over library/ (issue 38 item 4): the repository's own configuration (pyproject.toml
``[tool.mypy]``) finds no error in library/, and the same run finds a planted one.

One mypy run, with a fresh cache (about 10 s of CPU; the heavy third-party packages are not
followed, see the configuration): library/ and a planted module beside it that misuses three of
the typed records (the options, a Saver's parameters, a step plan). The run must report exactly
the planted module's three errors and nothing in library/ or networks/: a type error anywhere
in library/ fails this test with mypy's own line, and a configuration that stopped checking
(an ``ignore_errors``, a module skipped) fails it through the planted errors.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PLANTED = '''
from library.config.parse import Options
from library.data.step_plan import StepPlan
from library.outputs.checkpoints import SaveTargets


def use(opts: Options, plan: StepPlan, targets: SaveTargets) -> None:
    steps: str = opts.max_train_steps
    total: str = plan.total_steps
    targets.uploaderr
'''


def test_mypy_finds_no_error_in_library_and_the_planted_ones(tmp_path):
    pytest.importorskip("mypy")  # in the test extra
    planted = tmp_path / "planted_types.py"
    planted.write_text(PLANTED.lstrip("\n"))
    p = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
                        "--no-error-summary", "library", str(planted)],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT},
                       timeout=600)
    errors = [line for line in p.stdout.splitlines() if ": error:" in line]
    ours = [e for e in errors if not e.startswith(str(planted))]
    assert not ours, "mypy over library/ (pyproject.toml [tool.mypy]):\n" + "\n".join(ours)
    lines = PLANTED.lstrip("\n").splitlines()
    where = {int(e.split(":")[1]) for e in errors}
    assert where == {lines.index(s) + 1 for s in ("    steps: str = opts.max_train_steps",
                                                  "    total: str = plan.total_steps",
                                                  "    targets.uploaderr")}, p.stdout + p.stderr
    assert p.returncode == 1, p.stdout + p.stderr
