"""The FLUX.1 transformer (library/models/families/flux/flux.py) against diffusers' FluxTransformer2DModel loaded
through diffusers' own BFL -> diffusers conversion, and the packing / position ids against hand
tables."""
import contextlib
import dataclasses

import pytest
import torch

from library.models.families.flux import flux
from library.models.families.flux import flux_checkpoint

# diffusers' convert_flux_transformer_checkpoint_to_diffusers splits a single block's linear1 with
# FLUX.1's widths written in (3072 x 3 + 12288); at a tiny width only those sizes are replaced (by
# hidden x 3 + the rest), everything else is diffusers' code.
_FULL_SPLIT = (3072, 3072, 3072, 12288)


@contextlib.contextmanager
def _split_at_width(hidden: int):
    orig = torch.split

    def split(t, sizes, dim=0):
        if isinstance(sizes, (tuple, list)) and tuple(sizes) == _FULL_SPLIT and hidden != 3072:
            sizes = (hidden, hidden, hidden, t.shape[dim] - 3 * hidden)
        return orig(t, sizes, dim)

    torch.split = split
    try:
        yield
    finally:
        torch.split = orig


def reference_to_diffusers(state_dict: dict, hidden: int) -> dict:
    """BFL tensors -> diffusers tensors by diffusers' single-file conversion."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    with _split_at_width(hidden):
        return convert_flux_transformer_checkpoint_to_diffusers(dict(state_dict))


def reference_model(state_dict: dict, config: flux.FluxConfig):
    """diffusers' FluxTransformer2DModel holding the same weights."""
    from diffusers import FluxTransformer2DModel

    kw = {k: v for k, v in flux_checkpoint.diffusers_config(config).items() if not k.startswith("_")}
    model = FluxTransformer2DModel(**kw).eval()
    model.load_state_dict(reference_to_diffusers(state_dict, config.hidden_size), strict=True)
    return model


def random_flux(config: flux.FluxConfig, seed: int = 0) -> flux.Flux:
    """A Flux with every tensor random (the RMS norm scales too, which start at one)."""
    torch.manual_seed(seed)
    model = flux.Flux(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


SMALL = dataclasses.replace(flux.TINY_FLUX_DEV, depth=1, depth_single_blocks=2)
CONFIGS = {"dev": SMALL, "schnell": dataclasses.replace(SMALL, guidance_embed=False)}


def _inputs(config, batch=2, h=2, w=3, n_txt=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(batch, 16, 2 * h, 2 * w, generator=g)
    return dict(img=flux.pack_latents(lat), img_ids=flux.image_ids(h, w, batch),
                txt=torch.randn(batch, n_txt, config.context_in_dim, generator=g),
                txt_ids=flux.text_ids(n_txt, batch), timesteps=torch.rand(batch, generator=g),
                y=torch.randn(batch, config.vec_in_dim, generator=g),
                guidance=torch.tensor([3.5, 1.0]) if config.guidance_embed else None)


def _diffusers_forward(model, x, mask=None):
    kwargs = None if mask is None else {"attention_mask": flux.joint_attention_mask(mask, x["img"].shape[1])}
    return model(hidden_states=x["img"], encoder_hidden_states=x["txt"], pooled_projections=x["y"],
                 timestep=x["timesteps"], img_ids=x["img_ids"][0], txt_ids=x["txt_ids"][0],
                 guidance=x["guidance"], joint_attention_kwargs=kwargs, return_dict=False)[0]


def _close(a, b, rel=1e-5):
    # float32 through a few blocks of width 64: the two implementations order the same sums the
    # same way or nearly (measured max difference 0); 1e-5 of the output's scale leaves room
    # for a different SDPA kernel.
    assert (a - b).abs().max() <= rel * b.abs().max(), float((a - b).abs().max())


@pytest.mark.parametrize("variant", ["dev", "schnell"])
@pytest.mark.parametrize("masked", [False, True])
def test_forward_matches_diffusers(variant, masked):
    config = CONFIGS[variant]
    ours = random_flux(config)
    ref = reference_model(ours.state_dict(), config)
    x = _inputs(config)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]) if masked else None
    with torch.no_grad():
        a = ours(**x, txt_attention_mask=mask)
        b = _diffusers_forward(ref, x, mask)
    assert a.shape == (2, 6, 64)
    _close(a, b)


def test_t5_mask_hides_padded_tokens():
    """With the mask, the values of padded T5 tokens cannot reach the image output; without it
    they do (so the first check can fail)."""
    config = CONFIGS["dev"]
    model = random_flux(config)
    x = _inputs(config)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    x2 = dict(x, txt=x["txt"].clone())
    x2["txt"][mask == 0] += 5.0
    with torch.no_grad():
        a, b = model(**x, txt_attention_mask=mask), model(**x2, txt_attention_mask=mask)
        c, d = model(**x), model(**x2)
    assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert (c - d).abs().max() > 1e-2


def test_dev_needs_guidance():
    config = CONFIGS["dev"]
    x = dict(_inputs(config), guidance=None)
    with pytest.raises(ValueError, match="guidance"):
        random_flux(config)(**x)


def test_pack_unpack_against_hand_index():
    torch.manual_seed(0)
    lat = torch.randn(2, 16, 4, 6)
    tokens = flux.pack_latents(lat)
    assert tokens.shape == (2, 6, 64)
    for i in range(2):
        for j in range(3):
            for c in (0, 7, 15):
                for pi in (0, 1):
                    for pj in (0, 1):
                        # token (row i, column j), feature (channel, patch row, patch column)
                        assert tokens[1, i * 3 + j, c * 4 + pi * 2 + pj] == lat[1, c, 2 * i + pi, 2 * j + pj]
    assert torch.equal(flux.unpack_latents(tokens, 2, 3), lat)
    t = torch.randn(1, 12, 64)
    assert torch.equal(flux.pack_latents(flux.unpack_latents(t, 3, 4)), t)
    with pytest.raises(ValueError):
        flux.pack_latents(torch.zeros(1, 16, 5, 6))


def test_position_ids_table():
    table = [[0, 0, 0], [0, 0, 1], [0, 0, 2],
             [0, 1, 0], [0, 1, 1], [0, 1, 2]]  # (0, row, column) of a 2 x 3 patch grid, row-major
    ids = flux.image_ids(2, 3, batch_size=2)
    assert ids.shape == (2, 6, 3)
    assert ids[0].tolist() == table and ids[1].tolist() == table
    assert flux.text_ids(4, 2).shape == (2, 4, 3) and not flux.text_ids(4, 2).any()


def test_rope_and_timestep_embedding_against_float64():
    pos = torch.tensor([[0.0, 1.0, 5.0]])
    cos, sin = flux.rope(pos, 8, 10_000)
    i = torch.arange(4, dtype=torch.float64)
    angles = pos.double()[..., None] * 10_000.0 ** (-2 * i / 8)
    assert torch.allclose(cos.double(), angles.cos(), atol=1e-7) and torch.allclose(sin.double(), angles.sin(), atol=1e-7)
    t = torch.tensor([0.25, 1.0])
    emb = flux.timestep_embedding(t, 8)
    freqs = torch.exp(-torch.log(torch.tensor(10000.0, dtype=torch.float64)) * i / 4)
    args = 1000 * t.double()[:, None] * freqs
    assert torch.allclose(emb.double(), torch.cat([args.cos(), args.sin()], dim=1), atol=1e-4)


def test_gradient_checkpointing_same_gradients():
    config = CONFIGS["dev"]
    x = _inputs(config)
    grads = []
    for ckpt in (False, True):
        model = random_flux(config).train()
        if ckpt:
            model.enable_gradient_checkpointing()
        model(**x, txt_attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1] * 5])).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7), n


def test_state_dict_keys_are_bfl():
    keys = set(flux.Flux(flux.TINY_FLUX_DEV).state_dict())
    for k in ("img_in.weight", "time_in.in_layer.weight", "time_in.out_layer.bias", "vector_in.in_layer.weight",
              "guidance_in.out_layer.weight", "txt_in.bias", "double_blocks.1.img_mod.lin.weight",
              "double_blocks.0.img_attn.qkv.weight", "double_blocks.0.img_attn.norm.query_norm.scale",
              "double_blocks.0.txt_attn.norm.key_norm.scale", "double_blocks.0.img_attn.proj.bias",
              "double_blocks.0.img_mlp.0.weight", "double_blocks.0.img_mlp.2.bias", "double_blocks.0.txt_mod.lin.bias",
              "double_blocks.0.txt_mlp.2.weight", "single_blocks.1.linear1.weight", "single_blocks.0.linear2.bias",
              "single_blocks.0.norm.query_norm.scale", "single_blocks.0.norm.key_norm.scale",
              "single_blocks.0.modulation.lin.weight", "final_layer.adaLN_modulation.1.weight",
              "final_layer.linear.bias"):
        assert k in keys, k
    assert not any("guidance_in" in k for k in flux.Flux(flux.TINY_FLUX_SCHNELL).state_dict())
    assert len(keys) == 16 + 2 * 24 + 2 * 8 + 4  # embedders, 2 double and 2 single blocks, final layer


@pytest.mark.slow
def test_full_width_blocks_match_diffusers_unpatched():
    """FLUX.1's real width, heads and RoPE axes (3072, 24 x 128, 16/56/56), one block of each kind
    (narrow text inputs keep it to ~0.5 G parameters): diffusers' conversion runs unpatched."""
    config = dataclasses.replace(flux.FLUX_DEV, depth=1, depth_single_blocks=1, context_in_dim=64, vec_in_dim=32)
    torch.manual_seed(0)
    ours = flux.Flux(config).eval()
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    kw = {k: v for k, v in flux_checkpoint.diffusers_config(config).items() if not k.startswith("_")}
    ref = FluxTransformer2DModel(**kw).eval()
    ref.load_state_dict(convert_flux_transformer_checkpoint_to_diffusers(dict(ours.state_dict())), strict=True)
    x = _inputs(config, h=3, w=4, n_txt=7)
    mask = torch.tensor([[1] * 4 + [0] * 3, [1] * 7])
    with torch.no_grad():
        # measured: max difference 3.6e-7 at an output scale of 2.0 (1.8e-7 relative)
        _close(ours(**x, txt_attention_mask=mask), _diffusers_forward(ref, x, mask))


@pytest.mark.parametrize("config,params", [(flux.FLUX_DEV, 11_901_408_320), (flux.FLUX_SCHNELL, 11_891_178_560)])
def test_full_size_keys_and_shapes_match_diffusers(config, params):
    """At FLUX.1's full size (19 double, 38 single blocks), on the meta device: diffusers' unpatched
    conversion of our state dict gives exactly the tensors (names and shapes) of diffusers'
    FluxTransformer2DModel of the same config, and so does our mapping."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    kw = {k: v for k, v in flux_checkpoint.diffusers_config(config).items() if not k.startswith("_")}
    with torch.device("meta"):
        ours = flux.Flux(config)
        ref = FluxTransformer2DModel(**kw)
    want = {k: v.shape for k, v in ref.state_dict().items()}
    sd = ours.state_dict()
    for converted in (convert_flux_transformer_checkpoint_to_diffusers(dict(sd)),
                      flux_checkpoint.bfl_to_diffusers(sd, config)):
        assert {k: v.shape for k, v in converted.items()} == want
    assert sum(p.numel() for p in ours.parameters()) == params


def test_fp8_base_machinery_covers_the_transformer():
    """fp8_base's existing layer swap (library/models/fp8.py) takes every Linear of the FLUX
    transformer (all of its weight matrices): the forward equals a float32 model whose weights are
    rounded to float8, and gradients reach the input through the up-casting backward."""
    import copy

    from library.models import fp8

    config = CONFIGS["dev"]
    model = random_flux(config)
    rounded = copy.deepcopy(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(fp8.eligible(m) for m in linears)
    with torch.no_grad():
        for m in linears:
            m.weight.data = m.weight.data.to(fp8.FP8)
        for m in rounded.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(m.weight.to(fp8.FP8).float())
    assert fp8.install_forward(model, torch.float32) == len(linears)
    x = _inputs(config)
    img = x["img"].clone().requires_grad_(True)
    out = model(**dict(x, img=img))
    with torch.no_grad():
        want = rounded(**x)
    assert torch.equal(out.detach(), want)
    out.square().mean().backward()
    assert img.grad is not None and torch.isfinite(img.grad).all() and img.grad.abs().sum() > 0
