"""Validation loss (validation_split): a reproducible number that leaves the training untouched.

- The split is keyed by (validation_seed, image path): independent of the scan order, held-out
  images never train.
- Two runs give the identical validation losses, LoRA and DreamBooth; the number equals a plain
  diffusers recomputation of its definition (fixed timesteps, noise keyed by image and timestep).
- Validating every step changes no trained weight, even with network dropout on (validation runs
  in eval mode inside ``fork_rng``).
- 2 gloo processes (each evaluating half the held-out images) give bit-identical validation
  losses, equal to 1 process x batch 2's (LoRA) or 1 process x batch 1 x accumulation 2's (full
  fine-tune: the same gradient sums, so the same weights bit for bit); one launch each, this file
  is also the worker.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(report_dir: str, argv: list[str]) -> int:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch.distributed as dist

    from library.cli import main
    from tests.conftest import runs_kept

    with runs_kept() as runs:
        rc = main(os.environ.get("SDTK_TEST_SCRIPT", "train_lora"), argv)
    if rc:
        return rc
    r = runs[0]
    with open(os.path.join(report_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"world_size": dist.get_world_size(), "val_log": r.progress.val_log}, f)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2:]))


import pytest  # noqa: E402
import torch  # noqa: E402

from tests.training.test_train_lora_e2e import base_args  # noqa: E402


def lora_args(data, out, *extra):
    return base_args("tiny-sd15", data, str(out), "--validation_split", "0.5",
                     "--train_batch_size", "1", "--seed", "3", *extra)


@pytest.fixture
def four_images(tmp_path):
    from tools.make_sample_dataset import make_sample_dataset

    root = tmp_path / "data4"
    make_sample_dataset(str(root), n_images=4, size=64, repeats=1)
    return str(root)


def test_split_is_keyed_by_seed_and_path():
    from library.data.folders import ImageItem
    from library.data.held_out import ValidationError, split_items

    items = [ImageItem(path=f"/d/{i}.png", caption="", num_repeats=1, is_reg=False,
                       class_tokens=None, size=(64, 64)) for i in range(10)]
    train, val = split_items(items, 0.3, 5, "x")
    assert len(val) == 3 and len(train) == 7 and {id(i) for i in train + val} == {id(i) for i in items}
    assert [i.path for i in train] == [i.path for i in items if i not in val]  # scan order kept
    train2, val2 = split_items(list(reversed(items)), 0.3, 5, "x")
    assert {i.path for i in val2} == {i.path for i in val}
    assert any({i.path for i in split_items(items, 0.3, s, "x")[1]} != {i.path for i in val}
               for s in range(6, 12))
    # keyed by the image's place in its dataset (folder name, path inside it): a moved dataset
    # keeps its split, a renamed concept folder draws anew
    def held_names(root, folder, s=5):
        placed = [ImageItem(path=f"{root}/{folder}/sub/{i}.png", caption="", num_repeats=1, is_reg=False,
                            class_tokens=None, size=(64, 64), image_dir=f"{root}/{folder}") for i in range(10)]
        return [os.path.basename(i.path) for i in split_items(placed, 0.3, s, "x")[1]]

    assert held_names("/data", "1_sks") == held_names("/mnt/other/copy", "1_sks")
    assert any(held_names("/data", "1_sks", s) != held_names("/data", "1_cat", s) for s in range(5, 12))
    assert len(split_items(items, 0.01, 5, "x")[1]) == 1   # at least one held out
    assert len(split_items(items, 0.99, 5, "x")[0]) == 1   # at least one left to train
    with pytest.raises(ValidationError, match="validation_split: x has 1 image"):
        split_items(items[:1], 0.5, 5, "x")


def test_lora_validation_is_reproducible_and_leaves_training_untouched(train, tmp_path):
    from tools.make_sample_dataset import make_sample_dataset

    # 128 px: the tiny U-Net's lowest level is 2x2 (at 64 px it is 1x1, where GroupNorm over two
    # values per group and single-token attention make it ill-conditioned: two float32 orders of the
    # same forward measured 1.7e-5 apart there); lr 1e-2 so that the LoRA and its dropout move the
    # number well above float32 noise (below). highvram: the VAE stays for the reference.
    four_images = str(tmp_path / "data128")
    make_sample_dataset(four_images, n_images=4, size=128, repeats=1)
    common = ["--max_train_steps", "3", "--network_dropout", "0.3", "--network_train_unet_only",
              "--highvram", "--resolution", "128", "--learning_rate", "1e-2"]
    rc, out, err, a = train("train_lora", lora_args(four_images, tmp_path / "a", *common,
                                                    "--validate_every_n_steps", "1"))
    assert rc == 0, err
    held = {it.path for it in a.tset.val_items}
    assert len(held) == 2 and not held & {s.path for s in a.tset.samples}
    assert [s for s, _ in a.progress.val_log] == [1, 2, 3]
    assert "validation loss" in out
    rc, out, err, b = train("train_lora", lora_args(four_images, tmp_path / "b", *common,
                                                    "--validate_every_n_steps", "1"))
    assert rc == 0, err
    assert b.progress.val_log == a.progress.val_log  # bit-identical
    assert len({v for _, v in a.progress.val_log}) == 3  # the weights changed, so did the number
    # the same run without validation (the same split): identical weights
    rc, out, err, c = train("train_lora", lora_args(four_images, tmp_path / "c", *common,
                                                    "--validate_every_n_epochs", "100"))
    assert rc == 0, err
    assert c.progress.val_log == [] and c.progress.loss_log == a.progress.loss_log
    wa, wc = a.parts.method.network.state_dict(), c.parts.method.network.state_dict()
    assert all(torch.equal(wa[k], wc[k]) for k in wa)
    assert a.parts.method.network.training  # back in train mode after validating
    # The run (float32, an image's 4 timesteps in one batch) against the definition in float64:
    # a well-conditioned float32 forward lands a few units of float32 roundoff (6e-8) from the
    # exact value (measured 3e-8). Bound 1e-6: 16 such units, and 80x below what network dropout
    # left on in validation changes (8e-5; the LoRA's whole effect: 2e-2).
    assert a.progress.val_log[-1][1] == pytest.approx(reference_validation_loss(a, seed=3), rel=1e-6)


def reference_validation_loss(run, seed):
    """The validation loss of the run's final weights, recomputed from its definition with plain
    diffusers / transformers calls in float64 (the models cast in place, then back: float32 ->
    float64 -> float32 is exact): mean over held-out images i and timesteps t_k = 125, 375, 625,
    875 of MSE(unet(add_noise(x0, n_ik, t_k), t_k, text(caption_i)), n_ik), n_ik ~ N(0, 1) from
    a generator seeded by derive_seed("val", seed, i, k)."""
    import numpy as np
    from PIL import Image

    from library.data.step_plan import derive_seed

    b = run.parts.bundle
    network = run.parts.method.network
    models = (b.vae, b.text_encoders[0], b.unet, network)
    assert all(p.dtype == torch.float32 for m in models for p in m.parameters())
    network.eval()  # no dropout
    losses = []
    try:
        for m in models:
            m.double()
        with torch.no_grad():
            for i, item in enumerate(run.tset.val_items):
                with Image.open(item.path) as im:
                    arr = np.asarray(im.convert("RGB"), dtype=np.float64) / 127.5 - 1.0
                x0 = b.vae.encode(torch.from_numpy(arr).permute(2, 0, 1)[None]).latent_dist.mean
                x0 = x0 * b.vae.config.scaling_factor
                ids = b.tokenizers[0]([item.caption], padding="max_length", max_length=77,
                                      truncation=True, return_tensors="pt").input_ids
                cond = b.text_encoders[0](ids).last_hidden_state
                for k, t in enumerate((125, 375, 625, 875)):
                    n = torch.randn(x0.shape[1:], generator=torch.Generator().manual_seed(
                        derive_seed("val", seed, i, k)))[None].double()
                    tt = torch.tensor([t])
                    pred = b.unet(b.noise_scheduler.add_noise(x0, n, tt), tt, cond).sample
                    losses.append(float(torch.nn.functional.mse_loss(pred, n)))
    finally:
        for m in models:
            m.float()
        network.train()
    return sum(losses) / len(losses)


def test_dreambooth_validation_is_reproducible(train, four_images, tmp_path):
    def run(out):
        return train("train_dreambooth", [
            "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", four_images,
            "--output_dir", str(out), "--resolution", "64", "--max_train_steps", "2",
            "--learning_rate", "1e-4", "--cache_latents", "--validation_split", "0.25"])

    rc, out, err, a = run(tmp_path / "a")
    assert rc == 0, err
    rc, out, err, b = run(tmp_path / "b")
    assert rc == 0, err
    assert len(a.tset.val_items) == 1 and len(a.progress.val_log) == 1 and a.progress.val_log == b.progress.val_log


def test_validate_every_needs_a_split(run_script, four_images, tmp_path):
    rc, out, err = run_script("train_lora", base_args("tiny-sd15", four_images, str(tmp_path / "o"),
                                                      "--validate_every_n_steps", "2"))
    assert rc == 2 and "validate_every_n_steps needs validation_split" in err


def test_one_and_two_processes_give_the_same_validation_loss(train, four_images, tmp_path):
    from tests.conftest import two_process_command

    # A learning rate so small that the LoRA's output (up, zero-initialised, times down) vanishes
    # in float32 next to the U-Net's activations: the forward passes of 1 and 2 processes are
    # then bit-identical although their summed gradients differ in the last bits, so the test
    # sees the validation alone (which process evaluates which image, noise, reduction).
    args = lora_args(four_images, tmp_path / "two", "--max_train_steps", "2",
                     "--validate_every_n_steps", "1", "--optimizer_type", "SGDNesterov",
                     "--optimizer_args", "momentum=0.9", "--learning_rate", "1e-30")
    report = tmp_path / "report"
    report.mkdir()
    cmd, env = two_process_command(os.path.abspath(__file__), [str(report), *args])
    import subprocess

    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = [json.load(open(report / f"rank{i}.json")) for i in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["val_log"] == ranks[1]["val_log"]
    # 1 process x batch 2 is the same global batch: same weights up to float32 summation order
    one_args = [a if a != "1" or prev != "--train_batch_size" else "2"
                for prev, a in zip([""] + args, args)]
    one_args = [str(tmp_path / "one") if a == str(tmp_path / "two") else a for a in one_args]
    rc, out, err, one = train("train_lora", one_args)
    assert rc == 0, err
    two = [tuple(x) for x in ranks[0]["val_log"]]
    assert [s for s, _ in two] == [s for s, _ in one.progress.val_log] == [1, 2]
    assert one.progress.val_log == two  # bit-identical
    assert any(float(p.abs().max()) > 0 for n, p in one.parts.method.network.named_parameters()
               if "lora_up" in n)  # it did train


def test_full_finetune_two_processes_give_the_validation_loss_of_one(train, four_images, tmp_path):
    """DreamBooth with the text encoder trained, 2 processes x batch 1 vs 1 process x batch 1 x
    accumulation 2: the same global batch summed in the same order, so the weights and therefore
    the validation losses after every step are bit-identical."""
    import subprocess

    from tests.conftest import two_process_command

    def args(out, *extra):
        return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", four_images,
                "--output_dir", str(out), "--resolution", "64", "--max_train_steps", "2",
                "--train_text_encoder", "--optimizer_type", "SGDNesterov", "--learning_rate", "0.05",
                "--validation_split", "0.5", "--validate_every_n_steps", "1", "--seed", "3",
                "--train_batch_size", "1", *extra]

    report = tmp_path / "report"
    report.mkdir()
    cmd, env = two_process_command(os.path.abspath(__file__), [str(report), *args(tmp_path / "two")],
                                   SDTK_TEST_SCRIPT="train_dreambooth")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = [json.load(open(report / f"rank{i}.json")) for i in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    rc, out, err, one = train("train_dreambooth", args(tmp_path / "one", "--gradient_accumulation_steps", "2"))
    assert rc == 0, err
    two = [tuple(x) for x in ranks[0]["val_log"]]
    assert ranks[0]["val_log"] == ranks[1]["val_log"]
    assert [s for s, _ in two] == [1, 2] and one.progress.val_log == two  # bit-identical
    assert two[0][1] != two[1][1]  # the weights moved between the two validations
