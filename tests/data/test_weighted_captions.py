"""weighted_captions: A1111 prompt weights in captions, as sd-scripts' strategy code reads them.

The parser against hand-parsed examples (A1111's documented ones included); the conditioning of a
weighted caption against a hand computation: the text encoder run directly on the hand-built
plain ids, each token's hidden state times its hand-computed weight (SD1 with and without
clip_skip, SDXL's two encoders with the pooled output unweighted, a long caption); a caption
without weights gives exactly the unweighted conditioning; a 2-step LoRA run, cached == uncached.
"""
from __future__ import annotations

import os

import pytest
import torch

from library.models import prompt_weights as pw
from library.data import text_cache
from library.models.family import _final_layer_norm, family_model_for
from library.models.loading import load_model_bundle
from tests.conftest import read

R, S = 1.1, 1 / 1.1


def approx_pairs(got, want):
    assert [p for p, _ in got] == [p for p, _ in want]
    assert [w for _, w in got] == pytest.approx([w for _, w in want], rel=1e-12)


@pytest.mark.parametrize("text,want", [
    ("normal text", [("normal text", 1.0)]),
    ("an (important) word", [("an ", 1.0), ("important", R), (" word", 1.0)]),
    ("(unbalanced", [("unbalanced", R)]),             # an unclosed bracket runs to the end
    ("a [b", [("a ", 1.0), ("b", S)]),
    ("a ) b ] c", [("a ) b ] c", 1.0)]),              # stray closers are text
    ("\\(literal\\]", [("(literal]", 1.0)]),
    ("a \\\\ b", [("a \\ b", 1.0)]),
    ("(unnecessary)(parens)", [("unnecessaryparens", R)]),
    ("[x]", [("x", S)]),
    ("(x:0.5)", [("x", 0.5)]),
    ("((x))", [("x", R * R)]),
    ("(a (b:2) c)", [("a ", R), ("b", 2 * R), (" c", R)]),
    ("time: 3", [("time: 3", 1.0)]),                 # a colon outside (x:w) is text
    ("", [("", 1.0)]),
    ("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
     [("a ", 1.0), ("house", 1.3 * R * R), (" ", R), ("on", 1.0), (" a ", R), ("hill", 0.5 * R),
      (", sun, ", R), ("sky", R ** 4), (".", R)]),
])
def test_parse_matches_hand_parsing(text, want):
    approx_pairs(pw.parse(text), want)


@pytest.fixture(scope="module")
def bundles():
    return {name: load_model_bundle(name) for name in ("tiny-sd15", "tiny-sdxl")}


def word_id(tok, w):
    ids = tok(w).input_ids
    assert len(ids) == 3, w  # a single token in the tiny vocabulary
    return ids[1]


CAPTION = "a (b:1.5) [c] ((d)) e"
PLAIN = "a b c d e"
WEIGHTS = [1.0, 1.5, S, R * R, 1.0]


def hand_ids(tok, words, length=77):
    ids = [tok.bos_token_id] + [word_id(tok, w) for w in words] + [tok.eos_token_id]
    return torch.tensor([ids + [tok.pad_token_id] * (length - len(ids))])


def hand_weights(ws, length=77):
    return torch.tensor([[1.0] + ws + [1.0] * (length - 1 - len(ws))]).unsqueeze(-1)


@pytest.mark.parametrize("clip_skip", [None, 2])
def test_sd1_conditioning_is_the_hand_computation(bundles, clip_skip):
    b = bundles["tiny-sd15"]
    tok, te = b.tokenizers[0], b.text_encoders[0]
    ad = family_model_for(b, weighted=True)
    with torch.no_grad():
        got = ad.encode(ad.tokenize([CAPTION]), clip_skip).hidden_states
        ids = hand_ids(tok, "abcde")
        if clip_skip is None:
            ref = te(ids).last_hidden_state
        else:
            ref = _final_layer_norm(te)(te(ids, output_hidden_states=True).hidden_states[-clip_skip])
    weighted = ref * hand_weights(WEIGHTS)
    torch.testing.assert_close(got, weighted, rtol=1e-6, atol=1e-6)
    # no mean renormalisation (sd-scripts' strategy code; the older get_weighted_text_embeddings
    # rescaled by old_mean / new_mean): that rescaled version is not what we produce
    renormalised = weighted * (ref.mean() / weighted.mean())
    assert not torch.allclose(got, renormalised, rtol=1e-4, atol=1e-6)


def test_sdxl_weights_both_encoders_and_not_the_pooled_output(bundles):
    b = bundles["tiny-sdxl"]
    te1, te2 = b.text_encoders
    ad = family_model_for(b, weighted=True)
    with torch.no_grad():
        got = ad.encode(ad.tokenize([CAPTION]), None)
        h1 = te1(hand_ids(b.tokenizers[0], "abcde"), output_hidden_states=True).hidden_states[-2]
        out2 = te2(hand_ids(b.tokenizers[1], "abcde"), output_hidden_states=True)
    w = hand_weights(WEIGHTS)
    ref = torch.cat([h1 * w, out2.hidden_states[-2] * w], dim=-1)
    torch.testing.assert_close(got.hidden_states, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.pooled, out2.text_embeds, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-sd15", "tiny-sdxl"])
def test_unweighted_caption_gives_exactly_the_plain_conditioning(bundles, name):
    b = bundles[name]
    plain, weighted = family_model_for(b), family_model_for(b, weighted=True)
    caps = [PLAIN, "sks shape, red square", ""]
    with torch.no_grad():
        want = plain.encode(plain.tokenize(caps), None)
        got = weighted.encode(weighted.tokenize(caps), None)
    assert torch.equal(got.hidden_states, want.hidden_states)
    assert (got.pooled is None) == (want.pooled is None)
    if want.pooled is not None:
        assert torch.equal(got.pooled, want.pooled)


def test_long_caption_weights_follow_the_tokens_across_windows(bundles):
    """max_token_length 150: token 80 (in the second window) weighted 2; the joined states are the
    unweighted ones (test_long_prompts checks those against sd-scripts' windows) times the flat
    per-token weights (first BOS, 150 tokens, last state)."""
    b = bundles["tiny-sd15"]
    words = ["abcdefghijklmnopqrstuvwxyz"[i % 26] for i in range(90)]
    plain_caption = " ".join(words)
    weighted_caption = " ".join(w if i != 79 else f"({w}:2)" for i, w in enumerate(words))
    plain, weighted = family_model_for(b, 150), family_model_for(b, 150, weighted=True)
    with torch.no_grad():
        want = plain.encode(plain.tokenize([plain_caption]), None).hidden_states
        got = weighted.encode(weighted.tokenize([weighted_caption]), None).hidden_states
    w = torch.ones(152)
    w[1 + 79] = 2.0
    assert got.shape == want.shape == (1, 152, want.shape[-1])
    torch.testing.assert_close(got, want * w[None, :, None], rtol=1e-6, atol=1e-6)


def test_text_cache_key_depends_on_weighted_captions(bundles):
    b = bundles["tiny-sd15"]
    plain = text_cache.encoder_identity(b, torch.float32, None)
    assert text_cache.encoder_identity(b, torch.float32, None, weighted=False) == plain
    assert text_cache.encoder_identity(b, torch.float32, None, weighted=True) != plain


def test_train_lora_weighted_cached_equals_uncached(dataset, train, tmp_path):
    for dp, _, fs in os.walk(dataset):
        for f in fs:
            if f.endswith(".caption"):
                with open(os.path.join(dp, f), "w") as fh:
                    fh.write("(sks:1.8) shape, [[red]] square")
    base = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
            "--resolution", "64", "--max_train_steps", "2", "--learning_rate", "1e-2",
            "--optimizer_type", "torch.optim.SGD", "--network_dim", "4", "--network_alpha", "4",
            "--cache_latents", "--network_train_unet_only", "--seed", "3"]
    prompts = tmp_path / "prompts.txt"  # sample prompts are parsed the same way
    prompts.write_text("(sks:1.3) shape, [red] --w 64 --h 64 --s 2 --d 1\n")
    runs = {}
    for name, extra in [("weighted", ["--weighted_captions", "--sample_prompts", prompts,
                                      "--sample_every_n_steps", "2"]),
                        ("cached", ["--weighted_captions", "--cache_text_encoder_outputs"]),
                        ("plain", [])]:
        rc, _, err, r = train("train_lora", [*base, "--output_dir", str(tmp_path / name), *extra])
        assert rc == 0, err[-3000:]
        assert r.parts.family_model.weighted == (name != "plain")
        assert (r.parts.caches.text is not None) == (name == "cached")
        runs[name], _ = read(str(tmp_path / name / "last.safetensors"))
    assert len(os.listdir(tmp_path / "weighted" / "sample")) == 1
    ups = [k for k in runs["plain"] if k.endswith("lora_up.weight")]
    assert any(runs["weighted"][k].abs().sum() > 0 for k in ups)  # it trained
    for k in runs["weighted"]:
        torch.testing.assert_close(runs["cached"][k], runs["weighted"][k], rtol=1e-5, atol=1e-7)
    # the weights change the conditioning and so the training
    assert any(not torch.allclose(runs["weighted"][k], runs["plain"][k], atol=1e-7) for k in ups)
