"""Family models: tokenization, text encoding (clip_skip, SDXL concat + pooled), U-Net calls."""
import pytest
import torch

from library.models.family import FamilyError, TextConditioning, family_model_for
from library.models.loading import load_model_bundle

CAPTIONS = ["a photo of a sks dog", "a red cat"]


@pytest.fixture(scope="module")
def bundles():
    return {name: load_model_bundle(name) for name in ("tiny-sd15", "tiny-sd2", "tiny-sdxl")}


def test_tokenize_pads_and_truncates(bundles):
    ad = family_model_for(bundles["tiny-sd15"])
    tok = bundles["tiny-sd15"].tokenizers[0]
    (ids,) = ad.tokenize(CAPTIONS + ["dog " * 200])
    assert ids.shape == (3, 77) and ids.dtype == torch.long
    assert ids[0, 0] == tok.bos_token_id
    n = len(tok("a photo of a sks dog").input_ids)
    assert ids[0, n - 1] == tok.eos_token_id and (ids[0, n:] == tok.pad_token_id).all()
    assert ids[2, -1] == tok.eos_token_id  # truncated text still ends with EOS
    ids_xl = family_model_for(bundles["tiny-sdxl"]).tokenize(CAPTIONS)
    assert len(ids_xl) == 2 and all(t.shape == (2, 77) for t in ids_xl)


@pytest.mark.parametrize("name", ["tiny-sd15", "tiny-sd2"])
def test_clip_skip_matches_sd_scripts(bundles, name):
    b = bundles[name]
    ad = family_model_for(b)
    ids = ad.tokenize(CAPTIONS)
    te = b.text_encoders[0]
    with torch.no_grad():
        last = ad.encode(ids, None).hidden_states
        one = ad.encode(ids, 1).hidden_states
        two = ad.encode(ids, 2).hidden_states
        out = te(ids[0], output_hidden_states=True)
        norm = getattr(te, "text_model", te).final_layer_norm
        manual_two = norm(out.hidden_states[-2])
    assert torch.equal(last, one) and torch.equal(last, out.last_hidden_state)
    assert not torch.allclose(two, one)
    assert torch.allclose(two, manual_two, atol=1e-6)
    assert two.shape == (2, 77, te.config.hidden_size)
    assert ad.encode(ids, None).pooled is None
    with pytest.raises(FamilyError, match="clip_skip"):
        ad.encode(ids, te.config.num_hidden_layers + 1)


def test_sdxl_encode_concatenates_penultimate_layers(bundles):
    b = bundles["tiny-sdxl"]
    ad = family_model_for(b)
    ids = ad.tokenize(CAPTIONS)
    te1, te2 = b.text_encoders
    with torch.no_grad():
        cond = ad.encode(ids, None)
        h1 = te1(ids[0], output_hidden_states=True).hidden_states[-2]
        out2 = te2(ids[1], output_hidden_states=True)
    w1, w2 = te1.config.hidden_size, te2.config.hidden_size
    assert cond.hidden_states.shape == (2, 77, w1 + w2)
    assert cond.hidden_states.shape[-1] == b.unet.config.cross_attention_dim
    assert torch.equal(cond.hidden_states[..., :w1], h1)
    assert torch.equal(cond.hidden_states[..., w1:], out2.hidden_states[-2])
    assert cond.pooled.shape == (2, te2.config.projection_dim)
    assert torch.equal(cond.pooled, out2.text_embeds)


@pytest.mark.parametrize("name,family", [("tiny-sd15", "sd1"), ("tiny-sd2", "sd2"), ("tiny-sdxl", "sdxl")])
def test_unet_forward_shape(bundles, name, family):
    b = bundles[name]
    ad = family_model_for(b)
    assert ad.family == family
    latents = torch.randn(2, 4, 8, 8)
    t = torch.tensor([10, 500])
    with torch.no_grad():
        cond = ad.encode(ad.tokenize(CAPTIONS), None)
        size = torch.tensor([[64, 64, 0, 0, 64, 64]] * 2, dtype=torch.float32)
        pred = ad.unet_forward(latents, t, cond, size)
    assert pred.shape == latents.shape and torch.isfinite(pred).all()


def test_sdxl_size_conditioning_is_required_and_used(bundles):
    ad = family_model_for(bundles["tiny-sdxl"])
    latents = torch.randn(1, 4, 8, 8)
    t = torch.tensor([100])
    with torch.no_grad():
        cond = ad.encode(ad.tokenize(CAPTIONS[:1]), None)
        with pytest.raises(FamilyError, match="size conditioning"):
            ad.unet_forward(latents, t, cond, None)
        with pytest.raises(FamilyError, match="shape"):
            ad.unet_forward(latents, t, cond, torch.zeros(1, 4))
        a = ad.unet_forward(latents, t, cond, torch.tensor([[64., 64, 0, 0, 64, 64]]))
        b = ad.unet_forward(latents, t, cond, torch.tensor([[128., 96, 8, 0, 64, 64]]))
        c = ad.unet_forward(latents, t, TextConditioning(cond.hidden_states, cond.pooled * 0),
                            torch.tensor([[64., 64, 0, 0, 64, 64]]))
    assert not torch.allclose(a, b) and not torch.allclose(a, c)


def test_unknown_family_is_an_error(bundles):
    class Fake:
        family = "sd3"

    with pytest.raises(FamilyError, match="sd3"):
        family_model_for(Fake())
