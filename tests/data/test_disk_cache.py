"""The latent cache on disk: never a stale entry, never a needless encode (VAE calls counted)."""
import copy
import logging
import os

import pytest
import torch
from PIL import Image

from library.data import latent_cache
from library.data.buckets import BucketManager
from library.data.folders import scan_concept_dirs
from library.data.latent_cache import encode_latents, entry_path, item_cache_key, vae_fingerprint
from library.models.families.sd_common.tiny_models import build_tiny_components
from tools.make_sample_dataset import make_sample_dataset

LOG = logging.getLogger("test_disk_cache")


@pytest.fixture(scope="module")
def vae():
    return build_tiny_components("sd15")["vae"].eval()


@pytest.fixture
def count(vae):
    """Images passed through vae.encode (wraps the VAE's encode)."""
    from library.data.latent_cache import counting_encodes

    with counting_encodes(vae) as seen:
        yield seen


def _items(root, resolution=64, **fields):
    items = scan_concept_dirs(str(root), log=LOG, **fields)
    return BucketManager((resolution, resolution), False).assign(items, LOG)


def _encode(vae, items, **kw):
    kw.setdefault("vae_identity", "vae-a")
    return encode_latents(vae, items, batch_size=2, dtype=torch.float32, device="cpu", log=LOG,
                          to_disk=True, **kw)


def _cache_files(folder):
    d = os.path.join(folder, ".sdcache")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def test_unchanged_is_loaded_edited_is_recomputed(tmp_path, vae, count):
    folder = make_sample_dataset(str(tmp_path / "d"), n_images=3, size=64, repeats=2)
    items = _items(tmp_path / "d")
    first = _encode(vae, items)
    assert sum(count) == 3 and len(first) == 3
    files = _cache_files(folder)
    assert files == sorted(k + ".safetensors" for k in first)  # named by the content key, no temp files

    count.clear()
    second = _encode(vae, _items(tmp_path / "d"))
    assert count == []  # nothing changed: zero encoder calls
    assert second.keys() == first.keys()
    for k in first:
        assert torch.equal(second[k].latents, first[k].latents)
        assert (second[k].original_size, second[k].crop_top_left, second[k].target_size) == \
            (first[k].original_size, first[k].crop_top_left, first[k].target_size)

    # edit one image: exactly one recomputation, the others still load
    Image.new("RGB", (64, 64), (0, 255, 0)).save(os.path.join(folder, "shape_01.png"))
    count.clear()
    third = _encode(vae, _items(tmp_path / "d"))
    assert sum(count) == 1
    assert len(set(third) - set(first)) == 1 and len(set(third) & set(first)) == 2


def test_changed_resolution_or_vae_recomputes(tmp_path, vae, count):
    make_sample_dataset(str(tmp_path / "d"), n_images=2, size=64, repeats=1)
    _encode(vae, _items(tmp_path / "d"))
    count.clear()
    _encode(vae, _items(tmp_path / "d", resolution=32))  # another bucket / resize
    assert sum(count) == 2
    # another VAE: its fingerprint differs, so does every key
    other = copy.deepcopy(vae)
    with torch.no_grad():
        next(other.parameters()).view(-1)[0] += 0.5
    seen = []
    real = other.encode
    other.encode = lambda x, *a, **k: (seen.append(x.shape[0]), real(x, *a, **k))[1]
    out = encode_latents(other, _items(tmp_path / "d"), batch_size=2, dtype=torch.float32,
                         device="cpu", log=LOG, to_disk=True)
    assert sum(seen) == 2 and vae_fingerprint(other) != vae_fingerprint(vae)
    count.clear()
    _encode(vae, _items(tmp_path / "d"))  # the first VAE's entries are still there
    assert count == [] and len(out) == 2


def test_corrupt_or_truncated_entry_is_recomputed_with_a_warning(tmp_path, vae, count, caplog):
    folder = make_sample_dataset(str(tmp_path / "d"), n_images=3, size=64, repeats=1)
    items = _items(tmp_path / "d")
    first = _encode(vae, items)
    keys = [item_cache_key(it, False, "vae-a", torch.float32) for it in items]
    truncated = entry_path(items[0], keys[0])
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) // 2)
    garbage = entry_path(items[1], keys[1])
    with open(garbage, "wb") as f:
        f.write(b"\x00" * 64)
    count.clear()
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        again = _encode(vae, _items(tmp_path / "d"))
    assert sum(count) == 2
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and all("recomputing" in m for m in warned)
    assert any(truncated in m for m in warned) and any(garbage in m for m in warned)
    for k in keys:
        assert torch.allclose(again[k].latents, first[k].latents, atol=1e-6)
    count.clear()
    _encode(vae, _items(tmp_path / "d"))  # rewritten: loads again
    assert count == []
    # an entry renamed to another key's name is caught by the key stored inside it
    os.replace(entry_path(items[0], keys[0]), entry_path(items[2], keys[2]))
    count.clear()
    _encode(vae, _items(tmp_path / "d"))
    assert sum(count) == 2  # the moved-away entry and the overwritten one
    assert folder


def test_cache_dir_and_flip_variants(tmp_path, vae, count):
    folder = make_sample_dataset(str(tmp_path / "d"), n_images=2, size=64, repeats=1)
    cache_dir = str(tmp_path / "cache")
    items = _items(tmp_path / "d", cache_dir=cache_dir, flip_aug=True)
    out = _encode(vae, items)
    assert sum(count) == 4 and len(out) == 4  # each image plain and mirrored
    assert sorted(os.listdir(cache_dir)) == sorted(k + ".safetensors" for k in out)
    assert _cache_files(folder) == []
    count.clear()
    _encode(vae, _items(tmp_path / "d", cache_dir=cache_dir, flip_aug=True))
    assert count == []


# ---- through the entry script and the tool ---------------------------------------------------

@pytest.fixture
def encode_calls(monkeypatch):
    calls = []
    real = latent_cache.encode_pixels

    def spy(vae, pixels):
        calls.append(pixels.shape[0])
        return real(vae, pixels)

    monkeypatch.setattr(latent_cache, "encode_pixels", spy)
    return calls


def _args(dataset, out, *extra):
    return ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
            "--resolution", "64", "--output_dir", out, "--max_train_steps", "2",
            "--network_dim", "2", "--optimizer_type", "SGDNesterov", "--learning_rate", "1e-3",
            *extra]


def test_tool_fills_the_cache_and_training_then_encodes_nothing(dataset, tmp_path, train, encode_calls,
                                                               capsys):
    from library.run.stages import Run
    from tools.cache_latents import main as cache_main

    rc = cache_main(["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
                     "--resolution", "64", "--flip_aug"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert sum(encode_calls) == 4 and "4 entries" in out  # 2 images x 2 variants
    encode_calls.clear()
    rc, _, err, run = train("train_lora", _args(dataset, tmp_path / "a", "--cache_latents_to_disk",
                                                "--flip_aug"))
    assert rc == 0, err
    assert encode_calls == [] and len(run.parts.caches.latents) == 4  # loaded from disk, not a VAE call
    assert isinstance(run, Run)
    # the same run without the disk cache encodes, and trains to the same weights
    rc, _, err, run2 = train("train_lora", _args(dataset, tmp_path / "b", "--cache_latents",
                                                 "--flip_aug"))
    assert rc == 0, err
    assert sum(encode_calls) == 4
    from tests.conftest import read

    a, _ = read(tmp_path / "a" / "last.safetensors")
    b, _ = read(tmp_path / "b" / "last.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_tool_errors_are_one_line(tmp_path, capsys):
    from tools.cache_latents import main as cache_main

    rc = cache_main(["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir",
                     str(tmp_path / "missing"), "--resolution", "64"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.strip().startswith("error: train_data_dir") and "Traceback" not in err


def test_two_processes_split_the_caching_work(tmp_path):
    """``accelerate launch --num_processes 2 tools/cache_latents.py``: each process encodes its
    share of the missing entries (rank 0 reports 2 of 4), all 4 end up on disk, a later pass
    encodes nothing."""
    import socket
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    folder = make_sample_dataset(str(tmp_path / "d"), n_images=4, size=64, repeats=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tool = [os.path.join(root, "tools", "cache_latents.py"), "--pretrained_model_name_or_path",
            "tiny-sd15", "--train_data_dir", str(tmp_path / "d"), "--resolution", "64",
            "--vae_batch_size", "2"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(port), *tool]
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "latent cache: 4 entries ready; this process encoded 2 " in p.stdout, p.stdout
    assert "on this process of 2" in p.stderr and "could not be read" not in p.stderr
    assert len(_cache_files(folder)) == 4
    # a later (in-process) pass finds every entry: no VAE call
    from tests.conftest import reset_accelerate
    from tools.cache_latents import _parse, cache_latents

    reset_accelerate()
    try:
        assert cache_latents(_parse("train_lora", tool[1:]), LOG)[2] == 0
    finally:
        reset_accelerate()


def test_training_run_recomputes_for_another_vae_or_resolution(dataset, tmp_path, train, encode_calls):
    """Run level: the key uses the loaded VAE's identity (``--vae``) and the run's buckets."""
    vae_dir = str(tmp_path / "vae")
    build_tiny_components("sd15")["vae"].save_pretrained(vae_dir)
    runs = [([], 2), ([], 0), (["--vae", vae_dir], 2), (["--vae", vae_dir], 0),
            (["--resolution", "32"], 2), (["--no_half_vae"], 0)]  # float32 already: same dtype
    for i, (extra, expected) in enumerate(runs):
        encode_calls.clear()
        rc, _, err, _ = train("train_lora", _args(dataset, tmp_path / f"o{i}", "--cache_latents_to_disk",
                                                  "--max_train_steps", "1", *extra))
        assert rc == 0, err
        assert sum(encode_calls) == expected, (extra, encode_calls)


# ---- text-encoder output cache -----------------------------------------------------------------

@pytest.fixture
def te_calls(monkeypatch):
    """Captions passed through the text encoders, and how many of them were before training."""
    from library.models import family
    from library.run import stages

    calls = {"captions": 0, "after_cache": None}
    for cls in (family.SD1Model, family.SDXLModel):
        real = cls.encode

        def spy(self, token_ids, clip_skip, _real=real):
            calls["captions"] += token_ids[0].shape[0]
            return _real(self, token_ids, clip_skip)

        monkeypatch.setattr(cls, "encode", spy)
    real_cache = stages.Run.cache

    def cache(self, loaded, setup):
        cached = real_cache(self, loaded, setup)
        calls["after_cache"] = calls["captions"]
        return cached

    monkeypatch.setattr(stages.Run, "cache", cache)
    return calls


def _tagged_dataset(root):
    folder = make_sample_dataset(str(root), n_images=2, size=64, repeats=5)
    for i, name in enumerate(sorted(n for n in os.listdir(folder) if n.endswith(".caption"))):
        with open(os.path.join(folder, name), "w") as f:
            f.write(f"sks, tag{i}a, tag{i}b, tag{i}c, tag{i}d")
    return folder


def test_text_encoder_cache_with_shuffle_and_dropout(tmp_path, train, te_calls):
    folder = _tagged_dataset(tmp_path / "d")
    args = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", tmp_path / "d",
            "--resolution", "64", "--max_train_steps", "4", "--network_dim", "2",
            "--network_train_unet_only", "--cache_text_encoder_outputs_to_disk",
            "--shuffle_caption", "--keep_tokens", "1", "--caption_dropout_rate", "0.3",
            "--text_encoder_cache_variants", "3"]
    # highvram: the text encoder stays after caching, for the direct encodings below
    rc, _, err, run = train("train_lora", [*args, "--highvram", "--output_dir", tmp_path / "a"])
    assert rc == 0, err
    ts = run.tset
    variants = {it.path: ts.caption_variants(it) for it in ts.train_items}
    for v in variants.values():  # 3 different shuffles, the kept tag first
        assert len(set(v)) == 3 and all(c.startswith("sks, ") for c in v)
    expected = set().union(*map(set, variants.values())) | {""}
    assert set(run.parts.caches.text) == expected
    # every caption encoded once, before training; the steps use cached encodings only
    assert te_calls["captions"] == te_calls["after_cache"] == len(expected)
    picked = [ts.cached_caption(i, e) for e in (1, 2, 3) for i in range(len(ts.samples))]
    assert "" in picked and len(set(picked) - {""}) > 3  # dropout and several variants in use
    for i in range(len(ts.samples)):  # dropout decided by the same draw as the uncached caption
        assert (ts.cached_caption(i, 1) == "") == (ts.caption(i, 1) == "")
    # the cached conditioning is what the encoder gives for that caption
    c = variants[ts.train_items[0].path][1]
    with torch.no_grad():
        direct = run.parts.family_model.encode(run.parts.family_model.tokenize([c]), None).hidden_states[0]
    assert torch.allclose(run.parts.caches.text[c].hidden_states, direct, atol=1e-5)
    assert len([n for n in os.listdir(os.path.join(folder, ".sdcache")) if n.startswith("te-")]) == len(expected)

    te_calls["captions"] = 0
    rc, _, err, run2 = train("train_lora", [*args, "--output_dir", tmp_path / "b"])
    assert rc == 0, err
    assert te_calls["captions"] == 0  # everything loaded from disk
    assert all(torch.equal(run2.parts.caches.text[k].hidden_states, run.parts.caches.text[k].hidden_states)
               for k in expected)

    rc, _, err, _ = train("train_lora", [a for a in args if a != "--network_train_unet_only"]
                          + ["--output_dir", tmp_path / "c"])
    assert rc == 2 and "network_train_unet_only" in err and "Traceback" not in err


def test_text_encoder_cache_sdxl_keeps_the_pooled_output(tmp_path, train, te_calls):
    _tagged_dataset(tmp_path / "d")
    rc, _, err, run = train("train_lora", [
        "--pretrained_model_name_or_path", "tiny-sdxl", "--train_data_dir", tmp_path / "d",
        "--resolution", "64", "--max_train_steps", "2", "--network_dim", "2",
        "--network_train_unet_only", "--cache_text_encoder_outputs", "--output_dir", tmp_path / "o",
        "--highvram"])  # the text encoders stay after caching, for the direct encodings below
    assert rc == 0, err
    assert te_calls["captions"] == te_calls["after_cache"] == 2
    for c, e in run.parts.caches.text.items():
        with torch.no_grad():
            direct = run.parts.family_model.encode(run.parts.family_model.tokenize([c]), None)
        assert e.pooled is not None and torch.allclose(e.pooled, direct.pooled[0], atol=1e-5)
        assert torch.allclose(e.hidden_states, direct.hidden_states[0], atol=1e-5)
