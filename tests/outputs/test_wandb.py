"""wandb logging (log_with = wandb / all), for real: wandb in offline mode (never the network),
its run file read back and compared with the TensorBoard events of the same run and with what
the trainer recorded. Skipped when wandb is not installed (the wandb extra; the test extra has it).
"""
import glob
import json
import os
import struct

import pytest

from tests.outputs.test_tracking import events
from tests.training.test_train_lora_e2e import base_args


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb offline, every folder it writes under tmp_path (wandb reads its environment once
    per process, at its setup: torn down before and after)."""
    wandb = pytest.importorskip("wandb")
    wandb.teardown()
    for name, sub in (("WANDB_DIR", "wandb-default"), ("WANDB_CONFIG_DIR", "wandb-config"),
                      ("WANDB_CACHE_DIR", "wandb-cache"), ("WANDB_DATA_DIR", "wandb-data")):
        os.makedirs(tmp_path / sub, exist_ok=True)
        monkeypatch.setenv(name, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", "unset-by-the-test")  # restored after the test
    yield tmp_path
    wandb.teardown()


def run_file(pattern: str) -> str:
    """The one offline run file matching ``pattern``, complete: ``run.finish()`` returns before
    wandb's service has closed the file (its writer flushes on close), so the service is torn
    down (it exits once its streams are closed) before the file is read."""
    import wandb

    wandb.teardown()
    (path,) = glob.glob(pattern)
    return path


def wandb_records(path):
    """The records of a .wandb file (wandb's LevelDB-style log: a 7-byte header ":W&B", then
    32 KiB blocks of chunks, each with a 7-byte header crc32 | length | type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", raw[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    block, pos, buf = 32768, 7, b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0 and n == 0:  # zero padding up to the block's end
            pos += left
            continue
        data, pos = raw[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 2):
            buf = data
        else:
            buf += data
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            yield r


def wandb_history(path):
    """-> (run record, {step: {key: value}}) of an offline run file."""
    run, rows = None, {}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
        elif kind == "history":
            row = {}
            for item in r.history.item:
                keys = list(item.nested_key) or [item.key]
                row.setdefault(keys[0], {} if len(keys) > 1 else None)
                if len(keys) > 1:
                    row[keys[0]][keys[1]] = json.loads(item.value_json)
                else:
                    row[keys[0]] = json.loads(item.value_json)
            rows.setdefault(r.history.step.num, {}).update(row)
    return run, rows


def test_wandb_logs_the_tensorboard_tags(train, dataset, offline, tmp_path):
    logs = tmp_path / "logs"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 48 --s 2\n")
    key = "k" * 40
    rc, out, err, r = train("train_lora", base_args(
        "tiny-sd15", dataset, str(tmp_path / "out"), "--max_train_steps", "4",
        "--train_batch_size", "1", "--lr_scheduler", "linear", "--unet_lr", "1e-3",
        "--text_encoder_lr", "5e-4", "--logging_dir", str(logs), "--log_with", "all",
        "--log_tracker_name", "myproject", "--wandb_run_name", "run-one", "--wandb_api_key", key,
        "--validation_split", "0.5", "--sample_prompts", str(prompts), "--sample_every_n_epochs", "1"))
    assert rc == 0, err
    assert os.environ["WANDB_API_KEY"] == key  # given to wandb through the environment only
    assert "wandb_api_key" not in r.opts.to_dict()  # and never written with the config
    (run_dir,) = os.listdir(logs)
    wandb_file = run_file(str(logs / run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    run, rows = wandb_history(wandb_file)
    assert (run.project, run.display_name) == ("myproject", "run-one")

    tb = events(str(logs / run_dir))
    assert {"loss/current", "loss/average", "loss/epoch", "loss/validation", "lr/unet",
            "lr/textencoder"} <= set(tb)
    for tag, points in tb.items():  # every TensorBoard scalar, at the same step, in wandb
        for step, value in points:
            assert rows[step][tag] == pytest.approx(value, rel=1e-6), (tag, step)
    logged = {k for row in rows.values() for k in row if not k.startswith("_")}
    assert logged == set(tb) | {"sample/00"}
    # the values the trainer recorded (wandb keeps them in float64)
    assert [rows[s]["loss/current"] for s in range(1, 5)] == pytest.approx(r.progress.loss_log, rel=1e-12)
    # lr_log holds the first group's rate (the text encoder's); the U-Net's is twice it
    assert [rows[s]["lr/textencoder"] for s in range(1, 5)] == pytest.approx(r.progress.lr_log, rel=1e-12)
    assert [rows[s]["lr/unet"] for s in range(1, 5)] == pytest.approx([2 * v for v in r.progress.lr_log], rel=1e-12)
    assert [(s, rows[s]["loss/validation"]) for s in sorted(rows) if "loss/validation" in rows[s]] \
        == [(s, pytest.approx(v, rel=1e-12)) for s, v in r.progress.val_log]
    # the sample images: one per epoch end, as files of the run
    samples = sorted(s for s in rows if "sample/00" in rows[s])
    assert samples == [2, 4]
    for s in samples:
        image = rows[s]["sample/00"]
        assert image["_type"] == "image-file" and (image["width"], image["height"]) == (64, 48)
        assert os.path.isfile(os.path.join(os.path.dirname(wandb_file), "files", image["path"]))


def test_wandb_without_logging_dir_and_tracker_config(train, dataset, offline, tmp_path):
    cfg = tmp_path / "tracker.toml"
    cfg.write_text('[wandb]\nname = "from-config"\ntags = ["a", "b"]\n')
    rc, out, err, r = train("train_lora", base_args(
        "tiny-sd15", dataset, str(tmp_path / "out"), "--log_with", "wandb",
        "--log_tracker_config", str(cfg)))
    assert rc == 0, err
    wandb_file = run_file(str(tmp_path / "wandb-default" / "wandb" / "offline-run-*" / "run-*.wandb"))
    run, rows = wandb_history(wandb_file)
    assert (run.project, run.display_name, list(run.tags)) == ("network_train", "from-config", ["a", "b"])
    assert [rows[s]["loss/current"] for s in (1, 2)] == pytest.approx(r.progress.loss_log, rel=1e-12)
    assert "loss/epoch" not in rows[1] and "loss/epoch" in rows[2]  # the (cut) epoch ends at 2


def test_tracker_option_errors(run_script, dataset, offline, tmp_path):
    args = base_args("tiny-sd15", dataset, str(tmp_path / "out"), "--log_with", "wandb")
    bad = tmp_path / "bad.toml"
    bad.write_text("[wandb\n")
    rc, out, err = run_script("train_lora", [*args, "--log_tracker_config", str(bad)])
    assert rc == 2 and f"log_tracker_config: {bad} is not valid TOML" in err
    bad.write_text('[tensorboard]\nx = 1\n')
    rc, out, err = run_script("train_lora", [*args, "--log_tracker_config", str(bad)])
    assert rc == 2 and "unknown table 'tensorboard'" in err
    rc, out, err = run_script("train_lora", [*args, "--log_tracker_config", str(tmp_path / "none.toml")])
    assert rc == 2 and "log_tracker_config: cannot read" in err
    assert not (tmp_path / "out").exists()
