"""The text-encoder output cache for FLUX.1 and SD3 (cache_text_encoder_outputs, ..._to_disk):
a cached run trains the same weights as an uncached one (SGD, one thread; the cache holds what the
step would compute: FLUX.1's T5 states, CLIP-L pooled and T5 mask, SD3's context and pooled); a
second run over the same data loads every entry from disk; changing t5xxl_max_token_length (or
apply_t5_attn_mask) misses, and the entries then hold the new length."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from tests.conftest import read

MODELS = {"flux": "tiny-flux", "sd3": "tiny-sd3"}


def _args(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", "2", "--learning_rate", "0.5",
            "--optimizer_type", "SGD", "--cache_latents", "--seed", "7", "--train_batch_size", "2",
            "--t5xxl_max_token_length", "16", "--apply_t5_attn_mask", *extra]


def _initial(family):
    from library.models.families.flux import tiny_flux
    from library.models.families.sd3 import sd3_builtins

    if family == "flux":
        return tiny_flux.build_tiny_flux("dev")["transformer"].state_dict()
    return sd3_builtins.build_builtin("tiny-sd3")["mmdit"].state_dict()


def _weights(run):
    return {k: v.detach().clone() for k, v in run.parts.bundle.unet.state_dict().items()}


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_cached_run_equals_uncached_and_the_disk_cache_is_keyed(family, dataset, tmp_path, train):
    model = MODELS[family]
    cache = str(tmp_path / "cache")
    rc, _, err, plain = train("finetune", _args(model, dataset, str(tmp_path / "plain")))
    assert rc == 0, err[-2000:]
    assert plain.parts.caches.text is None
    rc, _, err, cached = train("finetune", _args(model, dataset, str(tmp_path / "cached"),
                                                 "--cache_text_encoder_outputs_to_disk", "--cache_dir", cache))
    assert rc == 0, err[-2000:]
    assert cached.parts.caches.text is not None
    a, b = _weights(plain), _weights(cached)
    for k in a:  # the same encodings, up to the last bits of a batch-of-2 against a batch-of-1 GEMM
        assert float((a[k] - b[k]).norm()) / max(float(b[k].norm()), 1e-4) <= 1e-5, k
    initial = _initial(family)  # trained: not a comparison of two untouched models
    assert sum(not torch.equal(a[k], initial[k]) for k in a) > len(a) // 2

    files = sorted(glob.glob(os.path.join(cache, "te-*.safetensors")))
    assert len(files) == 2  # make_sample_dataset's two captions
    tensors, _ = read(files[0])
    if family == "flux":  # T5 states (16 tokens), CLIP-L pooled, the T5 mask
        assert set(tensors) == {"hidden_states", "pooled", "t5_attn_mask"}
        assert tensors["hidden_states"].shape[0] == 16 and tensors["t5_attn_mask"].shape == (16,)
    else:  # context: 77 CLIP tokens, then 16 T5 tokens
        assert set(tensors) == {"hidden_states", "pooled"}
        assert tensors["hidden_states"].shape[0] == 77 + 16
        # the text encoders left memory after caching and came back for the save, bit for bit
        from library.models.families.sd3 import sd3_builtins, sd3_checkpoint

        saved, _ = read(str(tmp_path / "cached" / "last.safetensors"))
        built = sd3_builtins.build_builtin("tiny-sd3")
        for name in ("clip_g", "t5xxl"):
            for k, v in built[name].state_dict().items():
                key = sd3_checkpoint.TE_PREFIX[name] + k
                assert key in saved and torch.equal(saved[key], v), key

    def cache_line(*extra):
        rc, out, err, _ = train("finetune", _args(model, dataset, str(tmp_path / "again"),
                                                  "--cache_text_encoder_outputs_to_disk", "--cache_dir", cache,
                                                  "--max_train_steps", "1", *extra))
        assert rc == 0, err[-2000:]
        return [line[line.index("text-encoder cache:"):] for line in (out + err).splitlines()
                if "text-encoder cache:" in line]

    assert cache_line() == ["text-encoder cache: 2 caption(s), 2 loaded from disk, encoding 0"]
    assert cache_line("--t5xxl_max_token_length", "8") == [
        "text-encoder cache: 2 caption(s), 0 loaded from disk, encoding 2"]
    files = sorted(glob.glob(os.path.join(cache, "te-*.safetensors")))
    assert len(files) == 4
    lengths = sorted(read(f)[0]["hidden_states"].shape[0] for f in files)
    assert lengths == ([8, 8, 16, 16] if family == "flux" else [85, 85, 93, 93])


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_caption_dropout_uses_the_empty_caption_cached_or_not(family, dataset, tmp_path, train):
    """caption_dropout_rate (sd-scripts: the caption is replaced by the empty one before the
    encoders): with rate 1 every sample trains on the encoding of "" (T5: only </s>), read from
    the cache's entry of "" with cache_text_encoder_outputs; cached and uncached train the same
    weights, and the run differs from one without dropout."""
    model = MODELS[family]
    base = ["--t5xxl_max_token_length", "8", "--max_train_steps", "1"]
    plain = _weights(_ok(train, _args(model, dataset, str(tmp_path / "a"), *base)))
    runs = [_ok(train, _args(model, dataset, str(tmp_path / f"d{k}"), *base, "--caption_dropout_rate", "1", *extra))
            for k, extra in enumerate(([], ["--cache_text_encoder_outputs"]))]
    assert all(runs[0].tset.caption(i, 0) == "" for i in range(len(runs[0].tset.samples)))
    assert "" in runs[1].parts.caches.text
    a, b = _weights(runs[0]), _weights(runs[1])
    for k in a:
        assert float((a[k] - b[k]).norm()) / max(float(b[k].norm()), 1e-4) <= 1e-5, k
    assert any(not torch.equal(a[k], plain[k]) for k in a)


def _ok(train, args):
    rc, _, err, run = train("finetune", args)
    assert rc == 0, err[-2000:]
    return run


def test_text_encoder_batch_size_sets_the_caching_batches(dataset, tmp_path, train, monkeypatch):
    """text_encoder_batch_size (sd-scripts' option): the captions are encoded for the cache in
    batches of that many; unset, in batches of vae_batch_size (1); the entries are the same."""
    from library.models.families.sd3.home import SD3FamilyModel

    sizes = []
    real = SD3FamilyModel.encode

    def spy(self, token_ids, clip_skip):
        sizes.append(int(token_ids[0].shape[0]))
        return real(self, token_ids, clip_skip)

    monkeypatch.setattr(SD3FamilyModel, "encode", spy)
    entries = []
    for k, extra in enumerate(([], ["--text_encoder_batch_size", "2"])):
        sizes.clear()
        run = _ok(train, _args("tiny-sd3", dataset, str(tmp_path / f"o{k}"), "--cache_text_encoder_outputs",
                               "--max_train_steps", "1", *extra))
        assert sizes == ([1, 1] if not extra else [2])  # two captions; training reads the cache
        entries.append(run.parts.caches.text)
    assert entries[0].keys() == entries[1].keys()
    for cap in entries[0]:
        a, b = entries[0][cap].hidden_states, entries[1][cap].hidden_states
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())


def test_the_key_follows_the_separate_encoder_files_and_the_family_parts(tmp_path):
    """The text-encoder cache key of a FLUX.1 / SD3 run changes with a rewritten t5xxl (or
    clip_l / clip_g) file and with the family model's parts (T5 length, masks); an SD family
    model adds no part, so SD keys are what they were."""
    import time
    from types import SimpleNamespace

    from library.data import cache_stage, text_cache
    from library.models.family import FamilyModel

    t5_file = tmp_path / "t5xxl.safetensors"
    t5_file.write_bytes(b"one")
    bundle = SimpleNamespace(identity="model", family="flux", tokenizers=[])
    opts = SimpleNamespace(clip_l=None, clip_g=None, t5xxl=str(t5_file))

    def key(parts):
        fm = SimpleNamespace(cache_identity=lambda: dict(parts))
        extra = cache_stage._family_parts(opts, fm)
        return text_cache.encoder_identity(bundle, "float32", None, None, extra=extra)

    first = key({"t5_max_length": 512, "apply_t5_attn_mask": False})
    assert key({"t5_max_length": 512, "apply_t5_attn_mask": False}) == first
    assert key({"t5_max_length": 256, "apply_t5_attn_mask": False}) != first
    assert key({"t5_max_length": 512, "apply_t5_attn_mask": True}) != first
    time.sleep(0.01)
    t5_file.write_bytes(b"other")  # another T5 file at the same path
    assert key({"t5_max_length": 512, "apply_t5_attn_mask": False}) != first

    assert FamilyModel.cache_identity(None) == {}
    opts.t5xxl = None
    sd_bundle = SimpleNamespace(identity="model", family="sd1", tokenizers=[])
    assert text_cache.encoder_identity(sd_bundle, "float32", None, None,
                                       extra=cache_stage._family_parts(opts, SimpleNamespace(cache_identity=dict))) == \
        text_cache.encoder_identity(sd_bundle, "float32", None, None)
