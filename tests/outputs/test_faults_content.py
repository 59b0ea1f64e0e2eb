"""Resume that notices content (library/outputs/content_hash.py): a state records the sha256 of every
model weights file and image; replacing weights with others of the same size, or editing an
image without changing its byte size, is refused naming the file; unchanged content resumes
bit-identically; a state written before content hashes resumes with a warning."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
from PIL import Image

from tests.conftest import read
from tests.outputs.test_faults_paths import small_disk  # noqa: F401 - a fixture (a 2 MiB tmpfs)
from library.errors import ResumeError


@pytest.fixture(scope="module")
def folder_model(tmp_path_factory):
    from library.models import sd_checkpoint
    from library.models.families.sd_common.tiny_models import build_tiny_components

    out = str(tmp_path_factory.mktemp("model") / "tiny15")
    sd_checkpoint.save_diffusers(build_tiny_components("sd15"), "sd1", out)
    return out


def _uncompressed_pngs(root: str) -> list[str]:
    """Rewrite the dataset's PNGs without compression: a pixel edit then keeps the byte size."""
    out = []
    for dp, _, fs in os.walk(root):
        for f in sorted(fs):
            if f.endswith(".png"):
                p = os.path.join(dp, f)
                Image.open(p).convert("RGB").save(p, compress_level=0)
                out.append(p)
    return out


@pytest.fixture(scope="module")
def saved(folder_model, tmp_path_factory, monkeypatch_module):
    """A 3-step run from a diffusers folder, saving a state after step 2."""
    from tests.outputs.test_resume import train
    from tools.make_sample_dataset import make_sample_dataset

    base = tmp_path_factory.mktemp("content")
    monkeypatch_module.setenv("SDTK_HASH_CACHE", str(base / "hashes.json"))
    data = str(base / "data")
    make_sample_dataset(data, n_images=2, size=64, repeats=1)
    images = _uncompressed_pngs(data)
    args = ["--pretrained_model_name_or_path", folder_model, "--train_data_dir", data,
            "--resolution", "64", "--network_dim", "4", "--learning_rate", "1e-3", "--seed", "5",
            "--output_name", "last", "--cache_latents", "--ema_decay", "0.9"]
    out = str(base / "a")
    rc, err, run = train("train_lora", [*args, "--output_dir", out, "--max_train_steps", "3",
                                        "--save_state", "--save_every_n_steps", "2"])
    assert rc == 0, err[-2000:]
    return {"run": run, "args": args, "out": out, "state": os.path.join(out, "last-step00000002-state"),
            "full": os.path.join(out, "last.safetensors"), "images": images,
            "hashes": str(base / "hashes.json")}


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _resume(saved, out):
    from tests.outputs.test_resume import train

    return train("train_lora", [*saved["args"], "--output_dir", str(out), "--max_train_steps",
                                "3", "--resume", saved["state"]])


def test_state_records_the_content(saved, folder_model):
    info = json.load(open(os.path.join(saved["state"], "state.json")))
    content = {(r, p): h for r, p, h in info["content"]}
    unet = os.path.join(folder_model, "unet", "diffusion_pytorch_model.safetensors")
    assert content[("model", unet)] == hashlib.sha256(open(unet, "rb").read()).hexdigest()
    img = saved["images"][0]
    assert content[("image", img)] == hashlib.sha256(open(img, "rb").read()).hexdigest()
    # the model digests are remembered in the hash cache file, keyed by path, size and mtime
    store = json.load(open(saved["hashes"]))
    assert store[os.path.realpath(unet)]["sha256"] == content[("model", unet)]


def test_replaced_model_weights_of_the_same_size_are_refused(saved, folder_model, tmp_path):
    unet = os.path.join(folder_model, "unet", "diffusion_pytorch_model.safetensors")
    keep = unet + ".orig"
    shutil.copy2(unet, keep)
    try:
        with open(unet, "r+b") as f:  # other weights, same header: the lowest byte of a float32
            n = int.from_bytes(f.read(8), "little")
            f.seek(8 + n)
            b = f.read(1)
            f.seek(8 + n)
            f.write(bytes([b[0] ^ 0xFF]))
        assert os.path.getsize(unet) == os.path.getsize(keep)
        rc, err, run = _resume(saved, tmp_path)
    finally:
        os.replace(keep, unet)
    assert rc == 2 and run is None and "Traceback" not in err, err[-2000:]
    line = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and f"content of model weights file {unet} changed" in line[0], err[-2000:]


def test_edited_image_of_the_same_size_is_refused(saved, tmp_path):
    img = saved["images"][0]
    before = open(img, "rb").read()
    try:
        px = Image.open(img).convert("RGB")
        px.putpixel((3, 3), tuple(255 - c for c in px.getpixel((3, 3))))
        px.save(img, compress_level=0)
        assert os.path.getsize(img) == len(before) and open(img, "rb").read() != before
        rc, err, run = _resume(saved, tmp_path)
    finally:
        open(img, "wb").write(before)
    assert rc == 2 and run is None and "Traceback" not in err, err[-2000:]
    assert f"error: resume: the content of image {img} changed" in err, err[-2000:]


def test_unchanged_content_resumes_bit_identically(saved, tmp_path):
    rc, err, run = _resume(saved, tmp_path)
    assert rc == 0, err[-2000:]
    a = read(str(tmp_path / "last.safetensors"))[0]
    b = read(saved["full"])[0]
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _lora_run_resuming(saved, tmp_path, name: str, edit):
    """The planned options, training set and plan of a train_lora run (no weights) resuming a copy
    of the saved state whose state.json ``edit(info)`` changed, for the resume check
    (train_state.check_resume) a run makes before loading."""
    from library.config import parse as config
    from library.training.plan import plan_run

    state = str(tmp_path / name)
    shutil.copytree(saved["state"], state)
    info = json.load(open(os.path.join(state, "state.json")))
    edit(info)
    json.dump(info, open(os.path.join(state, "state.json"), "w"))
    opts = config.parse_args("train_lora", [*saved["args"], "--output_dir", str(tmp_path),
                                            "--max_train_steps", "3", "--resume", state])
    return plan_run(opts, 1)


def test_state_without_content_hashes_resumes_with_a_warning(saved, tmp_path, caplog):
    """A state written before this check (no "content" in state.json) is still accepted."""
    from library.log import logger
    from library.outputs import train_state

    opts, tset, plan = _lora_run_resuming(saved, tmp_path, "old-state",
                                          lambda info: info.pop("content"))
    with caplog.at_level("WARNING", logger="sdtk"):
        # the resume check of a run, before weights load
        path, got = train_state.check_resume(opts, "lora", plan, tset, logger)
    assert path == str(tmp_path / "old-state") and got["global_step"] == 2
    assert "content of the model weights and images could not be checked" in caplog.text


def test_model_hash_is_remembered_by_path_size_and_mtime(tmp_path, monkeypatch):
    from library.outputs import content_hash

    monkeypatch.setenv("SDTK_HASH_CACHE", str(tmp_path / "h.json"))
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 1000)
    want = hashlib.sha256(b"a" * 1000).hexdigest()
    with content_hash.forgotten():
        assert content_hash.sha256_file(str(f)) == want
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    with content_hash.forgotten():  # a new process: the cache file answers, nothing is read
        assert content_hash.sha256_file(str(f)) == want and not calls
        st = os.stat(f)
        f.write_bytes(b"b" * 1000)  # rewritten, same size, another mtime: hashed again
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
        assert content_hash.sha256_file(str(f)) == real(b"b" * 1000).hexdigest() and calls


# -- a state or EMA save that fails ------------------------------------------------------------------
def _fill(folder) -> None:
    with open(os.path.join(folder, "filler"), "wb") as fh:  # another program takes the disk
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass


def _rescued(message: str, what: str, name: str) -> str:
    import tempfile

    assert "\n" not in message and message.count(f"{what} written to ") == 1, message
    rescue = message.split(f"{what} written to ")[1].split(" instead")[0]
    assert rescue.startswith(tempfile.gettempdir()) and os.path.basename(rescue) == name
    return rescue


def test_state_and_ema_saves_on_a_full_disk_are_rescued(saved, small_disk, monkeypatch):
    """As the model file: one line naming the file and the OS error, the previous state / EMA
    file intact, no temporary left, and a complete copy in the system temp dir, named."""
    from safetensors.torch import load_file

    from library.files import SaveError
    from library.outputs import train_state

    run = saved["run"]
    out = small_disk / "out"
    prev_state = out / "last-state"
    prev_state.mkdir(parents=True)
    (prev_state / "state.json").write_text("{}")
    prev_ema = out / "last-ema.safetensors"
    prev_ema.write_bytes(b"previous")
    _fill(small_disk)
    monkeypatch.setattr(run.saver, "opts", run.opts.replace(output_dir=str(out)))
    monkeypatch.setattr(run.saver, "output_dir", str(out))  # the Saver keeps it beside its options

    with pytest.raises(SaveError) as e:
        run.saver.write_state(run.progress, str(prev_state))
    msg = str(e.value)
    assert msg.startswith(f"cannot save {prev_state}: No space left on device; "), msg
    rescue = _rescued(msg, "the training state was", "last-state")
    assert msg.count(f"--resume {rescue}") == 1
    assert train_state.read_info(rescue)["global_step"] == run.progress.global_step  # complete
    shutil.rmtree(os.path.dirname(rescue))

    with pytest.raises(SaveError) as e:
        run.saver.save_ema(metadata={})
    msg = str(e.value)
    assert msg.startswith(f"cannot save {prev_ema}: No space left on device; "), msg
    rescue = _rescued(msg, "the EMA weights were", "last-ema.safetensors")
    w = load_file(rescue)
    ema = dict(zip([n for n, _ in train_state.named_trainable(run.parts.method, run.parts.bundle)], run.parts.ema.shadow))
    assert any(k.endswith(".lora_up.weight") for k in w)
    assert len([k for k in w if not k.endswith(".alpha")]) == len(ema)  # every trained tensor
    shutil.rmtree(os.path.dirname(rescue))

    assert sorted(os.listdir(out)) == ["last-ema.safetensors", "last-state"]  # no temporaries
    assert prev_ema.read_bytes() == b"previous" and os.listdir(prev_state) == ["state.json"]


def test_damaged_content_record_is_named(saved, tmp_path):
    from library.outputs import content_hash
    from library.errors import ResumeError

    for bad in ({"a": 1}, [["model", "x"]], [["weights", "p", "h"]]):
        with pytest.raises(ResumeError, match="is damaged: the content hashes"):
            content_hash.check(bad, saved["run"].opts, saved["run"].tset, "s")


def test_state_of_another_method_is_named(saved, tmp_path):
    """A train_dreambooth state given to train_lora (or the other way): named as such, not as
    whichever option the two scripts set differently."""
    from library.log import logger
    from library.outputs import train_state

    opts, tset, plan = _lora_run_resuming(saved, tmp_path, "db-state",
                                          lambda info: info.update(method="dreambooth"))
    with pytest.raises(ResumeError, match=r"written by train_dreambooth.py \(dreambooth\), "
                                                      r"this is train_lora.py"):
        train_state.check_resume(opts, "lora", plan, tset, logger)
