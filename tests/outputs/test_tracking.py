"""TensorBoard logging: the event files hold the run's loss and learning-rate scalars.

The values are read back with TensorBoard's own EventAccumulator and compared with what the
trainer recorded (``Run.loss_log``, ``Run.lr_log``), so a wrong step, tag or value fails.
"""
import os
import sys

import pytest

from tests.training.test_train_lora_e2e import base_args


def accumulator(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder, size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def events(folder):
    acc = accumulator(folder)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def approx(values, rel=1e-6):
    return pytest.approx(values, rel=rel)


def test_tensorboard_holds_loss_and_lr_scalars(train, dataset, tmp_path):
    logs = tmp_path / "logs"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 48 --s 2\n")
    # 4 samples per epoch, batch 2 -> 2 steps per epoch; 2 epochs; validation at the epoch ends
    rc, out, err, r = train("train_lora", base_args(
        "tiny-sd15", dataset, str(tmp_path / "out"), "--max_train_steps", "4",
        "--train_batch_size", "1", "--gradient_accumulation_steps", "1", "--lr_scheduler", "linear",
        "--unet_lr", "1e-3", "--text_encoder_lr", "5e-4", "--logging_dir", str(logs),
        "--log_prefix", "mylora_", "--validation_split", "0.5", "--sample_prompts",
        str(prompts), "--sample_every_n_epochs", "2"))
    assert rc == 0, err
    runs = os.listdir(logs)
    assert len(runs) == 1 and runs[0].startswith("mylora_") and runs[0][len("mylora_"):].isdigit()
    ev = events(str(logs / runs[0]))
    steps = list(range(1, r.progress.global_step + 1))
    assert r.progress.global_step == 2 * r.plan.steps_per_epoch  # the run really had two epochs
    assert [s for s, _ in ev["loss/current"]] == steps
    assert [v for _, v in ev["loss/current"]] == approx(r.progress.loss_log)
    spe = r.plan.steps_per_epoch
    avg = [sum(r.progress.loss_log[max(0, s - spe):s]) / len(r.progress.loss_log[max(0, s - spe):s]) for s in steps]
    assert [v for _, v in ev["loss/average"]] == approx(avg)
    epoch_means = [sum(r.progress.loss_log[i * spe:(i + 1) * spe]) / spe for i in range(2)]
    assert ev["loss/epoch"] == [(spe, approx(epoch_means[0])), (2 * spe, approx(epoch_means[1]))]
    # the linear schedule decays over 4 steps: each step's rates are the ones it trained with
    factor = [1.0, 0.75, 0.5, 0.25]
    assert [v for _, v in ev["lr/unet"]] == approx([1e-3 * f for f in factor])
    assert [v for _, v in ev["lr/textencoder"]] == approx([5e-4 * f for f in factor])
    assert [v for _, v in ev["lr/textencoder"]] == approx(r.progress.lr_log)  # the first group's, as trained
    assert ev["loss/validation"] == [(s, approx(v)) for s, v in r.progress.val_log]
    assert [s for s, _ in r.progress.val_log] == [spe, 2 * spe]
    # the sample image of the last epoch, as written to output_dir/sample
    import io

    import numpy as np
    from PIL import Image

    (img,) = accumulator(str(logs / runs[0])).Images("sample/00")
    assert img.step == 2 * spe and (img.width, img.height) == (64, 48)
    written = Image.open(tmp_path / "out" / "sample" / f"last_{2 * spe:06d}_00_42.png")
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(img.encoded_image_string))), np.asarray(written))


def test_full_method_groups_are_unet_and_textencoder(train, dataset, tmp_path):
    logs = tmp_path / "logs"
    rc, out, err, r = train("train_dreambooth", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
        "--output_dir", str(tmp_path / "out"), "--resolution", "64", "--max_train_steps", "1",
        "--learning_rate", "1e-4", "--train_text_encoder", "--text_encoder_lr", "2e-5",
        "--cache_latents", "--logging_dir", str(logs)])
    assert rc == 0, err
    (run_dir,) = os.listdir(logs)
    ev = events(str(logs / run_dir))
    assert ev["lr/unet"] == [(1, approx(1e-4))]
    assert ev["lr/textencoder"] == [(1, approx(2e-5))]


def test_logging_errors_are_one_line(run_script, dataset, tmp_path, monkeypatch):
    args = base_args("tiny-sd15", dataset, str(tmp_path / "out"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the wandb extra were not installed
    rc, out, err = run_script("train_lora", [*args, "--log_with", "wandb", "--logging_dir", str(tmp_path)])
    assert rc == 2 and "wandb logging needs the wandb package; install the wandb extra" in err
    rc, out, err = run_script("train_lora", [*args, "--log_with", "all"])
    assert rc == 2 and "log_with = all needs logging_dir" in err
    rc, out, err = run_script("train_lora", [*args, "--log_with", "tensorboard"])
    assert rc == 2 and "log_with = tensorboard needs logging_dir" in err
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if the extra were not installed
    rc, out, err = run_script("train_lora", [*args, "--logging_dir", str(tmp_path / "logs")])
    assert rc == 2 and "install the tensorboard extra" in err
    assert not (tmp_path / "logs").exists() and not (tmp_path / "out").exists()


def test_shipped_configs_pass_the_logging_and_sampling_checks(monkeypatch):
    """The example configs (run from the repository root) name existing prompt files etc."""
    import glob

    from library.outputs import tracking
    from library.config.parse import parse_args

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.chdir(root)
    for path in sorted(glob.glob(os.path.join("configs", "*.toml"))):
        script = open(path).readline().split(":", 1)[1].strip()
        tracking.check_options(parse_args(script, ["--config", path]))
