"""Long captions (max_token_length 150 / 225), as sd-scripts encodes them: 75-token windows, each
BOS ... EOS, encoded alone and joined (first BOS, 75 states per window, last window's final state).

The reference below builds the windows by hand from the caption's plain token list and runs the
text encoders itself; the family model's output must match it. Then the text-encoder cache key, the
option's validation, the resume check, and end-to-end LoRA runs (with and without the cache, with
sample prompts) on tiny-sd15 and tiny-sdxl.
"""
from __future__ import annotations

import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from library.data import text_cache
from library.config.parse import ConfigError, parse_args
from library.models.family import FamilyError, family_model_for
from library.models.loading import load_model_bundle
from tests.conftest import read

LETTERS = "abcdefghijklmnopqrstuvwxyz"  # each a single token ("x</w>") in the tiny vocabulary


@pytest.fixture(scope="module")
def bundles():
    return {name: load_model_bundle(name) for name in ("tiny-sd15", "tiny-sd2", "tiny-sdxl")}


def sd2_openclip(bundles):
    """tiny-sd2 with a tokenizer that pads with "!" as the real SD2 (OpenCLIP) tokenizer does; the
    tiny vocabularies are the same, so SDXL's second tokenizer is that tokenizer."""
    b = bundles["tiny-sd2"]
    return SimpleNamespace(family="sd2", unet=b.unet, text_encoders=b.text_encoders,
                           tokenizers=[bundles["tiny-sdxl"].tokenizers[1]])


def content(tok, caption):
    ids = tok(caption).input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    return ids[1:-1]


def caption_of(tok, n_tokens, seed=0):
    """A caption of exactly n_tokens tokens: random one-token words."""
    rng = np.random.default_rng(seed)
    text = " ".join(LETTERS[i] for i in rng.integers(len(LETTERS), size=n_tokens))
    assert len(content(tok, text)) == n_tokens
    return text


def ref_windows(tok, caption, n):
    """By hand: window k = BOS, tokens 75k..75k+74 of the caption, EOS, then padding; a window
    with no tokens is BOS EOS PAD ... (sd-scripts' rule for both padding kinds)."""
    c = content(tok, caption)[:75 * n]
    out = []
    for k in range(n):
        part = c[75 * k:75 * k + 75]
        w = [tok.bos_token_id] + part + [tok.eos_token_id] + [tok.pad_token_id] * (75 - len(part))
        out.append(w)
    return torch.tensor(out)


def ref_join(states):
    """(n, 77, D) window states -> (n*75+2, D)."""
    n = states.shape[0]
    return torch.cat([states[0, :1]] + [states[k, 1:76] for k in range(n)] + [states[-1, 76:]])


def ref_sd(b, caption, n, clip_skip):
    te = b.text_encoders[0]
    out = te(ref_windows(b.tokenizers[0], caption, n), output_hidden_states=True)
    if clip_skip is None:
        h = out.last_hidden_state
    else:
        h = getattr(te, "text_model", te).final_layer_norm(out.hidden_states[-clip_skip])
    return ref_join(h)


def ref_sdxl(b, caption, n):
    (t1, t2), (te1, te2) = b.tokenizers, b.text_encoders
    o1 = te1(ref_windows(t1, caption, n), output_hidden_states=True)
    o2 = te2(ref_windows(t2, caption, n), output_hidden_states=True)
    hidden = torch.cat([ref_join(o1.hidden_states[-2]), ref_join(o2.hidden_states[-2])], dim=-1)
    return hidden, o2.text_embeds[0]


def encode(b, captions, max_token_length, clip_skip=None):
    ad = family_model_for(b, max_token_length)
    return ad.encode(ad.tokenize(captions), clip_skip)


CASES = [("tiny-sd15", None), ("tiny-sd15", 2), ("tiny-sd2", None), ("tiny-sd2", 2),
         ("sd2-openclip", None), ("tiny-sdxl", None)]


def bundle_of(bundles, name):
    return sd2_openclip(bundles) if name == "sd2-openclip" else bundles[name]


@pytest.mark.parametrize("name, clip_skip", CASES)
def test_states_match_the_hand_built_windows(bundles, name, clip_skip):
    b = bundle_of(bundles, name)
    tok = b.tokenizers[-1]
    short, long_, longer = caption_of(tok, 20, 1), caption_of(tok, 110, 2), caption_of(tok, 190, 3)
    with torch.no_grad():
        for mtl, n in ((None, 1), (75, 1), (150, 2), (225, 3)):
            cond = encode(b, [short, long_, longer], mtl, clip_skip)
            length = 75 * n + 2
            assert cond.hidden_states.shape[:2] == (3, length)
            for j, cap in enumerate((short, long_, longer)):
                if b.family == "sdxl":
                    hidden, pooled = ref_sdxl(b, cap, n)
                    # the pooled output is the first window's (sd-scripts pool2[::n])
                    assert torch.allclose(cond.pooled[j], pooled, atol=1e-5), (mtl, j)
                else:
                    hidden = ref_sd(b, cap, n, clip_skip)
                    assert cond.pooled is None
                assert hidden.shape[0] == length
                assert torch.allclose(cond.hidden_states[j], hidden, atol=1e-5), (mtl, j)
        # a caption under 75 tokens: its first window is exactly the 75-token encoding
        plain = encode(b, [short], None, clip_skip)
        for mtl in (150, 225):
            long_cond = encode(b, [short], mtl, clip_skip)
            assert torch.allclose(long_cond.hidden_states[0, :76], plain.hidden_states[0, :76], atol=1e-6)
            if b.family == "sdxl":
                assert torch.allclose(long_cond.pooled, plain.pooled, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-sd15", "sd2-openclip", "tiny-sdxl"])
def test_tokens_beyond_75_count_only_when_allowed(bundles, name):
    b = bundle_of(bundles, name)
    tok = b.tokenizers[-1]
    a = caption_of(tok, 75, 4)
    # the same 75 tokens followed by two different tails
    a1 = a + " " + caption_of(tok, 40, 5)
    a2 = a + " " + caption_of(tok, 40, 6)
    assert content(tok, a1)[:75] == content(tok, a2)[:75] and content(tok, a1) != content(tok, a2)
    with torch.no_grad():
        h75 = encode(b, [a1, a2], None).hidden_states
        h150 = encode(b, [a1, a2], 150).hidden_states
    assert torch.equal(h75[0], h75[1])  # both truncated to the same 75 tokens
    assert torch.allclose(h150[0, :76], h150[1, :76], atol=1e-6)  # the first window is the same
    assert not torch.allclose(h150[0, 76:], h150[1, 76:], atol=1e-3)  # the tails are seen
    # beyond 150 tokens: truncated at 150, seen at 225
    b1 = caption_of(tok, 150, 7) + " " + caption_of(tok, 30, 8)
    b2 = caption_of(tok, 150, 7) + " " + caption_of(tok, 30, 9)
    with torch.no_grad():
        assert torch.allclose(encode(b, [b1], 150).hidden_states, encode(b, [b2], 150).hidden_states, atol=1e-6)
        assert not torch.allclose(encode(b, [b1], 225).hidden_states, encode(b, [b2], 225).hidden_states, atol=1e-3)


def test_window_tokens_follow_sd_scripts(bundles):
    """The OpenCLIP-padded tokenizer (pad "!" != EOS): a full window ends with EOS, an empty one
    is BOS EOS PAD ...; the CLIP tokenizer (pad = EOS) needs no fix."""
    t1, t2 = bundles["tiny-sdxl"].tokenizers
    assert t1.pad_token_id == t1.eos_token_id and t2.pad_token_id != t2.eos_token_id
    ad = family_model_for(bundles["tiny-sdxl"], 225)
    cap = caption_of(t2, 100, 10)
    ids1, ids2 = ad.tokenize([cap])
    assert ids1.shape == ids2.shape == (1, 3, 77)
    for tok, ids in ((t1, ids1), (t2, ids2)):
        c = content(tok, cap)
        w = ids[0]
        assert w[0].tolist() == [tok.bos_token_id] + c[:75] + [tok.eos_token_id]
        assert w[1, :len(c) - 75 + 2].tolist() == [tok.bos_token_id] + c[75:] + [tok.eos_token_id]
        assert w[2, :2].tolist() == [tok.bos_token_id, tok.eos_token_id]
        assert (w[1:, -1] == tok.pad_token_id).all() and (w[2, 2:] == tok.pad_token_id).all()
    with pytest.raises(FamilyError, match=r"max_token_length: 100 is not one of: 75, 150, 225"):
        family_model_for(bundles["tiny-sd15"], 100)


def test_text_cache_key_depends_on_max_token_length(bundles):
    b = bundles["tiny-sdxl"]
    ids = {m: text_cache.encoder_identity(b, torch.float32, None, m) for m in (None, 75, 150, 225)}
    assert ids[None] == ids[75] == text_cache.encoder_identity(b, torch.float32, None)
    assert len({ids[None], ids[150], ids[225]}) == 3
    assert text_cache.text_key("a caption", ids[None]) != text_cache.text_key("a caption", ids[150])


BASE = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", "d", "--output_dir", "o",
        "--resolution", "64", "--max_train_steps", "1"]


def test_option_values_and_errors(tmp_path):
    assert parse_args("train_lora", BASE).max_token_length is None
    assert parse_args("train_lora", [*BASE, "--max_token_length", "150"]).max_token_length == 150
    assert parse_args("finetune", [*BASE, "--max_token_length", "225"]).max_token_length == 225
    assert parse_args("train_lora", [*BASE, "--max_token_length", "75"]).max_token_length is None  # the default
    with pytest.raises(ConfigError) as e:
        parse_args("train_lora", [*BASE, "--max_token_length", "100"])
    assert str(e.value).startswith("--max_token_length: 100 is not one of: 75, 150, 225")
    assert "\n" not in str(e.value)
    run = tmp_path / "run.toml"
    run.write_text("[training_arguments]\nmax_token_length = 225\n")
    assert parse_args("train_dreambooth", [*BASE, "--config", str(run)]).max_token_length == 225
    run.write_text("[training_arguments]\nmax_token_length = 100\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(run))}:2: max_token_length: 100 is not one of"):
        parse_args("train_lora", [*BASE, "--config", str(run)])
    # a run option, not a dataset key (as in sd-scripts)
    from library.config.dataset_config import resolve_dataset_config
    from library.errors import UserError

    opts = parse_args("train_lora", BASE)
    raw = {"general": {"max_token_length": 150}, "datasets": [{"subsets": [{"image_dir": "d"}]}]}
    with pytest.raises(UserError, match="unknown key 'max_token_length'"):
        resolve_dataset_config(raw, "ds.toml", opts)


# --- end to end ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_data(tmp_path_factory, bundles):
    """Two 64 px images whose captions are ~110 tokens: the same first 75 tokens, different tails."""
    from tools.make_sample_dataset import make_sample_dataset

    root = str(tmp_path_factory.mktemp("long") / "data")
    make_sample_dataset(root, n_images=2, size=64, repeats=1)
    tok = bundles["tiny-sd15"].tokenizers[0]
    head = caption_of(tok, 75, 11)
    caps = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".caption"))
    for i, path in enumerate(caps):
        with open(path, "w") as f:
            f.write(head + " " + caption_of(tok, 35, 20 + i))
    return root


def pixels(path):
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).astype(np.int64)


def lora_args(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", str(out),
            "--resolution", "64", "--max_train_steps", "2", "--learning_rate", "1e-2",
            "--optimizer_type", "torch.optim.SGD", "--network_dim", "4", "--network_alpha", "4",
            "--cache_latents", *extra]


@pytest.mark.parametrize("model", ["tiny-sd15", "tiny-sdxl"])
def test_train_lora_with_long_captions(model, long_data, bundles, train, tmp_path):
    tok = bundles[model].tokenizers[-1]
    head = caption_of(tok, 75, 30)
    prompts = tmp_path / "p.txt"
    # two prompts that differ only after their first 75 tokens, same seed
    prompts.write_text("".join(f"{head} {caption_of(tok, 30, 40 + i)} --w 64 --h 64 --s 2 --d 5\n"
                               for i in range(2)))
    runs = {}
    for name, extra in [("150", ["--max_token_length", "150"]),
                        ("150-cached", ["--max_token_length", "150", "--cache_text_encoder_outputs",
                                        "--network_train_unet_only"]),
                        ("75", [])][:3 if model == "tiny-sd15" else 2]:  # SDXL: the slow one
        out = tmp_path / name
        rc, stdout, err, r = train("train_lora", lora_args(
            model, long_data, out, "--sample_prompts", prompts, "--sample_every_n_steps", "2",
            "--validation_split", "0.5", "--validate_every_n_steps", "2", *extra))
        assert rc == 0, err[-3000:]
        assert re.search(r"validation loss \d+\.\d+ at step 2", stdout + err)  # long captions too
        sd, md = read(str(out / "last.safetensors"))
        assert all(torch.isfinite(t).all() for t in sd.values())
        assert any(k.endswith("lora_up.weight") and t.abs().sum() > 0 for k, t in sd.items())  # trained
        assert md["ss_max_token_length"] == ("None" if name == "75" else "150")
        n_states = 77 if name == "75" else 152
        assert r.parts.family_model.n_chunks == (1 if name == "75" else 2)
        if name == "150-cached":
            assert r.parts.caches.text and all(e.hidden_states.shape[0] == n_states for e in r.parts.caches.text.values())
            if model == "tiny-sdxl":
                assert all(e.pooled is not None for e in r.parts.caches.text.values())
        a, b = sorted(os.listdir(out / "sample"))
        same = np.array_equal(pixels(out / "sample" / a), pixels(out / "sample" / b))
        assert same == (name == "75"), name  # the prompts' tails matter only with 150 tokens
        runs[name] = sd
    if "75" not in runs:
        return
    # the captions' tails change the training only when max_token_length lets them in
    key = next(k for k in runs["75"] if k.startswith("lora_unet") and k.endswith("lora_up.weight"))
    assert not torch.allclose(runs["150"][key], runs["75"][key], atol=1e-7)


def test_resume_with_another_max_token_length_is_an_error(long_data, train, tmp_path):
    args = lora_args("tiny-sd15", long_data, tmp_path / "o", "--max_token_length", "150", "--save_state",
                     "--network_train_unet_only")
    rc, _, err, _ = train("train_lora", args)
    assert rc == 0, err[-3000:]
    for change, was, now in ((["--max_token_length", "225"], "150", "225"), ([], "150", "unset")):
        again = [a for a in args if a not in ("--max_token_length", "150")]
        rc, _, err, r = train("train_lora", [*again, "--max_train_steps", "4", "--resume", "latest", *change])
        assert rc == 2 and r is None
        assert re.search(rf"error: resume: max_token_length changed since the state in .* \(was {was}, now {now}\)",
                         err), err[-2000:]
