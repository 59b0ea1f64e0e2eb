"""Lumina Image 2.0's Next-DiT against diffusers' Lumina2Transformer2DModel on the same tiny
weights (through the single-file -> diffusers key mapping), its file layouts, and the text side
(system prompt, token mask) against hand references."""
from __future__ import annotations

import pytest
import torch
from diffusers import Lumina2Transformer2DModel

from library.models.families.lumina import layout, nextdit, text

# float32 forwards of a 4-block tiny model: the two implementations differ only in summation order
# (~1e-7 relative per op, a few hundred ops deep); a wrong mapping or formula differs by O(1)
ATOL = 2e-5


def _random_model(seed: int = 0) -> nextdit.NextDiT:
    torch.manual_seed(seed)
    model = nextdit.NextDiT(nextdit.TINY).eval()
    with torch.no_grad():  # every tensor random, norms too, so each mapped key carries signal
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0.0))
    return model


def _diffusers_twin(model: nextdit.NextDiT) -> Lumina2Transformer2DModel:
    cfg = {k: v for k, v in layout.diffusers_config(model.config).items() if k != "_class_name"}
    ref = Lumina2Transformer2DModel(**cfg).eval()
    sd = layout.to_diffusers(model.state_dict(), model.config)
    missing, unexpected = ref.load_state_dict(sd, strict=True), None
    assert not missing.missing_keys and not missing.unexpected_keys, unexpected
    # diffusers builds its q/k norms with eps 1e-5; the original model (sd-scripts, Alpha-VLLM) 1e-6
    for m in ref.modules():
        if hasattr(m, "norm_q") and m.norm_q is not None:
            m.norm_q.eps = m.norm_k.eps = 1e-6
    return ref


def _inputs(b=2, h=8, w=12, n_cap=9, lens=(9, 5)):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, 16, h, w, generator=g)
    cap = torch.randn(b, n_cap, nextdit.TINY.cap_feat_dim, generator=g)
    mask = torch.zeros(b, n_cap, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    t = torch.tensor([0.3, 0.85])[:b]
    return x, t, cap, mask


@pytest.mark.parametrize("lens", [(9, 5), (7, 7)])
def test_forward_equals_diffusers(lens):
    """Captions of different lengths (the joint mask) and equal ones (no mask)."""
    torch.set_num_threads(1)
    model = _random_model()
    ref = _diffusers_twin(model)
    x, t, cap, mask = _inputs(lens=lens)
    with torch.no_grad():
        ours = model(x, t, cap, mask)
        theirs = ref(x, t, cap, mask).sample
    assert ours.shape == x.shape
    assert torch.allclose(ours, theirs, atol=ATOL, rtol=1e-4), (ours - theirs).abs().max()
    # the outputs depend on the caption (so the comparison covers the caption path)
    with torch.no_grad():
        other = model(x, t, cap.flip(1), mask)
    assert (other - ours).abs().max() > 1e-2


def test_padding_tokens_do_not_leak():
    """Masked-out caption tokens change nothing (each sample keeps its own tokens only)."""
    model = _random_model()
    x, t, cap, mask = _inputs(lens=(9, 5))
    cap2 = cap.clone()
    cap2[1, 5:] = torch.randn_like(cap2[1, 5:]) * 10
    with torch.no_grad():
        a, b = model(x, t, cap, mask), model(x, t, cap2, mask)
        alone = model(x[1:], t[1:], cap[1:, :5], mask[1:, :5])
    assert torch.equal(a, b)
    # other sequence lengths only change the summation order: float32 roundoff of outputs ~100
    assert torch.allclose(a[1:], alone, atol=1e-6 * alone.abs().max(), rtol=1e-5)


def test_layout_round_trip_and_config_from_shapes():
    model = _random_model()
    sd = model.state_dict()
    back = layout.from_diffusers(layout.to_diffusers(sd, model.config), model.config, sd["norm_final.weight"])
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    # ComfyUI's prefix, and the 2B model's config read from its shapes alone
    with torch.device("meta"):
        big = nextdit.NextDiT(nextdit.LUMINA2_2B)
    keys = {layout.COMFY_PREFIX + k: tuple(v.shape) for k, v in big.state_dict().items()}
    keys["vae.decoder.conv_in.weight"] = (512, 16, 3, 3)
    names = layout.original_keys(keys)
    assert "vae.decoder.conv_in.weight" not in names.values()
    config = layout.config_from_shapes({k: keys[v] for k, v in names.items()}, "x.safetensors")
    assert config == nextdit.LUMINA2_2B
    # diffusers' own single-file converter (its split sizes are the 2B model's) gives the same keys
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers
    ours = layout.to_diffusers({k: torch.empty(v, device="meta") for k, v in
                                ((k, keys[v]) for k, v in names.items())}, config)
    theirs = convert_lumina2_to_diffusers({k: torch.empty(keys[v], device="meta") for k, v in names.items()})
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}


def test_system_prompt_and_mask_by_hand():
    tok = text.build_tiny_tokenizer()
    assert text.with_system_prompt("a dog", "") == "a dog"
    assert text.with_system_prompt("a dog", "You are an assistant") == "You are an assistant <Prompt Start> a dog"
    vocab, _ = text.tiny_vocab()
    ids, mask = text.tokenize(tok, ["a dog", text.with_system_prompt("a dog", "are")], max_length=10)
    # max_length 10 rounds up to 16 (sd-scripts' pad_to_multiple_of 8); BOS first, pad 0 after
    assert ids.shape == mask.shape == (2, 16)
    first = [vocab["<bos>"], vocab["▁a"] if "▁a" in vocab else None, vocab["▁dog"]]
    assert ids[0, :3].tolist() == [vocab["<bos>"], vocab["a"], vocab["▁dog"]] or ids[0, :3].tolist() == first
    assert mask[0].tolist() == [1] * 3 + [0] * 13 and ids[0, 3:].eq(vocab["<pad>"]).all()
    want = [vocab["<bos>"], vocab["a"], vocab["r"], vocab["e"], vocab["▁<Prompt"], vocab["▁Start>"],
            vocab["▁a"], vocab["▁dog"]]
    assert ids[1, :8].tolist() == want and mask[1].sum() == 8


def test_attention_options_refused_without_the_kernel():
    from library.models.families.lumina import attention

    assert attention.check(False, False, cuda=False) is None
    for flags, match in (((True, False), "use_flash_attn: flash_attn's kernels run on CUDA only"),
                         ((False, True), "use_sage_attn: sageattention's kernels run on CUDA only"),
                         ((True, True), "choose one attention kernel")):
        with pytest.raises(attention.AttentionError, match=match) as e:
            attention.check(*flags, cuda=False)
        assert "\n" not in str(e.value)


def test_per_sample_kernel_path_equals_masked_sdpa():
    """The flash / sage path runs each sample over its own tokens: with SDPA as the kernel it gives
    the masked attention on every kept row (padding rows zero, dropped by the transformer)."""
    from library.models.families.lumina import attention

    model = _random_model()
    x, t, cap, mask = _inputs(lens=(9, 5))

    def sdpa_kernel(q, k, v, m, scale):
        def run(qi, ki, vi):
            return torch.nn.functional.scaled_dot_product_attention(
                qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1), scale=scale).transpose(0, 1)
        return attention._varlen(q, k, v, m, run)

    with torch.no_grad():
        want = model(x, t, cap, mask)
        for module in model.modules():
            if hasattr(module, "qkv"):
                module.kernel = sdpa_kernel
        got = model(x, t, cap, mask)
    assert torch.allclose(got, want, atol=1e-6 * want.abs().max(), rtol=1e-5)
