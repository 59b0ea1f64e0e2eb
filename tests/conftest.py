"""Shared fixtures: offline mode, a generated dataset, and an in-process entry-script runner."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def dataset(tmp_path):
    """Two 64 px images in ``2_sks shape`` (4 samples per epoch)."""
    from tools.make_sample_dataset import make_sample_dataset

    root = tmp_path / "data"
    make_sample_dataset(str(root), n_images=2, size=64, repeats=2)
    return str(root)


def reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture
def run_script(capsys):
    """Run an entry script in-process: ``run_script("train_lora", [...]) -> (rc, out, err)``."""
    from library.cli import main

    def _run(script, args):
        reset_accelerate()
        rc = main(script, [str(a) for a in args])
        out, err = capsys.readouterr()
        reset_accelerate()
        return rc, out, err

    return _run
