"""The text-encoder cache a run writes, with clip_skip: its entries are keyed by clip_skip (a run
with clip_skip 2 never reuses clip_skip 1's entries) and hold what transformers computes directly
for that clip_skip (SD1/SD2: hidden_states[-clip_skip] through the final layer norm; SDXL: both
encoders' penultimate states and the pooled projection, where clip_skip does not apply, as in
sd-scripts)."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from tests.conftest import read

CAPTIONS = ["sks shape, a red circle", "sks shape, a blue square"]  # make_sample_dataset's


def _cache_run(train, model, data, cache, out, clip_skip):
    args = ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", "1", "--network_dim", "2",
            "--network_train_unet_only", "--cache_text_encoder_outputs_to_disk", "--cache_dir", cache,
            "--learning_rate", "1e-4"]
    if clip_skip is not None:
        args += ["--clip_skip", str(clip_skip)]
    rc, _, err, _ = train("train_lora", args)
    assert rc == 0, err[-2000:]


def _entries(cache):
    """hidden states (and pooled) of every text-encoder cache file, by file name."""
    out = {}
    for path in glob.glob(os.path.join(cache, "te-*.safetensors")):
        tensors, _ = read(path)
        out[os.path.basename(path)] = tensors
    return out


def _reference(model, clip_skip):
    """{caption: (hidden, pooled)} from the transformers models and tokenizers directly."""
    from library.models.loading import load_model_bundle

    b = load_model_bundle(model)
    refs = {}
    with torch.no_grad():
        for caption in CAPTIONS:
            if b.family == "sdxl":
                hs, pooled = [], None
                for te, tok in zip(b.text_encoders, b.tokenizers):
                    ids = tok([caption], padding="max_length", max_length=77, truncation=True,
                              return_tensors="pt").input_ids
                    out = te(ids, output_hidden_states=True)
                    hs.append(out.hidden_states[-2][0])
                    pooled = getattr(out, "text_embeds", pooled)
                refs[caption] = (torch.cat(hs, dim=-1), pooled[0])
            else:
                te, tok = b.text_encoders[0], b.tokenizers[0]
                ids = tok([caption], padding="max_length", max_length=77, truncation=True,
                          return_tensors="pt").input_ids
                out = te(ids, output_hidden_states=True)
                if clip_skip in (None, 1):
                    hidden = out.last_hidden_state[0]
                else:
                    norm = getattr(te, "text_model", te).final_layer_norm
                    hidden = norm(out.hidden_states[-clip_skip])[0]
                refs[caption] = (hidden, None)
    return refs


def _match(entries, refs):
    """For each caption, the name of the entry equal to its reference (asserting there is one)."""
    names = {}
    for caption, (hidden, pooled) in refs.items():
        hits = [n for n, t in entries.items() if t["hidden_states"].shape == hidden.shape
                and torch.allclose(t["hidden_states"], hidden, atol=1e-5, rtol=1e-5)
                and (pooled is None or torch.allclose(t["pooled"], pooled, atol=1e-5, rtol=1e-5))]
        assert hits, f"no cache entry equals the transformers encoding of {caption!r}"
        names[caption] = hits[0]
    return names


@pytest.mark.parametrize("model", ["tiny-sd15", "tiny-sd2", "tiny-sdxl"])
def test_cached_encodings_with_clip_skip_2_are_keyed_and_equal_an_uncached_encode(
        train, dataset, tmp_path, model):
    cache = str(tmp_path / "cache")
    _cache_run(train, model, dataset, cache, str(tmp_path / "out2"), 2)
    skip2 = _entries(cache)
    assert len(skip2) == len(CAPTIONS)
    ref2, ref1 = _reference(model, 2), _reference(model, 1)
    names2 = _match(skip2, ref2)
    if model != "tiny-sdxl":  # (SDXL: the same penultimate states for every clip_skip)
        for caption in CAPTIONS:  # matching the clip_skip 2 reference rules out clip_skip 1's
            assert (ref2[caption][0] - ref1[caption][0]).abs().max() > 1e-2
    if model != "tiny-sd15":
        return  # the key rule is the same code for every family: one second run (SD1) shows it
    _cache_run(train, model, dataset, cache, str(tmp_path / "out1"), 1)
    both = _entries(cache)
    # clip_skip 1 wrote its own entries: none of clip_skip 2's was reused
    assert len(both) == 2 * len(CAPTIONS)
    skip1 = {n: t for n, t in both.items() if n not in skip2}
    names1 = _match(skip1, ref1)
    for caption in CAPTIONS:
        h1 = skip1[names1[caption]]["hidden_states"]
        h2 = skip2[names2[caption]]["hidden_states"]
        assert (h1 - h2).abs().max() > 1e-2
