"""The input pipeline of runs without cached latents (library/data/training_data.py ImageLoader):
images decoded and augmented in DataLoader workers give the same weights as in the training
process, because every augmentation draw is keyed to (seed, epoch, sample), not to the process
that prepares it; persistent workers prepare the second epoch's draws, not the first's again."""
import pytest
import torch

from tests.conftest import read


def test_default_workers_follow_the_device():
    from library.data.training_data import loader_workers

    assert loader_workers(None, "cpu", 1) == 0  # the training's kernels own the cores
    assert loader_workers(3, "cpu", 1) == 3  # an explicit max_data_loader_n_workers wins
    assert loader_workers(0, "cuda", 1) == 0
    import os

    cores = os.cpu_count() or 1
    assert loader_workers(None, "cuda", 1) == max(1, min(8, cores))
    assert loader_workers(None, "cuda", cores) == 1  # a share of the cores per process, at least 1


def test_two_persistent_workers_train_the_same_weights_as_none(dataset, tmp_path, run_script):
    """Two epochs with flip_aug and color_aug (draws per sample and epoch), uncached latents:
    0 workers against 2 persistent workers (forced on the CPU), bit for bit (one thread)."""
    args = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
            "--resolution", "64", "--max_train_epochs", "2", "--train_batch_size", "4",
            "--network_dim", "4", "--network_train_unet_only", "--flip_aug", "--color_aug",
            "--optimizer_type", "torch.optim.SGD", "--learning_rate", "0.5", "--seed", "3"]
    out = {}
    for n, extra in (("0", []), ("2", ["--persistent_data_loader_workers"])):
        rc, stdout, err = run_script("train_lora", args + ["--output_dir", tmp_path / n,
                                                           "--max_data_loader_n_workers", n, *extra])
        assert rc == 0, err
        assert "total_steps: 2" in stdout
        out[n], _ = read(str(tmp_path / n / "last.safetensors"))
    assert out["0"].keys() == out["2"].keys()
    moved = 0
    for k, a in out["0"].items():
        assert torch.equal(a, out["2"][k]), k
        moved += k.endswith("lora_up.weight") and bool(a.abs().sum() > 0)
    assert moved > 0  # the runs trained (up weights start at zero)


def test_the_draws_differ_between_epochs(dataset):
    """What the persistent-worker test relies on: with flip_aug and color_aug the same sample's
    pixels differ between epochs for some sample (else two epochs would not tell a worker that
    reuses the first epoch's draws from a correct one)."""
    from library.config.parse import parse_args
    from library.data.training_data import ImageLoader, build_training_set

    import logging

    opts = parse_args("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15",
                                     "--train_data_dir", dataset, "--resolution", "64",
                                     "--output_dir", "x", "--flip_aug", "--color_aug",
                                     "--max_train_steps", "1"])
    tset = build_training_set(opts, logging.getLogger("test"))
    loader = ImageLoader(tset, workers=0, persistent=False, pin=False)
    n = len(tset.samples)
    e1 = [b.pixels for b in loader.epoch(1, [[i] for i in range(n)])]
    e2 = [b.pixels for b in loader.epoch(2, [[i] for i in range(n)])]
    assert any(not torch.equal(a, b) for a, b in zip(e1, e2))
    again = loader.load(1, [0]).pixels
    assert torch.equal(again, e1[0])  # keyed: the same key prepares the same pixels
