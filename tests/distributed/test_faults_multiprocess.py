"""Several processes: a one-line error on one rank only ends every rank cleanly.

``accelerate launch --multi_gpu --num_processes 2`` on the CPU (gloo): rank 0's final model save
fails (disk full, injected: the worker is this file); rank 1, waiting for it in the barrier after
the save, ends with one line instead of gloo's traceback, well before the process group's timeout.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(argv: list[str]) -> int:
    """Launched by accelerate: train_lora where rank 0's final model save fails (disk full)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from library.cli import main
    from library.files import SaveError
    from library.outputs import checkpoints

    real = checkpoints.Saver._write_model

    def write_model(self, path, meta, *rest):
        if os.environ.get("RANK") == "0" and os.environ.get("SDTK_TEST_FAIL_SAVE"):
            raise SaveError(path, os.strerror(28))
        return real(self, path, meta, *rest)

    checkpoints.Saver._write_model = write_model
    return main("train_lora", argv)


@pytest.mark.slow  # one 2-process launch: ~30 s on a quiet 2-core machine
def test_rank0_save_failure_ends_rank1_with_one_line(tmp_path):
    from tests.conftest import two_process_command
    from tools.make_sample_dataset import make_sample_dataset

    data = str(tmp_path / "data")
    make_sample_dataset(data, n_images=2, size=64, repeats=1)
    args = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", data,
            "--resolution", "64", "--network_dim", "4", "--max_train_steps", "1",
            "--output_dir", str(tmp_path / "out"), "--output_name", "last", "--cache_latents"]
    cmd, env = two_process_command(os.path.abspath(__file__), args, SDTK_TEST_FAIL_SAVE="1")
    started = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - started
    assert p.returncode != 0
    assert "processes: 2" in p.stdout and "global_batch: 2" in p.stdout  # world size 2
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert errors[0].startswith(f"error: cannot save {tmp_path / 'out' / 'last.safetensors'}: "
                                "No space left on device"), p.stderr[-3000:]
    # rank 1: its one line (or the launcher's SIGTERM first), never a traceback of its own
    # (torch's own once-per-rank warnings, e.g. DDP's find_unused_parameters note, may appear)
    rank1 = [ln for ln in p.stderr.splitlines() if ln.startswith("[rank1]:")]
    assert not [ln for ln in rank1 if "Traceback" in ln or "Error" in ln], p.stderr[-3000:]
    assert len(errors) <= 2
    if len(errors) == 2:
        assert errors[1].startswith("error: process 1 of 2: stopped because another process "
                                    "of the job ended"), errors
    assert elapsed < 500, elapsed  # not the process group's timeout (1800 s)


def test_peer_failure_lines(monkeypatch):
    """Which errors of a collective mean "another process ended / hung" (texts as gloo and
    NCCL raise them), and that other errors are left alone (tracebacks of real bugs stay)."""
    from library.accelerator import peer_failure

    gone = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                        "closed by peer [127.0.0.1]:54960. This is typically caused by a remote "
                        "worker crashing.")
    hung = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed "
                        "out waiting 1800000ms for recv operation to complete")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert peer_failure(gone) is None  # one process: not a peer's failure
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert peer_failure(gone).startswith("process 1 of 2: stopped because another process")
    assert "did not answer within ddp_timeout" in peer_failure(hung)
    assert "\n" not in peer_failure(hung)
    assert peer_failure(RuntimeError("shape mismatch: timeout of the loader")) is None
    assert peer_failure(ValueError("Connection closed by peer")) is None


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
