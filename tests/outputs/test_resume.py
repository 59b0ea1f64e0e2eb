"""Exact resume: save_state / resume / SIGINT-SIGTERM states (library/outputs/train_state.py).

A run interrupted mid-epoch (by SIGINT, in this process and in a subprocess, or by a shorter
``max_train_steps``) and resumed, twice, ends bit-identical to the uninterrupted run (one CPU
thread, set by conftest): the same weights, the same loss and learning rate at every step
(cosine with warmup: the schedule continues, never restarts), the same counters. LoRA runs use
AdamW (optimizer state) and network dropout (global generator state), so both must be restored
for bit identity; DreamBooth and one LoRA run (with dropout) take the uncached DataLoader path.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal

import pytest
import torch

from tests.conftest import read
from library.errors import ResumeError

LORA = ["--pretrained_model_name_or_path", "tiny-sd15", "--resolution", "64", "--cache_latents",
        "--network_dim", "4", "--network_alpha", "2", "--network_dropout", "0.1",
        "--learning_rate", "1e-3", "--lr_scheduler", "cosine", "--lr_warmup_steps", "2",
        "--seed", "3"]
STEPS = 12  # 4 steps per epoch (2 images x 2 repeats, batch 1): 3 epochs


def train(script: str, args: list, stop_at=(), sig=signal.SIGINT) -> tuple[int, str, object]:
    """Run an entry script in this process; returns (rc, stderr, the Run, or for an interrupted
    run the loop's view of it: its progress and parts). ``stop_at``: steps during which this
    process sends itself ``sig`` (SIGINT: as a user's Ctrl-C)."""
    from library.cli import main
    from library.run.run_state import HOOKS
    from tests.conftest import reset_accelerate, runs_kept

    box, pending = {}, set(stop_at)

    def before_micro_step(view, epoch, idx):
        box["view"] = view
        if view.progress.global_step + 1 in pending:
            pending.discard(view.progress.global_step + 1)
            os.kill(os.getpid(), sig)

    err = io.StringIO()
    reset_accelerate()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as conftest's autouse fixture, also for module-scoped fixtures
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
                HOOKS.add(before_micro_step=before_micro_step), runs_kept() as runs:
            rc = main(script, [str(x) for x in args])
    finally:
        torch.set_num_threads(threads)
        reset_accelerate()
    return rc, err.getvalue(), runs[0] if runs else box.get("view")


def weights(path):
    return read(path)[0]


def assert_same_run(a, b):
    """Bit-identical weights files and the same per-step log and counters."""
    ra, rb = a["run"], b["run"]
    assert ra.progress.global_step == rb.progress.global_step and ra.progress.epochs_done == rb.progress.epochs_done
    assert ra.progress.samples_seen == rb.progress.samples_seen
    assert ra.parts.stepper.scheduler.last_epoch == rb.parts.stepper.scheduler.last_epoch == ra.progress.global_step
    assert ra.progress.lr_log == rb.progress.lr_log          # the learning rate of every step, exactly
    assert ra.progress.loss_log == rb.progress.loss_log      # the global loss of every step, exactly
    wa, wb = weights(a["file"]), weights(b["file"])
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tools.make_sample_dataset import make_sample_dataset

    root = str(tmp_path_factory.mktemp("resume") / "data")
    make_sample_dataset(root, n_images=2, size=64, repeats=2)
    return root


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("uninterrupted"))
    rc, err, run = train("train_lora", [*LORA, "--train_data_dir", data, "--output_dir", out,
                                        "--max_train_steps", STEPS])
    assert rc == 0, err[-2000:]
    # the schedule is not constant: warmup 2 steps, then cosine down to near 0
    assert run.progress.lr_log[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])
    assert run.progress.lr_log[-1] < 3e-5 and run.progress.global_step == STEPS and run.progress.epochs_done == 3
    return {"run": run, "file": os.path.join(out, "last.safetensors")}


def test_lora_sigint_twice_resumes_bit_identical(data, tmp_path, uninterrupted):
    out = str(tmp_path)
    args = [*LORA, "--train_data_dir", data, "--output_dir", out, "--max_train_steps", STEPS]
    rc, err, r = train("train_lora", args, stop_at={3})
    assert rc == 130, err[-2000:]
    state = os.path.join(out, "last-step00000003-state")
    assert "interrupted by SIGINT: stopped after step 3" in err and f"--resume {state}" in err
    assert sorted(os.listdir(out)) == ["last-step00000003-state"]  # no model: only the state
    info = json.load(open(os.path.join(state, "state.json")))
    assert (info["global_step"], info["epoch"], info["batch"], info["epochs_done"]) == (3, 1, 3, 0)
    assert info["lr_log"] == uninterrupted["run"].progress.lr_log[:3]

    # second interruption, in another epoch (step 10 = epoch 3, its 2nd global batch)
    rc, err, r = train("train_lora", [*args, "--resume", state], stop_at={10})
    assert rc == 130, err[-2000:]
    assert r.progress.global_step == 10 and r.progress.lr_log == uninterrupted["run"].progress.lr_log[:10]
    rc, err, r = train("train_lora", [*args, "--resume", "latest"])
    assert rc == 0, err[-2000:]
    assert_same_run({"run": r, "file": os.path.join(out, "last.safetensors")}, uninterrupted)


def test_lora_lengthened_twice_resumes_bit_identical(data, tmp_path_factory):
    """Stopped by a short max_train_steps (mid-epoch), resumed with longer ones; the warmup
    (2 steps, then constant) continues rather than restarting. With fused_backward_pass: the
    per-parameter optimizers' state is in the stepper's state too."""
    base = [*LORA, "--train_data_dir", data, "--lr_scheduler", "constant_with_warmup",
            "--fused_backward_pass"]
    whole, parts = str(tmp_path_factory.mktemp("whole")), str(tmp_path_factory.mktemp("parts"))
    rc, err, u = train("train_lora", [*base, "--output_dir", whole, "--max_train_steps", 9])
    assert rc == 0, err[-2000:]
    parts_args = [*base, "--output_dir", parts, "--save_state_on_train_end"]
    rc, err, r = train("train_lora", [*parts_args, "--max_train_steps", 3])
    assert rc == 0 and r.progress.lr_log == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3]), err[-2000:]
    assert sorted(os.listdir(parts)) == ["last-state", "last.safetensors"]
    rc, err, r = train("train_lora", [*parts_args, "--max_train_steps", 6, "--resume", "latest"])
    assert rc == 0 and r.progress.global_step == 6, err[-2000:]
    rc, err, r = train("train_lora", [*parts_args, "--max_train_steps", 9, "--resume",
                                      os.path.join(parts, "last-state")])
    assert rc == 0, err[-2000:]
    assert_same_run({"run": r, "file": os.path.join(parts, "last.safetensors")},
                    {"run": u, "file": os.path.join(whole, "last.safetensors")})


def test_lora_dropout_without_cached_latents_resumes_bit_identical(data, tmp_path_factory):
    """Images loaded per step (no cache_latents) with network dropout: the DataLoader's epoch
    iterators, made at other points of a resumed run, must not draw from the global generator
    that the dropout masks come from. Stopped mid-epoch, resumed across an epoch boundary."""
    base = [a for a in LORA if a != "--cache_latents"] + ["--train_data_dir", data]
    whole, parts = str(tmp_path_factory.mktemp("whole")), str(tmp_path_factory.mktemp("parts"))
    rc, err, u = train("train_lora", [*base, "--output_dir", whole, "--max_train_steps", 6])
    assert rc == 0, err[-2000:]
    parts_args = [*base, "--output_dir", parts, "--save_state_on_train_end"]
    rc, err, _ = train("train_lora", [*parts_args, "--max_train_steps", 2])
    assert rc == 0, err[-2000:]
    rc, err, r = train("train_lora", [*parts_args, "--max_train_steps", 6, "--resume", "latest"])
    assert rc == 0, err[-2000:]
    assert_same_run({"run": r, "file": os.path.join(parts, "last.safetensors")},
                    {"run": u, "file": os.path.join(whole, "last.safetensors")})


def test_dreambooth_sigint_twice_resumes_bit_identical(data, tmp_path_factory):
    """Full fine-tune (the U-Net's own weights and their AdamW state), images loaded per step;
    stopped once by SIGINT, once by SIGTERM."""
    base = ["--pretrained_model_name_or_path", "tiny-sd15", "--resolution", "64",
            "--train_data_dir", data, "--learning_rate", "1e-4", "--lr_scheduler", "cosine",
            "--lr_warmup_steps", "1", "--seed", "5", "--max_train_steps", 6]
    whole, parts = str(tmp_path_factory.mktemp("db_whole")), str(tmp_path_factory.mktemp("db_parts"))
    rc, err, u = train("train_dreambooth", [*base, "--output_dir", whole])
    assert rc == 0, err[-2000:]
    args = [*base, "--output_dir", parts]
    rc, err, _ = train("train_dreambooth", args, stop_at={2})
    assert rc == 130, err[-2000:]
    rc, err, _ = train("train_dreambooth", [*args, "--resume", "latest"], stop_at={5},
                       sig=signal.SIGTERM)  # as a job scheduler's stop
    assert rc == 143 and "interrupted by SIGTERM: stopped after step 5" in err, err[-2000:]
    assert sorted(os.listdir(parts)) == ["last-step00000002-state", "last-step00000005-state"]
    rc, err, r = train("train_dreambooth", [*args, "--resume", "latest"])
    assert rc == 0, err[-2000:]
    assert_same_run({"run": r, "file": os.path.join(parts, "last.safetensors")},
                    {"run": u, "file": os.path.join(whole, "last.safetensors")})
    assert len(weights(os.path.join(whole, "last.safetensors"))) > 100  # the whole model


def test_lengthened_cosine_continues_on_the_new_curve(rotated, tmp_path):
    """Lengthening a run whose schedule depends on its length: from the resume point on, the
    learning rate follows the new length's curve (cosine, 2 warmup steps, now 12 steps)."""
    import math

    shutil.copytree(os.path.join(rotated["out"], "last-state"), str(tmp_path / "last-state"))
    args = [*rotated["args"], "--output_dir", tmp_path, "--max_train_steps", 12, "--resume", "latest"]
    rc, err, r = train("train_lora", args)
    assert rc == 0, err[-2000:]
    assert r.progress.lr_log[:10] == rotated["run"].progress.lr_log  # the first 10 steps: as they were trained
    new_curve = [1e-3 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 10)) for s in (10, 11)]
    assert r.progress.lr_log[10:] == pytest.approx(new_curve, rel=1e-12)
    assert rotated["run"].progress.lr_log[-1] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))


@pytest.fixture(scope="module")
def rotated(data, tmp_path_factory):
    """10 steps (3 epochs), a save every step and every epoch, with states and rotation."""
    out = str(tmp_path_factory.mktemp("rotated"))
    args = [*LORA, "--train_data_dir", data, "--output_dir", out, "--max_train_steps", 10,
            "--save_every_n_steps", 1, "--save_every_n_epochs", 1, "--save_state",
            "--save_last_n_steps", 2, "--save_last_n_steps_state", 1, "--save_last_n_epochs", 1]
    rc, err, run = train("train_lora", args)
    assert rc == 0, err[-2000:]
    return {"out": out, "args": args, "run": run}


def test_rotation_keeps_the_last_n(rotated):
    names = set(os.listdir(rotated["out"]))
    # sd-scripts' rules: the save at step s removes step s - n - 1 (n in steps); the save of
    # epoch e removes epoch e - n x save_every_n_epochs; states default to the models' n.
    assert names == {"last.safetensors", "last-state",
                     "last-step00000007.safetensors", "last-step00000008.safetensors",
                     "last-step00000009.safetensors",
                     "last-step00000008-state", "last-step00000009-state",
                     "last-000002.safetensors", "last-000002-state"}
    info = json.load(open(os.path.join(rotated["out"], "last-000002-state", "state.json")))
    assert (info["global_step"], info["epoch"], info["batch"], info["epochs_done"]) == (8, 3, 0, 2)


def test_latest_is_the_highest_step(rotated, tmp_path):
    from library.outputs import train_state

    out = str(tmp_path)
    for name in ("last-step00000008-state", "last-000002-state", "last-step00000009-state"):
        shutil.copytree(os.path.join(rotated["out"], name), os.path.join(out, name))
    # incomplete (a copy without its optimizer state, claiming step 99): never picked
    bad = os.path.join(out, "last-step00000099-state")
    shutil.copytree(os.path.join(rotated["out"], "last-step00000009-state"), bad)
    os.remove(os.path.join(bad, "stepper.pt"))
    info = json.load(open(os.path.join(bad, "state.json")))
    json.dump(dict(info, global_step=99), open(os.path.join(bad, "state.json"), "w"))
    assert train_state.resolve("latest", out) == os.path.join(out, "last-step00000009-state")
    shutil.copytree(os.path.join(rotated["out"], "last-state"), os.path.join(out, "other-state"))
    assert train_state.resolve("latest", out) == os.path.join(out, "other-state")  # step 10
    with pytest.raises(ResumeError, match="step00000099-state is damaged: stepper.pt is missing"):
        train_state.read_info(os.path.join(out, "last-step00000099-state"))


@pytest.mark.parametrize("change, message", [
    (["--min_snr_gamma", "5"], r"min_snr_gamma changed since the state in .* \(was unset, now 5.0\)"),
    (["--seed", "4"], "seed changed since the state"),
    (["--network_dim", "8"], "network_dim changed since the state"),
    (["--lr_scheduler", "linear"], "lr_scheduler changed"),
    (["--train_batch_size", "2"], r"the global batch changed .* \(was 1 = .*, now 2 = 2 x 1 x 1\)"),
    (["--max_train_steps", "10"], "is at step 10 but this run has 10 steps; raise max_train_steps"),
    (["--resume", "/nonexistent/x-state"], ": no such training state folder: /nonexistent/x-state"),
], ids=["loss", "seed", "model", "scheduler", "global_batch", "not_longer", "missing"])
def test_changed_config_is_an_error_naming_it(rotated, change, message):
    args = [*rotated["args"], "--max_train_steps", "12", "--resume", "latest", *change]
    rc, err, run = train("train_lora", args)
    assert rc == 2 and run is None, err[-2000:]
    import re

    assert re.search("error: resume.*" + message, err), err[-2000:]


def test_changed_data_is_an_error_naming_it(rotated, data, tmp_path):
    args = [*rotated["args"], "--max_train_steps", "12", "--resume", "latest"]
    cap = [os.path.join(dp, f) for dp, _, fs in os.walk(data) for f in fs if f.endswith(".caption")][0]
    old = open(cap).read()
    try:
        with open(cap, "w") as f:
            f.write("another caption\n")
        rc, err, _ = train("train_lora", args)
    finally:
        with open(cap, "w") as f:
            f.write(old)
    assert rc == 2 and "training data changed" in err and "caption of " in err, err[-2000:]
    assert "now 'another caption'" in err
    rc, err, _ = train("train_lora", [*args[:args.index("--output_dir") + 1], str(tmp_path),
                                      *args[args.index("--output_dir") + 2:]])
    assert rc == 2 and f"no training state in output_dir {tmp_path}" in err


def test_failed_save_keeps_the_previous_state(rotated, monkeypatch):
    """A save that fails half-way leaves the state of the same name as it was, and no debris."""
    from library.outputs import train_state

    out = rotated["out"]
    path = os.path.join(out, "last-state")
    before = {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))}
    listing = sorted(os.listdir(out))
    real_save = torch.save

    def failing_save(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)  # a file is written, then the disk "fills up"
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        rotated["run"].saver.write_state(rotated["run"].progress, path)
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == listing  # no temporary folder left behind
    assert {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))} == before
    assert train_state.read_info(path)["global_step"] == 10


# -- two processes ---------------------------------------------------------------------------------
def test_two_process_state_resumed_on_one_process(tmp_path_factory):
    """2 processes x batch 1, SIGINT to rank 1 only: both stop after the same step and one state
    is written; it resumes on 1 process x batch 2 (the same global batch), is interrupted again,
    and ends as the uninterrupted 1-process run (within float summation noise: SGD at 128 px,
    as in tests/training/test_equivalence.py)."""
    from tests.training.test_equivalence import TOL, make_two_bucket_dataset, max_rel_diff, train_args
    from tests.distributed.test_multiprocess import launch_and_signal

    data = make_two_bucket_dataset(str(tmp_path_factory.mktemp("twobuckets")))
    whole, parts = str(tmp_path_factory.mktemp("mp_whole")), str(tmp_path_factory.mktemp("mp_parts"))
    report = str(tmp_path_factory.mktemp("mp_report"))
    common = ["--max_train_epochs", "2", "--max_grad_norm", "0"]  # 3 steps per epoch
    # rank 1 waits at the end of step 2 for a Ctrl-C that reaches it alone
    ranks, log = launch_and_signal(report, train_args(data, parts, "--train_batch_size", "1",
                                                      *common), at="1:2")
    assert [r["rc"] for r in ranks] == [130, 130], log[-4000:]
    assert all(r["world_size"] == 2 for r in ranks)
    # both processes stopped after step 2 (mid-epoch) and one state was written
    assert [d for d in os.listdir(parts) if d.endswith("-state")] == ["last-step00000002-state"]
    info = json.load(open(os.path.join(parts, "last-step00000002-state", "state.json")))
    assert (info["processes"], info["global_batch"], info["global_step"]) == (2, 2, 2)
    assert (info["epoch"], info["batch"]) == (1, 2)

    one = train_args(data, parts, "--train_batch_size", "2", *common)
    rc, err, _ = train("train_lora", [*one, "--resume", "latest"], stop_at={4})
    assert rc == 130, err[-2000:]
    rc, err, r = train("train_lora", [*one, "--resume", "latest"])
    assert rc == 0, err[-2000:]
    rc, err, u = train("train_lora", train_args(data, whole, "--train_batch_size", "2", *common))
    assert rc == 0, err[-2000:]
    assert r.progress.global_step == u.progress.global_step == 6 and r.progress.epochs_done == u.progress.epochs_done == 2
    assert r.progress.samples_seen == u.progress.samples_seen == 8
    assert r.progress.lr_log == u.progress.lr_log
    assert r.progress.loss_log == pytest.approx(u.progress.loss_log, rel=1e-5)
    worst, key = max_rel_diff(weights(os.path.join(parts, "last.safetensors")),
                              weights(os.path.join(whole, "last.safetensors")))
    # The 2-process steps sum the gradient in another order than 1 process: the bound is that
    # noise floor (measured: 7e-6 here; up to 9e-6 with no resume at all, test_equivalence.py).
    assert worst <= TOL, f"{key}: {worst:.2e}"


def test_state_older_than_an_option_resumes_at_its_default(rotated, tmp_path):
    """A state written before an option existed lacks its key: resuming with the option at its
    default is the same run; set to anything else, it is a change naming the option."""
    import shutil

    out = str(tmp_path / "out")
    os.makedirs(out)
    shutil.copytree(os.path.join(rotated["out"], "last-step00000009-state"),
                    os.path.join(out, "last-step00000009-state"))
    info_path = os.path.join(out, "last-step00000009-state", "state.json")
    info = json.load(open(info_path))
    assert info["config"].pop("alpha_mask", "absent") is False
    with open(info_path, "w") as f:
        json.dump(info, f)
    args = [*rotated["args"], "--max_train_steps", "10", "--resume", "latest"]
    args[args.index("--output_dir") + 1] = out
    rc, err, _ = train("train_lora", [*args, "--alpha_mask"])
    assert rc == 2 and "alpha_mask changed" in err, err[-2000:]
    rc, err, run = train("train_lora", args)
    assert rc == 0 and run.progress.global_step == 10, err[-2000:]


def test_resume_keeps_the_validation_log_and_norm_statistics(tmp_path_factory):
    """Validation every step and scale_weight_norms: stopped after step 2 and resumed, the run's
    validation log (every step's, the ones before the stop included) and its last max-norm
    statistics equal the uninterrupted run's, bit for bit (the state restores the whole
    progress record)."""
    from tools.make_sample_dataset import make_sample_dataset

    data = str(tmp_path_factory.mktemp("resume_val") / "data")
    make_sample_dataset(data, n_images=4, size=64, repeats=1)
    base = [*LORA, "--train_data_dir", data, "--max_train_steps", 4, "--validation_split", "0.5",
            "--validate_every_n_steps", "1", "--scale_weight_norms", "0.01"]
    out_a, out_b = str(tmp_path_factory.mktemp("val_a")), str(tmp_path_factory.mktemp("val_b"))
    rc, err, a = train("train_lora", [*base, "--output_dir", out_a])
    assert rc == 0, err[-2000:]
    assert [s for s, _ in a.progress.val_log] == [1, 2, 3, 4]
    from library.training.network_options import host_stats

    stats = host_stats(a.progress.max_norm_stats)
    assert stats[0] > 0  # the 0.01 bound scales some modules (max norm 0.02 unbounded)
    rc, err, _ = train("train_lora", [*base, "--output_dir", out_b], stop_at={3})
    assert rc == 130, err[-2000:]
    rc, err, b = train("train_lora", [*base, "--output_dir", out_b, "--resume", "latest"])
    assert rc == 0, err[-2000:]
    assert b.progress.val_log == a.progress.val_log
    assert host_stats(b.progress.max_norm_stats) == stats
    assert b.progress.loss_log == a.progress.loss_log
