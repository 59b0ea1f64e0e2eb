"""Nothing lost under non-finite training (library/training/nonfinite.py): a NaN/inf loss or gradient norm
stops the run within its step (exit code 3, one error line), the previous file of the same name
stays byte-identical, nothing non-finite is written, and the ``-step<N>-state`` written holds the
weights from before the bad update: bit-identical (one CPU thread) to a run stopped at step N,
and it resumes. Also the ``skip`` option and the finiteness checks of the weights files read.

The faults are injected: a NaN multiplied into the loss of one step, or an identity on the loss
whose backward multiplies the gradient by 1e30 (a finite loss, finite gradient elements, but a
gradient norm that overflows float32, which clipping would turn into a zero update).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import read

LORA = ["--pretrained_model_name_or_path", "tiny-sd15", "--resolution", "64", "--cache_latents",
        "--network_dim", "4", "--network_alpha", "2", "--learning_rate", "1e-3", "--seed", "3",
        "--output_name", "last"]


class _Blow(torch.autograd.Function):
    """Identity forward; backward scales the gradient by 1e30 (its norm overflows float32)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1e30


def inject(at_step: int, kind: str):
    """Make step ``at_step`` (1-based) go non-finite: ``nan`` loss or ``blow`` gradient (the
    loop's declared micro-step hook; a context manager)."""
    from library.run.run_state import HOOKS

    def after_micro_step(run, epoch, idx, loss):
        if run.progress.global_step + 1 == at_step:
            loss = loss * float("nan") if kind == "nan" else _Blow.apply(loss)
        return loss

    return HOOKS.add(after_micro_step=after_micro_step)


def assert_one_error_line(err: str, text: str):
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and text in errors[0], err[-3000:]
    assert "Traceback" not in err


def assert_all_finite(folder: str):
    n = 0
    for root, _, files in os.walk(folder):
        for f in files:
            if f.endswith(".safetensors"):
                for k, t in load_file(os.path.join(root, f)).items():
                    assert torch.isfinite(t).all(), (f, k)
                    n += 1
            elif f == "stepper.pt":
                st = torch.load(os.path.join(root, f), weights_only=True)
                stack = [st]
                while stack:
                    v = stack.pop()
                    if isinstance(v, dict):
                        stack.extend(v.values())
                    elif isinstance(v, (list, tuple)):
                        stack.extend(v)
                    elif isinstance(v, torch.Tensor) and v.is_floating_point():
                        assert torch.isfinite(v).all(), (root, f)
                        n += 1
    assert n > 0


def previous_good_file(out: str) -> bytes:
    """A file already at the final model's path (from an earlier run): it must survive."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "last.safetensors")
    save_file({"lora_unet_x.alpha": torch.tensor(2.0)}, path)
    return open(path, "rb").read()


def stopped_run(train, tmp_path, extra, at_step, kind, what):
    """Run 4 steps with a fault at ``at_step``: checks the stop, returns (out, state folder)."""
    out = str(tmp_path / "out")
    good = previous_good_file(out)
    with inject(at_step, kind):
        rc, _, err, _ = train("train_lora", [*LORA, *extra, "--train_data_dir", tmp_path / "data",
                                             "--output_dir", out, "--max_train_steps", "4",
                                             "--save_every_n_steps", "1"])
    n = at_step - 1
    state = os.path.join(out, f"last-step{n:08d}-state")
    assert rc == 3, err[-3000:]
    assert_one_error_line(err, f"non-finite {what} at step {at_step}: training stopped before its "
                               f"update; the state after step {n} is in {state}")
    assert open(os.path.join(out, "last.safetensors"), "rb").read() == good
    assert os.path.isdir(state) and json.load(open(os.path.join(state, "state.json")))[
        "global_step"] == n
    assert not os.path.exists(os.path.join(out, f"last-step{at_step:08d}.safetensors"))
    assert_all_finite(out)
    return out, state


def reference(train, tmp_path, extra, steps):
    """The same run without a fault, stopped after ``steps`` steps: its in-memory weights."""
    from library.outputs.train_state import named_trainable

    out = str(tmp_path / f"ref{steps}")
    rc, _, err, run = train("train_lora", [*LORA, *extra, "--train_data_dir", tmp_path / "data",
                                           "--output_dir", out, "--max_train_steps", steps])
    assert rc == 0, err[-3000:]
    return {n: p.detach().clone() for n, p in named_trainable(run.parts.method, run.parts.bundle)}, out


def assert_state_is(state: str, ref: dict):
    w = load_file(os.path.join(state, "trainable.safetensors"))
    assert w.keys() == ref.keys() and w
    for k in w:
        assert torch.equal(w[k], ref[k]), k


@pytest.fixture
def data(tmp_path):
    from tools.make_sample_dataset import make_sample_dataset

    make_sample_dataset(str(tmp_path / "data"), n_images=2, size=64, repeats=2)


def test_nan_loss_stops_keeps_state_and_resumes(data, train, tmp_path):
    _, state = stopped_run(train, tmp_path, [], 3, "nan", "loss NaN")
    ref2, _ = reference(train, tmp_path, [], 2)
    assert_state_is(state, ref2)
    # the state resumes (the fault is gone) and ends where the uninterrupted run ends
    ref4, ref_out = reference(train, tmp_path, [], 4)
    out = str(tmp_path / "resumed")
    rc, _, err, run = train("train_lora", [*LORA, "--train_data_dir", tmp_path / "data",
                                           "--output_dir", out, "--max_train_steps", "4",
                                           "--resume", state])
    assert rc == 0, err[-3000:]
    a, b = read(os.path.join(out, "last.safetensors"))[0], read(os.path.join(ref_out,
                                                                           "last.safetensors"))[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fused_backward_pass_nan_loss_state_from_before(data, train, tmp_path):
    extra = ["--fused_backward_pass"]
    _, state = stopped_run(train, tmp_path, extra, 3, "nan", "loss NaN")
    assert_state_is(state, reference(train, tmp_path, extra, 2)[0])
    # resumed with a lower learning rate: the schedule continues at the new rate, in every one
    # of the per-parameter optimizers
    rc, _, err, run = train("train_lora", [*LORA, *extra, "--train_data_dir", tmp_path / "data",
                                           "--output_dir", tmp_path / "resumed",
                                           "--max_train_steps", "4", "--learning_rate", "5e-4",
                                           "--resume", state])
    assert rc == 0, err[-3000:]
    assert run.progress.lr_log == [1e-3, 1e-3, 5e-4, 5e-4]
    assert {g["lr"] for o in run.parts.stepper.optimizers for g in o.param_groups} == {5e-4}


def test_fused_gradient_non_finite_after_other_steps(data, train, tmp_path):
    """With fused_backward_pass a finite loss whose gradient goes non-finite only for a parameter
    reached late in the backward pass: parameters before it were already stepped, so no state of
    the last good step exists; the run stops saying so, and writes nothing non-finite."""
    from library.run.run_state import HOOKS

    hooked = []

    def before_micro_step(run, epoch, idx):
        if run.progress.global_step + 1 == 2 and not hooked:  # the earliest-created trainable parameter
            hooked.append(run.parts.stepper.params[-1].register_hook(lambda g: g * float("inf")))

    out = str(tmp_path / "out")
    with HOOKS.add(before_micro_step=before_micro_step):
        rc, _, err, _ = train("train_lora", [*LORA, "--fused_backward_pass", "--train_data_dir",
                                             tmp_path / "data", "--output_dir", out,
                                             "--max_train_steps", "3", "--save_every_n_steps", "1"])
    hooked[0].remove()
    assert rc == 3, err[-3000:]
    assert_one_error_line(err, "at step 2: training stopped; parameters had already been updated "
                               "in the backward pass")
    assert "no state was written" in err
    assert sorted(os.listdir(out)) == ["last-step00000001.safetensors"]
    assert_all_finite(out)


def test_learning_rate_that_blows_up(data, train, tmp_path):
    """SGD at lr 1e30: step 1's update is finite but huge, step 2's loss is NaN."""
    extra = ["--optimizer_type", "SGD", "--learning_rate", "1e30"]
    out = str(tmp_path / "out")
    good = previous_good_file(out)
    rc, _, err, _ = train("train_lora", [*LORA, *extra, "--train_data_dir", tmp_path / "data",
                                         "--output_dir", out, "--max_train_steps", "4",
                                         "--save_every_n_steps", "1"])
    assert rc == 3, err[-3000:]
    assert_one_error_line(err, "non-finite loss NaN at step 2: training stopped before its update")
    assert open(os.path.join(out, "last.safetensors"), "rb").read() == good
    assert sorted(os.listdir(out)) == ["last-step00000001-state", "last-step00000001.safetensors",
                                       "last.safetensors"]
    assert_all_finite(out)


def test_nonfinite_weights_are_never_saved(data, train, tmp_path):
    """The check before every save: weights gone NaN without a non-finite loss or gradient
    (here set so after step 2's update) are not written, and the earlier file is kept."""
    from library.training import methods

    out = str(tmp_path / "out")
    good = previous_good_file(out)
    real = methods.NetworkMethod.after_step

    def poison(self, device):
        stats = real(self, device)
        p = next(iter(self.trainable_parameters()))
        with torch.no_grad():
            p.view(-1)[0] = float("inf")
        return stats

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(methods.NetworkMethod, "after_step", poison)
        rc, _, err, _ = train("train_lora", [*LORA, "--train_data_dir", tmp_path / "data",
                                             "--output_dir", out, "--max_train_steps", "1",
                                             "--save_state_on_train_end"])
    assert rc == 3, err[-3000:]
    path = os.path.join(out, "last.safetensors")
    assert_one_error_line(err, f"non-finite weights: tensor network.")
    assert f"holds NaN or inf; {path} was not written (an earlier file of that name is kept)" in err
    assert open(path, "rb").read() == good and sorted(os.listdir(out)) == ["last.safetensors"]


def test_grouped_overflowing_gradient_norm_stops(data, train, tmp_path):
    extra = ["--fused_optimizer_groups", "2", "--max_grad_norm", "1.0"]
    _, state = stopped_run(train, tmp_path, extra, 2, "blow", "gradient norm inf")
    assert_state_is(state, reference(train, tmp_path, extra, 1)[0])


def test_plain_clipping_inf_norm_stops_instead_of_zeroing(data, train, tmp_path):
    # max_grad_norm 1 is the default: clipping by an inf norm would scale the update to zero
    _, state = stopped_run(train, tmp_path, [], 2, "blow", "gradient norm inf")
    assert_state_is(state, reference(train, tmp_path, [], 1)[0])


def test_skip_drops_the_update_and_the_schedule_steps(data, train, tmp_path):
    from library.run.run_state import HOOKS
    from library.outputs.train_state import named_trainable

    before = {}
    def snapshot(run, epoch, idx):  # the weights after step 2, as step 3 starts
        if run.progress.global_step == 2 and not before:
            before.update({n: p.detach().clone() for n, p in named_trainable(run.parts.method, run.parts.bundle)})

    with inject(3, "nan"), HOOKS.add(before_micro_step=snapshot):
        rc, _, err, run = train("train_lora", [*LORA, "--train_data_dir", tmp_path / "data",
                                               "--output_dir", tmp_path / "skip",
                                               "--max_train_steps", "3", "--on_nonfinite", "skip",
                                               "--lr_scheduler", "linear"])
    assert rc == 0, err[-3000:]
    assert "non-finite loss NaN at step 3: update skipped (on_nonfinite skip)" in err
    # the skipped step counts: the scheduler stepped 3 times (linear from 1e-3 to 0 in 3 steps)
    assert run.progress.global_step == 3 and run.parts.stepper.scheduler.last_epoch == 3
    assert run.progress.lr_log == pytest.approx([1e-3, 2e-3 / 3, 1e-3 / 3])
    after = {n: p.detach() for n, p in named_trainable(run.parts.method, run.parts.bundle)}
    assert before.keys() == after.keys() and before
    assert all(torch.equal(before[k], after[k]) for k in after)  # no update in step 3
    saved = read(os.path.join(tmp_path / "skip", "last.safetensors"))[0]
    assert saved and all(torch.isfinite(t).all() for t in saved.values())


def nan_lora_file(path: str) -> str:
    t = torch.zeros(4, 8)
    t[1, 2] = float("nan")
    save_file({"lora_unet_a.lora_down.weight": torch.zeros(4, 8),
               "lora_unet_b.lora_down.weight": t,
               "lora_unet_c.lora_up.weight": torch.full((8, 4), float("inf"))}, path)
    return path


@pytest.mark.parametrize("option", ["network_weights", "base_weights"])
def test_nan_weights_file_refused(data, run_script, tmp_path, no_weight_loading, option):
    f = nan_lora_file(str(tmp_path / "bad.safetensors"))
    rc, _, err = run_script("train_lora", [*LORA, "--train_data_dir", tmp_path / "data",
                                           "--output_dir", tmp_path / "o", "--max_train_steps", "1",
                                           f"--{option}", f])
    assert rc == 2
    assert_one_error_line(err, f"{option}: {f}: tensor lora_unet_b.lora_down.weight holds NaN")


def test_resume_from_nan_weights_refused(data, train, tmp_path):
    _, state = stopped_run(train, tmp_path, [], 2, "nan", "loss NaN")
    f = os.path.join(state, "trainable.safetensors")
    w = load_file(f)
    key = sorted(w)[1]
    w[key] = w[key] * float("nan")
    save_file(w, f)
    rc, _, err, _ = train("train_lora", [*LORA, "--train_data_dir", tmp_path / "data",
                                         "--output_dir", tmp_path / "r", "--max_train_steps", "4",
                                         "--resume", state])
    assert rc == 2
    assert_one_error_line(err, f"resume: {f}: tensor {key} holds NaN")


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--fused_backward_pass"]], ids=["plain", "fused"])
def test_two_processes_stop_at_the_same_step(data, tmp_path, extra):
    """A NaN loss in rank 1 only (step 2): both processes stop in that step, exit code 3, and one
    state of step 1 is written (with fused_backward_pass the loss is agreed before the backward
    whose hooks step, so neither process steps)."""
    import subprocess

    from tests.conftest import two_process_command

    out = str(tmp_path / "out")
    cmd, env = two_process_command(os.path.abspath(__file__), [
        *LORA, *extra, "--train_data_dir", tmp_path / "data", "--output_dir", out,
        "--max_train_steps", "4"], SDTK_TEST_NAN_AT="1:2")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode != 0, p.stderr[-3000:]
    codes = [ln for ln in p.stdout.splitlines() if ln.startswith("rank-exit ")]
    assert sorted(codes) == ["rank-exit 0 3", "rank-exit 1 3"], p.stdout[-2000:] + p.stderr[-3000:]
    assert "non-finite loss NaN at step 2: training stopped before its update" in p.stderr
    assert sorted(os.listdir(out)) == ["last-step00000001-state"]
    assert_all_finite(out)


if __name__ == "__main__":  # one process of the two-process test: NaN loss in one rank
    import sys

    from library.cli import main
    from library.run.run_state import HOOKS

    rank_s, step_s = os.environ["SDTK_TEST_NAN_AT"].split(":")

    def after_micro_step(run, epoch, idx, loss):
        if run.parts.accelerator.process_index == int(rank_s) and \
                run.progress.global_step + 1 == int(step_s):
            loss = loss * float("nan")
        return loss

    held = HOOKS.add(after_micro_step=after_micro_step)  # for the whole process (kept referenced)
    held.__enter__()
    torch.set_num_threads(1)
    rc = main("train_lora", sys.argv[1:])
    print(f"rank-exit {os.environ.get('RANK', '0')} {rc}", flush=True)
    sys.exit(rc)
