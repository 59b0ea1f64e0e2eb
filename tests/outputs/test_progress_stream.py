"""progress_file / control_file (library/outputs/progress_stream.py) on a 3-step tiny run.

The stream's step values are the run's own (loss_log, lr_log), its events in order; save_now and
sample_now from the control file act after the step they are read at; stop writes a resumable
state and exits 130; a file appended to while being read gives each command once.
"""
from __future__ import annotations

import json
import os

from library.outputs import progress_stream
from library.run.run_state import HOOKS

TINY = ["--pretrained_model_name_or_path", "tiny-sd15", "--resolution", "64", "--cache_latents",
        "--network_dim", "4", "--learning_rate", "1e-3", "--max_grad_norm", "1.0", "--seed", "1"]


def events(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_stream_and_control_on_a_three_step_run(train, dataset, tmp_path):
    prog, ctl, out = tmp_path / "p.jsonl", tmp_path / "control", tmp_path / "out"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2\n")

    def after_step(run, loss, lr):  # the UI appends commands while the run trains
        if run.progress.global_step == 1:
            with open(ctl, "a") as f:
                f.write('{"command": "save_now"}\nsample_now\nbogus\n')

    with HOOKS.add(after_step=after_step):
        rc, _, err, run = train("train_lora", [
            "--train_data_dir", dataset, "--output_dir", out, "--max_train_steps", "3",
            "--sample_prompts", prompts, "--progress_file", prog, "--control_file", ctl, *TINY])
    assert rc == 0, err
    ev = events(prog)
    kinds = [e["event"] for e in ev]
    assert kinds[0] == "plan" and kinds[-1] == "end"
    assert ev[0]["total_steps"] == 3 and ev[0]["global_batch"] == 1 and ev[0]["steps_per_epoch"] == 4
    steps = [e for e in ev if e["event"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["loss"] for s in steps] == run.progress.loss_log
    assert [s["lr"] for s in steps] == run.progress.lr_log
    assert all(s["grad_norm"] is not None and s["grad_norm"] > 0 for s in steps)  # max_grad_norm
    assert all(s["epoch"] == 1 for s in steps)
    # appended in step 1's after_step hook: read at step 2's start (the main process reads the
    # file before the step's read, which carries the commands to every process), taken after it
    ctl_ev = [e for e in ev if e["event"] == "control"]
    assert [(e["command"], e["step"]) for e in ctl_ev] == [("save_now", 2), ("sample_now", 2)]
    saves = [e for e in ev if e["event"] == "save"]
    assert saves[0]["step"] == 2 and saves[0]["file"].endswith("last-step00000002.safetensors")
    assert os.path.exists(saves[0]["file"])
    assert saves[-1]["file"].endswith("last.safetensors") and os.path.exists(saves[-1]["file"])
    samples = [e for e in ev if e["event"] == "samples"]
    assert len(samples) == 1 and samples[0]["step"] == 2 and os.path.exists(samples[0]["files"][0])
    assert "ignored line 'bogus'" in err
    assert ev[-1]["status"] == "done" and ev[-1]["exit_code"] == 0


def test_stop_command_writes_a_state_and_exits_130(train, dataset, tmp_path):
    prog, ctl, out = tmp_path / "p.jsonl", tmp_path / "control", tmp_path / "out"
    ctl.write_text("stop\n")  # read at the first step boundary
    rc, _, err, _ = train("train_lora", [
        "--train_data_dir", dataset, "--output_dir", out, "--max_train_steps", "3",
        "--progress_file", prog, "--control_file", ctl, *TINY])
    assert rc == 130, err
    ev = events(prog)
    assert [e["step"] for e in ev if e["event"] == "step"] == [1]
    end = ev[-1]
    assert end["event"] == "end" and end["status"] == "stopped" and end["exit_code"] == 130
    assert end["state"].endswith("last-step00000001-state") and os.path.isdir(end["state"])


def test_control_channel_reads_appended_whole_lines_once(tmp_path):
    path = tmp_path / "c"
    ch = progress_stream.ControlChannel(str(path))
    assert ch.poll() == []  # no file yet
    path.write_bytes(b"save_now\nsam")  # a line still being written
    assert ch.poll() == ["save_now"]
    assert ch.poll() == []
    with open(path, "ab") as f:
        f.write(b'ple_now\n{"command": "stop"}\n')
    assert ch.poll() == ["sample_now", "stop"]
    assert ch.poll() == []
    assert progress_stream.ControlChannel(None).poll() == []


def test_validation_and_nonfinite_events(train, dataset, tmp_path):
    prog, out = tmp_path / "p.jsonl", tmp_path / "out"

    def poison(run, epoch, idx, loss):  # step 2's loss is NaN: skipped (on_nonfinite skip)
        return loss * float("nan") if run.progress.global_step == 1 else loss

    with HOOKS.add(after_micro_step=poison):
        rc, _, err, run = train("train_lora", [
            "--train_data_dir", dataset, "--output_dir", out, "--max_train_steps", "3",
            "--validation_split", "0.5", "--validate_every_n_steps", "2", "--on_nonfinite", "skip",
            "--progress_file", prog, *TINY])
    assert rc == 0, err
    ev = events(prog)
    bad = [e for e in ev if e["event"] == "nonfinite"]
    assert [(e["step"], e["action"]) for e in bad] == [(2, "skip")] and "loss" in bad[0]["what"]
    val = [e for e in ev if e["event"] == "validation"]
    assert [(e["step"], e["loss"]) for e in val] == [tuple(v) for v in run.progress.val_log]
    assert [e["step"] for e in val] == [2, 3]  # every 2 steps, and at the end of epoch 1 (the last step)
