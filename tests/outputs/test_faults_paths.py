"""Hostile paths end in one line before any weight loads; a save that fails keeps the previous
file and rescues the weights; stale temporaries and locks of killed runs are cleaned up; a second
run on the same outputs is refused (library/outputs/output_checks.py, library/files.py)."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests.config.test_bad_input import one_error_line
from library.errors import ResumeError


def args(data, out, *extra):
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", data,
            "--output_dir", out, "--resolution", "64", "--max_train_steps", "1", *extra]


@pytest.fixture
def previous(tmp_path):
    """An output folder holding a previous run's model file (its bytes, to compare)."""
    out = tmp_path / "out"
    out.mkdir()
    f = out / "last.safetensors"
    f.write_bytes(os.urandom(4096))
    return out, f, f.read_bytes()


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def live_pid():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


@pytest.fixture
def loading_reached(monkeypatch):
    """Loading weights raises Reached: a run that gets there passed every check before it."""
    from library.models import loading as models

    class Reached(Exception):
        pass

    def stop(*a, **k):
        raise Reached()

    monkeypatch.setattr(models, "load_model_bundle", stop)
    return Reached


# -- folders and names ------------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["output_dir", "cache_dir", "logging_dir"])
def test_folder_that_is_a_file(option, dataset, previous, run_script, no_weight_loading):
    out, f, before = previous
    extra = [] if option == "output_dir" else [f"--{option}", str(f)]
    rc, _, err = run_script("train_lora", args(dataset, f if option == "output_dir" else out, *extra))
    assert rc == 2
    line = one_error_line(err)
    assert line == f"error: {option}: {f} is a file, not a folder"
    assert f.read_bytes() == before


@pytest.mark.parametrize("name, dry", [("", False), ("", True), ("sub/last", False)])
def test_output_name_must_be_a_plain_file_name(name, dry, dataset, previous, run_script,
                                               no_weight_loading):
    out, f, before = previous
    rc, _, err = run_script("train_lora", args(dataset, out, "--output_name", name,
                                               *(["--dry_run"] if dry else [])))
    assert rc == 2
    assert one_error_line(err).startswith("error: output_name: ")
    assert sorted(os.listdir(out)) == ["last.safetensors"] and f.read_bytes() == before


def _read_only(folder):
    """Make ``folder`` read-only for this process; returns an undo, or skips."""
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
        return lambda: os.chmod(folder, 0o755)
    # root ignores permissions: a read-only bind mount of the folder onto itself
    if subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount (not permitted here)")
    if subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], capture_output=True).returncode:
        subprocess.run(["umount", str(folder)])
        pytest.skip("cannot remount read-only (not permitted here)")
    return lambda: subprocess.run(["umount", str(folder)], check=True)


def test_read_only_output_dir(dataset, previous, run_script, no_weight_loading):
    out, f, before = previous
    undo = _read_only(out)
    try:
        rc, _, err = run_script("train_lora", args(dataset, out))
    finally:
        undo()
    assert rc == 2
    line = one_error_line(err)
    assert f"output_dir: the folder {out} is not writable" in line
    assert ("Read-only file system" in line) or ("Permission denied" in line)
    assert sorted(os.listdir(out)) == ["last.safetensors"] and f.read_bytes() == before


def test_not_enough_free_space(dataset, previous, run_script, no_weight_loading, monkeypatch):
    from library.outputs import output_checks

    out, f, before = previous
    monkeypatch.setattr(output_checks, "disk_free", lambda path: 300 * 1024)
    rc, _, err = run_script("train_lora", args(dataset, out, "--save_state"))
    assert rc == 2
    line = one_error_line(err)
    assert f"output_dir {out}: not enough free space" in line
    assert "(model 0.5 MiB + state" in line and "0.3 MiB is free" in line
    assert f.read_bytes() == before


def test_quick_bound_covers_the_exact_count(dataset, tmp_path, monkeypatch):
    """The bound from the model's size decides only when space is ample; it is above the exact
    count of the largest save of a tiny model (full fine-tune, EMA, state, Prodigy's moments)."""
    import logging

    from library.training import memory_estimate
    from library.outputs import output_checks
    from library.config.parse import parse_args

    o = parse_args("finetune", [str(a) for a in args(dataset, tmp_path, "--save_state", "--ema_decay",
                                                     "0.999", "--optimizer_type", "Prodigy")])
    exact, _ = output_checks.save_bytes(o, "finetune")
    assert exact < output_checks.quick_upper_bound(o)

    def no_count(*a):
        raise AssertionError("the exact count ran although the space is ample")

    monkeypatch.setattr(memory_estimate, "saved_parameters", no_count)
    monkeypatch.setattr(output_checks, "disk_free", lambda p: output_checks.quick_upper_bound(o) + 1)
    output_checks.check_free_space(o, "finetune", logging.getLogger("test"))


# -- a save that fails ------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    folder = tmp_path / "disk"
    folder.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs ({r.stderr.strip() or 'not root'})")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_disk_filled_during_training(dataset, small_disk, run_script, monkeypatch):
    """The free-space check passes; something else fills the disk while the run trains: the save
    ends in one line naming the file and the OS error, the previous file is intact, no
    temporary is left, and the weights are in the system temp dir, where the line says."""
    from safetensors.torch import load_file

    from library.outputs import output_checks
    from library.run import stages

    out = small_disk / "out"
    out.mkdir()
    prev = out / "last.safetensors"
    prev.write_bytes(os.urandom(8192))
    before = prev.read_bytes()
    real_train = stages.Run.train

    def train_then_fill(self):
        real_train(self)
        with open(small_disk / "filler", "wb") as fh:  # another program takes the disk
            try:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            except OSError:
                pass

    monkeypatch.setattr(stages.Run, "train", train_then_fill)
    rc, _, err = run_script("train_lora", args(dataset, out))
    assert rc == 2
    line = one_error_line(err)
    assert line.startswith(f"error: cannot save {prev}: No space left on device; ")
    assert prev.read_bytes() == before
    assert sorted(os.listdir(out)) == ["last.safetensors"]  # no temporary, the lock released
    rescue = line.split("the weights were written to ")[1].split(" instead")[0]
    assert rescue.startswith(tempfile.gettempdir()) and rescue.endswith("last.safetensors")
    weights = load_file(rescue)
    assert any(k.startswith("lora_unet_") and k.endswith(".lora_up.weight") for k in weights)
    # the free-space estimate against the file the run wrote: at least its size, at most 1 MiB
    # (the allowance for headers and metadata) and 5% more
    from library.config.parse import parse_args

    need, _ = output_checks.save_bytes(parse_args("train_lora", [str(a) for a in args(dataset, out)]),
                                       "lora")
    size = os.path.getsize(rescue)
    assert size <= need <= size * 1.05 + 1024 * 1024
    os.remove(rescue)
    os.rmdir(os.path.dirname(rescue))


# -- stale temporaries and locks ------------------------------------------------------------------
def test_stale_temporaries_are_removed(dataset, previous, run_script, loading_reached, live_pid):
    out, f, before = previous
    gone = dead_pid()
    stale_file = out / f".last.safetensors.sdtk{gone}.k2j3h4.tmp"
    stale_file.write_bytes(b"partial")
    stale_dir = out / f".last-state.sdtk{gone}.a8b7c6.tmp"
    stale_dir.mkdir()
    (stale_dir / "stepper.pt").write_bytes(b"partial")
    live = out / f".last.safetensors.sdtk{live_pid}.x1y2z3.tmp"
    live.write_bytes(b"being written")
    other = out / ".notes.tmp"  # not our naming: never touched
    other.write_bytes(b"user file")
    with pytest.raises(loading_reached):
        run_script("train_lora", args(dataset, out))
    assert not stale_file.exists() and not stale_dir.exists()
    assert live.exists() and other.exists() and f.read_bytes() == before
    assert not (out / ".last.lock").exists()  # released when the run ended


def test_stale_temporaries_message(tmp_path):
    import logging

    from library import files

    gone = dead_pid()
    (tmp_path / f".a.safetensors.sdtk{gone}.q.tmp").write_bytes(b"x")
    (tmp_path / f".a-state.sdtk{gone}.r.old").mkdir()
    records = []
    log = logging.getLogger("test_stale")
    log.addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: records.append(r.getMessage())})())
    log.setLevel(logging.INFO)
    removed = files.remove_stale_temporaries(str(tmp_path), log)
    assert sorted(removed) == [f".a-state.sdtk{gone}.r.old", f".a.safetensors.sdtk{gone}.q.tmp"]
    assert records == [f"removed 2 stale temporary file(s) of killed runs in {tmp_path}: "
                       f".a-state.sdtk{gone}.r.old, .a.safetensors.sdtk{gone}.q.tmp"]
    assert os.listdir(tmp_path) == []


def test_atomic_temporaries_carry_the_pid(tmp_path):
    from library.files import TEMP_PATTERN, atomic_dir, atomic_path

    with atomic_path(str(tmp_path / "m.safetensors")) as tmp:
        m = TEMP_PATTERN.match(os.path.basename(tmp))
        assert m and int(m.group("pid")) == os.getpid()
        open(tmp, "wb").close()
    with atomic_dir(str(tmp_path / "s-state")) as tmp:
        assert int(TEMP_PATTERN.match(os.path.basename(tmp)).group("pid")) == os.getpid()


def _lock(out, pid):
    import socket

    (out / ".last.lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                                "started": 0}))


def test_second_run_is_refused(dataset, previous, run_script, no_weight_loading, live_pid):
    out, f, before = previous
    _lock(out, live_pid)
    rc, _, err = run_script("train_lora", args(dataset, out))
    assert rc == 2
    line = one_error_line(err)
    assert f"last is being written by another run, process {live_pid}" in line
    assert json.loads((out / ".last.lock").read_text())["pid"] == live_pid  # not taken
    assert f.read_bytes() == before


def test_lock_of_a_dead_run_is_taken_over(dataset, previous, run_script, loading_reached,
                                          monkeypatch, capsys):
    from library.run import stages

    out, f, _ = previous
    gone = dead_pid()
    _lock(out, gone)
    seen = {}
    real = stages._train

    def spy(r, *a):
        seen["lock"] = json.loads((out / ".last.lock").read_text())
        return real(r, *a)

    monkeypatch.setattr(stages, "_train", spy)
    with pytest.raises(loading_reached):
        run_script("train_lora", args(dataset, out))
    err = capsys.readouterr().err
    assert f"output lock {out / '.last.lock'} of process {gone}, which no longer runs: taken over" in err
    assert seen["lock"]["pid"] == os.getpid()  # held by this run while it ran
    assert not (out / ".last.lock").exists()  # and released


def test_other_ranks_do_not_take_the_lock(dataset, previous, run_script, loading_reached,
                                          live_pid, monkeypatch):
    out, _, _ = previous
    _lock(out, live_pid)  # the main process's lock
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(loading_reached):  # not refused: went on to load
        run_script("train_lora", args(dataset, out))
    assert json.loads((out / ".last.lock").read_text())["pid"] == live_pid


# -- one line for user errors -----------------------------------------------------------------------
def test_non_utf8_run_and_dataset_toml(dataset, tmp_path, run_script, no_weight_loading):
    run_toml = tmp_path / "run.toml"
    run_toml.write_bytes(b"learning_rate = 1e-4\n# caf\xe9\n")
    rc, _, err = run_script("train_lora", args(dataset, tmp_path / "o", "--config", run_toml))
    assert rc == 2
    assert one_error_line(err) == (f"error: {run_toml}: line 2: not UTF-8 text (byte 0xe9 at "
                                   "column 6); save the file as UTF-8")
    ds = tmp_path / "ds.toml"
    ds.write_bytes(b"[general]\n[[datasets]]\nresolution = 64\n\n  name = '\xff'\n")
    rc, _, err = run_script("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15",
                                           "--dataset_config", ds, "--output_dir", tmp_path / "o",
                                           "--max_train_steps", "1"])
    assert rc == 2
    assert one_error_line(err).startswith(f"error: {ds}: line 5: not UTF-8 text (byte 0xff at column 11)")


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_broken_symlink_in_a_diffusers_folder(kind, dataset, tmp_path, run_script, no_weight_loading):
    model = tmp_path / "model"  # as a cleaned hub cache leaves a snapshot: links to removed blobs
    (model / "unet").mkdir(parents=True)
    (model / "model_index.json").write_text("{}")
    link = model / "unet" / "diffusion_pytorch_model.safetensors"
    if kind == "dangling":
        os.symlink(tmp_path / "blobs" / "0123abcd", link)
        what = f"a broken symlink (its target {tmp_path / 'blobs' / '0123abcd'} does not exist)"
    else:
        os.symlink(link, link)
        what = "a symlink loop"
    a = args(dataset, tmp_path / "o")
    a[1] = str(model)
    rc, _, err = run_script("train_lora", a)
    assert rc == 2
    assert one_error_line(err) == f"error: pretrained_model_name_or_path: {link} is {what}"


def test_broken_symlinks_in_the_data_folder_are_named(dataset, tmp_path, run_script):
    folder = os.path.join(dataset, "2_sks shape")
    os.symlink(tmp_path / "gone.png", os.path.join(folder, "dangling.png"))
    os.symlink("loop_b.png", os.path.join(folder, "loop_a.png"))
    os.symlink("loop_a.png", os.path.join(folder, "loop_b.png"))
    rc, out, err = run_script("train_lora", args(dataset, tmp_path / "o", "--dry_run"))
    assert rc == 0, err
    assert (f"skipping {os.path.join(folder, 'dangling.png')}: a broken symlink (its target "
            f"{tmp_path / 'gone.png'} does not exist)") in err
    assert f"skipping {os.path.join(folder, 'loop_a.png')}: a symlink loop" in err
    assert "images: 2" in out and "Traceback" not in err


@pytest.mark.parametrize("content, flags, message", [
    (b"just some text, not a checkpoint", ["--allow_pickle"],
     "not a checkpoint (neither .safetensors nor a torch save file)"),
    ("object", [], "holds pickled objects other than tensors"),
])
def test_bad_checkpoint_files(content, flags, message, dataset, tmp_path, run_script):
    import datetime

    import torch

    ckpt = tmp_path / "model.ckpt"
    if content == "object":
        torch.save({"state_dict": {}, "when": datetime.date(2020, 1, 1)}, ckpt)
    else:
        ckpt.write_bytes(content)
    a = args(dataset, tmp_path / "o", *flags)
    a[1] = str(ckpt)
    rc, _, err = run_script("train_lora", a)
    assert rc == 2
    assert one_error_line(err).startswith(f"error: {ckpt}: {message}")


def _fabricated_state(folder, step):
    """A state folder written by hand: the files and formats read_info checks."""
    import torch
    from safetensors.torch import save_file

    from library.outputs import train_state

    folder.mkdir()
    save_file({"w": torch.zeros(1000)}, str(folder / train_state.WEIGHTS_FILE))
    torch.save({"m": torch.zeros(1000)}, folder / train_state.STEPPER_FILE)
    torch.save({"processes": 1, "ranks": []}, folder / train_state.RNG_FILE)
    (folder / train_state.INFO_FILE).write_text(json.dumps(
        {"version": train_state.STATE_VERSION, "global_step": step}))
    return folder


@pytest.mark.parametrize("damage, message", [
    ("trainable.safetensors", "trainable.safetensors is truncated ({half} bytes, its header describes {size})"),
    ("stepper.pt", "stepper.pt is truncated or not a torch save file"),
    ("rng.pt", "rng.pt is missing"),
    ("state.json", "state.json cannot be read"),
])
def test_damaged_state_is_named_and_latest_falls_back(damage, message, tmp_path, caplog):
    import logging

    from library.outputs import train_state

    old = _fabricated_state(tmp_path / "last-step00000001-state", 1)
    os.utime(old / train_state.INFO_FILE, (1, 1))
    new = _fabricated_state(tmp_path / "last-step00000002-state", 2)
    f = new / damage
    if damage == "rng.pt":
        f.unlink()
    elif damage == "state.json":
        f.write_text('{"version": 1, "glob')
    else:
        size = os.path.getsize(f)
        os.truncate(f, size // 2)
        message = message.format(half=size // 2, size=size)
    with pytest.raises(ResumeError) as e:
        train_state.read_info(str(new))
    assert str(e.value).startswith(f"resume: {new} is damaged: {message}")
    assert "\n" not in str(e.value)
    log = logging.getLogger("test_damaged")
    with caplog.at_level(logging.WARNING, logger="test_damaged"):
        assert train_state.resolve("latest", str(tmp_path), log) == str(old)
    assert [r.getMessage() for r in caplog.records] == [
        f"{e.value}; resume latest uses the previous state {old}"]


def test_resume_of_a_damaged_state_is_one_line(dataset, tmp_path, run_script, no_weight_loading):
    state = _fabricated_state(tmp_path / "last-state", 1)
    os.truncate(state / "stepper.pt", 100)
    rc, _, err = run_script("train_lora", args(dataset, tmp_path / "o", "--resume", state))
    assert rc == 2
    assert one_error_line(err).startswith(f"error: resume: {state} is damaged: stepper.pt is truncated")
