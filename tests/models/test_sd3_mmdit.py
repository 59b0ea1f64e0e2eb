"""The SAI-layout MMDiT (library/models/families/sd3/sd3.py) against diffusers' SD3Transformer2DModel loaded from
the same weights with diffusers' own single-file conversion."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from library.models.families.sd3 import sd3

VARIANTS = ("sd3", "sd3.5-medium", "sd3.5-large")


def _random_model(variant: str, seed: int = 0) -> sd3.MMDiT:
    torch.manual_seed(seed)
    model = sd3.build_mmdit(sd3.tiny_config(variant)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("ln_q.weight", "ln_k.weight")):
                p.uniform_(0.5, 1.5)  # a qk norm weight of ones would hide a missing or swapped norm
    return model


def _diffusers_config(cfg: sd3.MMDiTConfig) -> dict:
    return {"_class_name": "SD3Transformer2DModel", "sample_size": cfg.sample_size, "patch_size": cfg.patch_size,
            "in_channels": cfg.in_channels, "out_channels": cfg.in_channels, "num_layers": cfg.depth,
            "attention_head_dim": sd3.HEAD_DIM, "num_attention_heads": cfg.num_heads,
            "joint_attention_dim": cfg.context_dim, "caption_projection_dim": cfg.hidden_size,
            "pooled_projection_dim": cfg.adm_in_channels, "pos_embed_max_size": cfg.pos_embed_max_size,
            "dual_attention_layers": list(cfg.x_block_self_attn_layers),
            "qk_norm": "rms_norm" if cfg.qk_norm else None}


def _diffusers_from_sai(model: sd3.MMDiT, tmp_path) -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import save_file

    path = os.path.join(tmp_path, "sd3.safetensors")
    save_file({sd3.PREFIX + k: v.contiguous() for k, v in model.state_dict().items()}, path)
    os.makedirs(os.path.join(tmp_path, "cfg", "transformer"))
    with open(os.path.join(tmp_path, "cfg", "transformer", "config.json"), "w") as f:
        json.dump(_diffusers_config(model.config), f)
    return SD3Transformer2DModel.from_single_file(path, config=os.path.join(tmp_path, "cfg"), subfolder="transformer",
                                                  local_files_only=True, torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_matches_diffusers(variant, tmp_path):
    model = _random_model(variant)
    ref = _diffusers_from_sai(model, tmp_path)
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    x = torch.randn(2, 16, 8, 6, generator=g)  # not square: rows and columns must not be swapped
    t = torch.tensor([250.0, 875.0])
    y = torch.randn(2, cfg.adm_in_channels, generator=g)
    ctx = torch.randn(2, 9, cfg.context_dim, generator=g)
    with torch.no_grad():
        ours = model(x, t, y, ctx)
        theirs = ref(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=y, timestep=t).sample
    assert ours.shape == x.shape
    # float32, the same products in a different order: ~1e-7 relative; 1e-5 leaves room for BLAS.
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    assert rel < 1e-5, rel
    assert theirs.norm() > 0.1  # not a trivially zero output


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_read_back_from_weights(variant):
    model = _random_model(variant)
    sd = {sd3.PREFIX + k: v for k, v in model.state_dict().items()}
    cfg = sd3.config_from_state_dict(sd)
    assert cfg == dataclasses.replace(model.config, sample_size=sd3.MMDiTConfig(depth=1).sample_size)
    assert cfg.variant == variant


def test_released_configs_and_key_names():
    # The key names and shapes of SAI's files (diffusers' model-type detection reads these).
    assert sd3.SD3_MEDIUM.hidden_size == 1536 and sd3.SD35_LARGE.hidden_size == 2432
    assert sd3.SD35_MEDIUM.pos_embed_max_size ** 2 == 147456 and sd3.SD3_MEDIUM.pos_embed_max_size ** 2 == 36864
    with torch.device("meta"):
        keys = sd3.MMDiT(sd3.SD35_MEDIUM).state_dict()
    assert keys["joint_blocks.0.context_block.adaLN_modulation.1.bias"].shape[-1] == 9216
    assert "joint_blocks.12.x_block.attn2.ln_k.weight" in keys and "joint_blocks.13.x_block.attn2.qkv.weight" not in keys
    assert "joint_blocks.23.context_block.attn.proj.weight" not in keys  # the last context block is pre-only
    assert "joint_blocks.23.context_block.mlp.fc1.weight" not in keys
    assert keys["joint_blocks.23.context_block.adaLN_modulation.1.weight"].shape == (2 * 1536, 1536)
    assert keys["final_layer.linear.weight"].shape == (2 * 2 * 16, 1536)
    assert keys["pos_embed"].shape == (1, 147456, 1536)


def test_fresh_position_table_is_diffusers_table():
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    cfg = sd3.TINY
    ours = sd3.MMDiT(cfg).pos_embed[0]
    ref = get_2d_sincos_pos_embed(cfg.hidden_size, cfg.pos_embed_max_size, base_size=cfg.sample_size // 2)
    assert torch.allclose(ours, ref.float(), atol=1e-6)


def test_bad_weights_are_one_line_errors():
    model = _random_model("sd3")
    sd = model.state_dict()
    with pytest.raises(sd3.SD3ModelError, match="no pos_embed"):
        sd3.config_from_state_dict({k: v for k, v in sd.items() if k != "pos_embed"}, "f.safetensors")
    broken = dict(sd)
    del broken["joint_blocks.0.x_block.mlp.fc1.bias"]
    with pytest.raises(sd3.SD3ModelError, match="missing .*mlp.fc1.bias"):
        sd3.build_mmdit(model.config, broken, "f.safetensors")
    wrong = dict(sd, **{"y_embedder.mlp.0.weight": torch.zeros(128, 7)})
    with pytest.raises(sd3.SD3ModelError, match=r"y_embedder.mlp.0.weight has shape \[128, 7\]"):
        sd3.build_mmdit(model.config, wrong, "f.safetensors")
    with pytest.raises(sd3.SD3ModelError, match="exceed"):
        model(torch.zeros(1, 16, 40, 8), torch.zeros(1), torch.zeros(1, 96), torch.zeros(1, 3, 128))


def test_gradient_checkpointing_same_output_and_gradients():
    model = _random_model("sd3.5-medium").train()
    g = torch.Generator().manual_seed(2)
    args = (torch.randn(1, 16, 4, 4, generator=g), torch.tensor([300.0]), torch.randn(1, 96, generator=g),
            torch.randn(1, 5, 128, generator=g))
    plain = model(*args)
    plain.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.enable_gradient_checkpointing()
    ckpt = model(*args)
    ckpt.square().mean().backward()
    assert torch.equal(ckpt, plain)
    assert all(torch.allclose(p.grad, grads[n], rtol=1e-5, atol=1e-8) for n, p in model.named_parameters())


@pytest.mark.parametrize("config, diffusers_type", [(sd3.SD3_MEDIUM, "sd3"), (sd3.SD35_MEDIUM, "sd35_medium"),
                                                    (sd3.SD35_LARGE, "sd35_large")])
def test_released_configs_are_what_diffusers_recognises(config, diffusers_type):
    # diffusers tells the released files apart by key names and shapes: the full-size configs
    # (built on the meta device: shapes only) must produce those
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    with torch.device("meta"):
        sd = {sd3.PREFIX + k: v for k, v in sd3.MMDiT(config).state_dict().items()}
    assert infer_diffusers_model_type(sd) == diffusers_type
    assert sd3.config_from_state_dict(sd) == dataclasses.replace(config, sample_size=128)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_weight_reaches_the_output(variant):
    # a flow-matching step (target noise - latents) gives every parameter a non-zero gradient: no
    # weight that the file holds but the forward ignores. One exception, SAI's too: the last
    # (pre-only) context block's outputs are dropped, so its queries, and their qk norm, reach nothing.
    model = _random_model(variant).train()
    g = torch.Generator().manual_seed(3)
    latents, noise = torch.randn(2, 16, 4, 4, generator=g), torch.randn(2, 16, 4, 4, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    noisy = (1 - sigma[:, None, None, None]) * latents + sigma[:, None, None, None] * noise
    pred = model(noisy, sigma * 1000, torch.randn(2, 96, generator=g), torch.randn(2, 5, 128, generator=g))
    torch.nn.functional.mse_loss(pred, noise - latents).backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    last = model.config.depth - 1
    assert dead == ([f"joint_blocks.{last}.context_block.attn.ln_q.weight"] if model.config.qk_norm else []), dead


# --- SD3.5's position-embedding options (library/models/families/sd3/sd3_positions.py) ----------------------

def _hand_table(dim: int, positions: list[float]) -> torch.Tensor:
    """A float64 sin-cos table written out feature by feature: patch (r, c) holds
    sin(p_c w_k), cos(p_c w_k), then sin(p_r w_k), cos(p_r w_k), w_k = 10000^(-k / (dim / 4))."""
    import math

    q = dim // 4
    n = len(positions)
    out = torch.zeros(n * n, dim, dtype=torch.float64)
    for r in range(n):
        for c in range(n):
            for k in range(q):
                w = 10000.0 ** (-k / q)
                out[r * n + c, k] = math.sin(positions[c] * w)
                out[r * n + c, q + k] = math.cos(positions[c] * w)
                out[r * n + c, 2 * q + k] = math.sin(positions[r] * w)
                out[r * n + c, 3 * q + k] = math.cos(positions[r] * w)
    return out


def _sd_scripts_positions(grid: int, sample_size: int, base: int = 16) -> list[float]:
    """sd-scripts' get_scaled_2d_sincos_pos_embed coordinates, as its code computes them (in
    float64): arange(grid) / grid x scale - shift, scale = base grid / sample_size, shift =
    scale (grid - sample_size) / (2 grid)."""
    scale = base * grid / sample_size
    shift = scale * (grid - sample_size) / (2 * grid)
    return [i / grid * scale - shift for i in range(grid)]


@pytest.mark.parametrize("grid, sample_size", [(6, 4), (12, 8), (7, 5)])
def test_scaled_table_is_sd_scripts_formula(grid, sample_size):
    from library.models.families.sd3 import sd3_positions

    got = sd3_positions.scaled_table(32, grid, sample_size).double()
    want = _hand_table(32, _sd_scripts_positions(grid, sample_size))
    assert float((got - want).abs().max()) <= 1e-6  # float32 storage of values in [-1, 1]
    # the centre sample_size x sample_size patches span the positions of 16 patches
    pos = _sd_scripts_positions(grid, sample_size)
    top = (grid - sample_size) // 2
    assert pos[top + sample_size - 1] - pos[top] == pytest.approx(16 * (sample_size - 1) / sample_size)


def test_scaled_table_choice_by_area():
    """sd-scripts' selection: the first size whose area limit (midpoints of consecutive areas,
    int((1.5 s)^2) for the last) holds h x w, else the largest; a side beyond that table's
    int(1.5 s) grid gets a table of max(h, w) of its own."""
    from library.models.families.sd3 import sd3_positions

    s = sd3_positions.ScaledPosEmbed(32, [32, 16, 32])  # patched sizes; duplicates collapse
    assert s.sizes == [16, 32] and s.limits == [(16 * 16 + 32 * 32) // 2, 48 * 48]
    assert s.size_for(24, 24) == 16 and s.size_for(20, 32) == 32  # 640 <= 640, but 32 > 24: its own
    assert s.size_for(641, 1) == 641  # 641 > 640 takes size 32's table, 641 > 48: its own
    assert s.size_for(25, 25) == 25  # 625 <= 640, but 25 > 24
    assert s.size_for(33, 20) == 32  # 660 > 640, 33 <= 48
    assert s.size_for(24, 24) == 16  # fits the 24-patch grid of size 16
    assert s.size_for(27, 24) == 32  # 648 > 640
    assert s.size_for(48, 48) == 32 and s.size_for(49, 48) == 49  # beyond the last limit: largest, then its own
    assert tuple(s.table(16, "cpu", torch.float32).shape) == (24 * 24, 32)


def test_scaled_pos_embed_in_the_forward_is_the_tables_centre():
    """enable_scaled_pos_embed: a latent of a training size takes the centre of its scaled table
    (hand-computed); the saved pos_embed is unchanged; without it the saved table's centre."""
    model = _random_model("sd3.5-medium")
    saved = model.pos_embed.clone()
    cfg = model.config
    h = w = 4
    m = cfg.pos_embed_max_size
    plain = model.cropped_pos_embed(h, w)
    top = (m - h) // 2
    want_plain = saved[0].reshape(m, m, -1)[top:top + h, top:top + w].reshape(1, h * w, -1)
    assert torch.equal(plain, want_plain)
    model.enable_scaled_pos_embed([8, 16])  # latent sizes: patched 4 and 8
    got = model.cropped_pos_embed(h, w).double()[0]
    full = _hand_table(cfg.hidden_size, _sd_scripts_positions(6, 4))  # grid int(1.5 x 4)
    want = full.reshape(6, 6, -1)[1:5, 1:5].reshape(h * w, -1)
    assert float((got - want).abs().max()) <= 1e-6
    assert torch.equal(model.pos_embed, saved) and "pos_embed" in model.state_dict()
    x = torch.randn(1, cfg.in_channels, 8, 8)
    with torch.no_grad():
        a = model(x, torch.tensor([500.0]), torch.randn(1, cfg.adm_in_channels), torch.randn(1, 3, cfg.context_dim))
    assert torch.isfinite(a).all()


def test_random_crop_rate_and_offsets_over_many_draws():
    """pos_emb_random_crop_rate: of 4000 seeded samples a share ``rate`` take a uniform offset
    (a uniform one is the centre with probability 1 / 13^2 here), the rest the centre; every
    offset in range and their mean the range's middle; rate 0 draws nothing."""
    from library.data.step_plan import derive_seed
    from library.models.families.sd3 import sd3_positions

    size, h, w, rate, n = 16, 4, 4, 0.3, 4000
    centre = ((size - h) // 2, (size - w) // 2)
    offs = [sd3_positions.crop_offset(derive_seed("pos-crop", 7, 1, i), rate, size, h, w) for i in range(n)]
    moved = sum(o != centre for o in offs) / n
    expect = rate * (1 - 1 / 13 ** 2)
    assert abs(moved - expect) < 4 * (expect * (1 - expect) / n) ** 0.5
    tops = [o[0] for o in offs if o != centre]
    assert min(tops) == 0 and max(tops) == size - h
    assert abs(sum(tops) / len(tops) - (size - h) / 2) < 4 * (((13 ** 2 - 1) / 12) / len(tops)) ** 0.5
    assert all(sd3_positions.crop_offset(s, 0.0, size, h, w) == centre for s in range(50))
    assert sd3_positions.crop_offset(None, 1.0, size, h, w) == centre


def test_random_crop_forward_is_per_sample_and_keyed_to_its_seed():
    """Each sample's crop depends on its own seed only (batch [a, b] == [a] and [b] alone: the
    same whatever the batch split, process count or resume point), its window is the hand-cut
    one of the table; without seeds (samples, validation) the centre."""
    import random

    model = _random_model("sd3")
    cfg = model.config
    torch.manual_seed(3)
    x = torch.randn(2, cfg.in_channels, 8, 8)
    t, y = torch.tensor([300.0, 700.0]), torch.randn(2, cfg.adm_in_channels)
    ctx = torch.randn(2, 3, cfg.context_dim)
    seeds = [11, 12]
    with torch.no_grad():
        both = model(x, t, y, ctx, pos_embed=model.cropped_pos_embed(4, 4, 1.0, seeds))
        one = torch.cat([model(x[k:k + 1], t[k:k + 1], y[k:k + 1], ctx[k:k + 1],
                               pos_embed=model.cropped_pos_embed(4, 4, 1.0, [seeds[k]])) for k in range(2)])
        centre = model(x, t, y, ctx)
    assert float((both - one).abs().max()) <= 1e-5
    assert not torch.allclose(both, centre)
    m, h = cfg.pos_embed_max_size, 4
    pe = model.cropped_pos_embed(h, h, 1.0, seeds)
    for k, seed in enumerate(seeds):
        r = random.Random(seed)
        assert r.random() < 1.0
        top, left = r.randrange(m - h + 1), r.randrange(m - h + 1)
        want = model.pos_embed[0].reshape(m, m, -1)[top:top + h, left:left + h].reshape(h * h, -1)
        assert torch.equal(pe[k], want)
