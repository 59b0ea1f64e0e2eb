"""Frozen parts leave memory after caching (library/training/offload.py), and nothing a run computes or
writes changes: the same model file, samples and validation losses as with ``highvram`` (which
keeps them), and the parts come back bit for bit when a sample or save needs them."""
import os

import pytest

from tests.conftest import read


def test_spill_round_trip_is_exact_and_frees_the_memory():
    """Every tensor (bf16 and float32 parameters, a non-persistent buffer, a shared tensor) comes
    back bit for bit from the spill file; in between the module holds no memory and the process's
    resident set drops by about its size."""
    import torch

    from library.training import offload as frozen
    from library.training import host_memory

    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])  # 96 MiB
    m[0].to(torch.bfloat16)
    m.register_buffer("ids", torch.arange(77), persistent=False)
    m[3].weight = m[2].weight  # shared
    before = {n: t.detach().clone() for n, t in frozen._tensors(m).items()}
    part = frozen.Part("vae", "test module", [m])
    f = frozen.Frozen(torch.device("cpu"), keep_on_device=False)
    rss = host_memory.resident_bytes()
    f.release([part], needed_later=True)
    assert all(t.device.type == "meta" for t in frozen._tensors(m).values())
    freed = rss - host_memory.resident_bytes()
    assert freed > 0.8 * part.bytes, (freed, part.bytes)
    with f.available():
        after = frozen._tensors(m)
        assert after.keys() == before.keys()
        for n, t in before.items():
            assert after[n].dtype == t.dtype and torch.equal(after[n], t), n
        assert m[3].weight is m[2].weight
        x = torch.randn(2, 1024)
        m[1](x)  # usable
    assert all(t.device.type == "meta" for t in frozen._tensors(m).values())
    spill = os.path.dirname(part.spills[0])
    assert os.path.isdir(spill)
    f.close()
    assert not os.path.exists(spill)


def test_freed_for_good_without_a_later_use():
    import torch

    from library.training import offload as frozen

    m = torch.nn.Linear(8, 8)
    f = frozen.Frozen(torch.device("cpu"), keep_on_device=False)
    part = frozen.Part("vae", "VAE", [m])
    f.release([part], needed_later=False)
    assert part.spills is None and m.weight.device.type == "meta"
    with pytest.raises(RuntimeError, match="needed again"):
        with f.available():
            pass


def _args(data, out, prompts, *extra):
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", data,
            "--output_dir", out, "--resolution", "64", "--max_train_steps", "3", "--seed", "3",
            "--cache_latents", "--cache_text_encoder_outputs", "--sample_prompts", prompts,
            "--sample_every_n_steps", "2", "--validation_split", "0.34",
            "--validate_every_n_steps", "2", *extra]


@pytest.fixture
def data3(tmp_path):
    from tools.make_sample_dataset import make_sample_dataset

    root = tmp_path / "data"
    make_sample_dataset(str(root), n_images=3, size=64, repeats=1)
    return str(root)


def test_full_finetune_releases_and_writes_the_same_model_samples_and_validation(train, data3, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square --d 5 --s 2 --w 64 --h 64\n")
    runs = {}
    for name, extra in (("released", []), ("kept", ["--highvram"])):
        out = str(tmp_path / name)
        rc, _, err, r = train("train_dreambooth", _args(data3, out, str(prompts), *extra))
        assert rc == 0, err[-3000:]
        runs[name] = (out, err, r)
    out, err, r = runs["released"]
    assert "after caching: VAE (" in err and "text encoder (" in err and "freed (kept in a spill file" in err
    assert "resident memory" in err
    # after the run the released parts hold no memory (the spill file is gone)
    assert r.parts.bundle.vae.encoder.conv_in.weight.device.type == "meta"
    assert next(r.parts.bundle.text_encoders[0].parameters()).device.type == "meta"
    assert r.parts.frozen._tmp is None
    kout, kerr, k = runs["kept"]
    assert "after caching" not in kerr
    assert next(k.parts.bundle.vae.parameters()).device.type == "cpu"
    # the saved model (with its VAE and text encoder, read back from the spill file) is identical
    a, _ = read(os.path.join(out, "last.safetensors"))
    b, _ = read(os.path.join(kout, "last.safetensors"))
    assert a.keys() == b.keys() and any(key.startswith("first_stage_model.") for key in a)
    assert all((a[key] == b[key]).all() for key in a)
    # samples (VAE and text encoder back for them) and validation losses (cached) are the same
    s = sorted(os.listdir(os.path.join(out, "sample")))
    assert s and s == sorted(os.listdir(os.path.join(kout, "sample")))
    for f in s:
        with open(os.path.join(out, "sample", f), "rb") as x, open(os.path.join(kout, "sample", f), "rb") as y:
            assert x.read() == y.read(), f
    assert r.progress.val_log and r.progress.val_log == k.progress.val_log
    assert r.progress.loss_log == k.progress.loss_log


def test_lora_without_samples_frees_the_vae_for_good(train, data3, tmp_path):
    rc, _, err, r = train("train_lora", [
        "--pretrained_model_name_or_path", "tiny-sdxl", "--train_data_dir", data3,
        "--output_dir", str(tmp_path / "out"), "--resolution", "64", "--max_train_steps", "1",
        "--cache_latents"])
    assert rc == 0, err[-3000:]
    assert "after caching: VAE (" in err and "text encoder" not in err.split("after caching")[1].splitlines()[0]
    part = r.parts.frozen.parts["vae"]
    assert part.spills is None and next(r.parts.bundle.vae.parameters()).device.type == "meta"
    assert next(r.parts.bundle.text_encoders[1].parameters()).device.type == "cpu"  # not cached: stays
