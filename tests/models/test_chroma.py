"""The Chroma transformer (library/models/families/chroma/) against diffusers'
ChromaTransformer2DModel holding the same weights through diffusers' own single-file conversion
(convert_chroma_transformer_checkpoint_to_diffusers, as ComfyUI / sd-scripts files load there),
its files in both layouts, and the approximator's input against a hand computation."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from library.models.families.flux import flux
from library.models.families.chroma import checkpoint
from library.models.families.chroma.model import CHROMA1, TINY_CHROMA, Chroma, chroma_mask
from tests.models.test_flux import _split_at_width

SMALL = dataclasses.replace(TINY_CHROMA, depth=1, depth_single_blocks=2)


def reference_to_diffusers(state_dict: dict, hidden: int) -> dict:
    """Original-layout tensors -> diffusers' by diffusers' conversion (its single-block split has
    Chroma's widths written in: replaced at a tiny width, as tests/models/test_flux.py does); it
    pops what it converts, so a left-over key is one diffusers would not read."""
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    left = dict(state_dict)
    with _split_at_width(hidden):
        out = convert_chroma_transformer_checkpoint_to_diffusers(left)
    assert not left, sorted(left)[:5]
    return out


def reference_model(state_dict: dict, config):
    from diffusers import ChromaTransformer2DModel

    kw = {k: v for k, v in checkpoint.diffusers_config(config).items() if not k.startswith("_")}
    model = ChromaTransformer2DModel(**kw).eval()
    model.load_state_dict(reference_to_diffusers(state_dict, config.hidden_size), strict=True)
    return model


def random_chroma(config, seed: int = 0) -> Chroma:
    """A Chroma with every tensor random (the RMS norm scales too, which start at one)."""
    torch.manual_seed(seed)
    model = Chroma(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _inputs(config, batch=2, h=2, w=3, n_txt=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(batch, 16, 2 * h, 2 * w, generator=g)
    return dict(img=flux.pack_latents(lat), img_ids=flux.image_ids(h, w, batch),
                txt=torch.randn(batch, n_txt, config.context_in_dim, generator=g),
                txt_ids=flux.text_ids(n_txt, batch), timesteps=torch.tensor([0.3, 0.85]))


def _diffusers_forward(model, x, mask):
    """As diffusers' ChromaPipeline calls it: the prompt mask keeps the first padding token
    (``mask_indices <= seq_lengths``), then ones for the image tokens."""
    kwargs = {}
    if mask is not None:
        lengths = mask.sum(dim=1, keepdim=True)
        txt = torch.arange(mask.shape[1])[None, :] <= lengths
        kwargs["attention_mask"] = torch.cat([txt, torch.ones(mask.shape[0], x["img"].shape[1], dtype=torch.bool)], 1)
    return model(hidden_states=x["img"], encoder_hidden_states=x["txt"], timestep=x["timesteps"],
                 img_ids=x["img_ids"][0], txt_ids=x["txt_ids"][0], return_dict=False, **kwargs)[0]


def _close(a, b, rel=2e-5):
    # float32 through three blocks of width 64: the same sums in nearly the same order; the
    # approximator's RMS norms add 1e-6 to the mean square here (BFL's, sd-scripts' and ComfyUI's
    # eps) and float32's machine epsilon in diffusers' nn.RMSNorm, a relative change of
    # eps / (2 mean(x^2)) ~ 1e-6 of the modulations at these magnitudes; 2e-5 of the output's
    # scale bounds both with a margin for another SDPA kernel
    assert (a - b).abs().max() <= rel * b.abs().max(), float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("masked", [False, True])
def test_forward_matches_diffusers(masked):
    ours = random_chroma(SMALL)
    ref = reference_model(ours.state_dict(), SMALL)
    x = _inputs(SMALL)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]) if masked else None
    with torch.no_grad():
        a = ours(**x, txt_attention_mask=mask)
        b = _diffusers_forward(ref, x, mask)
    assert a.shape == (2, 6, 64)
    _close(a, b)


def test_first_padding_token_is_attended_and_the_rest_are_not():
    """Chroma's mask: the padded T5 tokens after the first change nothing; the first one does."""
    model = random_chroma(SMALL)
    x = _inputs(SMALL)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    assert torch.equal(chroma_mask(mask), torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]))
    with torch.no_grad():
        a = model(**x, txt_attention_mask=mask)
        later = dict(x, txt=x["txt"].clone())
        later["txt"][0, 4:] += 5.0
        later["txt"][1, 5:] += 5.0
        assert torch.equal(a, model(**later, txt_attention_mask=mask))
        first = dict(x, txt=x["txt"].clone())
        first["txt"][0, 3] += 5.0
        assert float((model(**first, txt_attention_mask=mask)[0] - a[0]).abs().max()) > 1e-4


def test_approximator_input_against_hand_formula():
    """[timestep, guidance 0, modulation index] sinusoidal embeddings (cos first, x1000), by hand
    in float64."""
    model = Chroma(SMALL)
    t = torch.tensor([0.25, 0.9])
    got = model.approximator_input(t).double()
    n, q = SMALL.mod_count, SMALL.approximator_in_dim // 4

    def emb(v, dim):
        half = dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half)
        a = 1000 * torch.as_tensor(v, dtype=torch.float64)[..., None] * freqs
        return torch.cat([a.cos(), a.sin()], dim=-1)

    assert got.shape == (2, n, 4 * q) and n == 3 * 2 + 12 * 1 + 2
    for i in range(2):
        for k in (0, 7, n - 1):
            want = torch.cat([emb(float(t[i]), q), emb(0.0, q), emb(float(k), 2 * q)])
            torch.testing.assert_close(got[i, k], want, rtol=0, atol=2e-3)  # float32 angles up to 1000 n


def test_files_in_both_layouts_round_trip(tmp_path):
    """The original single file and a diffusers transformer folder: written and read back bit for
    bit, the folder's tensors exactly diffusers' conversion of the original ones, and detection
    from keys / config."""
    model = random_chroma(SMALL)
    sd = model.state_dict()
    ref = reference_to_diffusers(sd, SMALL.hidden_size)
    assert set(checkpoint.to_diffusers(sd, SMALL)) == set(ref)
    assert all(torch.equal(checkpoint.to_diffusers(sd, SMALL)[k], ref[k]) for k in ref)
    for layout, path in (("original", tmp_path / "chroma.safetensors"), ("diffusers", tmp_path / "transformer")):
        checkpoint.save_transformer(str(path), sd, layout, SMALL)
        w = checkpoint.read_transformer(str(path))
        assert (w.layout, w.config) == (layout, SMALL)
        assert all(torch.equal(w.state_dict[k], v) for k, v in sd.items()) and set(w.state_dict) == set(sd)
    assert checkpoint.transformer_folder(str(tmp_path / "transformer")) is not None


def test_full_size_keys_and_shapes_match_diffusers():
    """At Chroma1's full size (19 double, 38 single blocks, approximator 5 x 5120), on the meta
    device: diffusers' unpatched conversion of our state dict consumes every tensor and gives
    exactly the names and shapes of diffusers' ChromaTransformer2DModel; our config read back
    from the shapes is Chroma1's."""
    from diffusers import ChromaTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    with torch.device("meta"):
        ours = Chroma(CHROMA1)
        ref = ChromaTransformer2DModel()
    sd = ours.state_dict()
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    left = dict(sd)
    conv = convert_chroma_transformer_checkpoint_to_diffusers(left)
    assert not left
    assert {k: tuple(v.shape) for k, v in conv.items()} == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert checkpoint.config_from_original(sd, "x") == CHROMA1
    assert checkpoint.layout_of(sd) == "original" and checkpoint.layout_of(conv) == "diffusers"
    assert checkpoint.layout_of({"model.diffusion_model." + k for k in sd}) == "original"
