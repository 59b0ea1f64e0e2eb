"""Anima's model (library/models/families/anima/): the DiT's forward against diffusers'
``CosmosTransformer3DModel`` on the same tiny weights, the LLM adapter against a float64
re-implementation of sd-scripts' formula, the file layout's checks and round trip.

The mapping of sd-scripts' (the released file's) DiT keys onto diffusers' Cosmos names, which
the forward comparison states:

    x_embedder.proj.1                          -> patch_embed.proj
    t_embedder.1.linear_{1,2}                  -> time_embed.t_embedder.linear_{1,2}
    t_embedding_norm                           -> time_embed.norm
    blocks.N.self_attn / cross_attn            -> transformer_blocks.N.attn1 / attn2
        q_proj k_proj v_proj output_proj       ->     to_q to_k to_v to_out.0
        q_norm k_norm                          ->     norm_q norm_k
    blocks.N.adaln_modulation_{self_attn,cross_attn,mlp}.{1,2}
                                               -> transformer_blocks.N.norm{1,2,3}.linear_{1,2}
    blocks.N.mlp.layer{1,2}                    -> transformer_blocks.N.ff.net.{0.proj,2}
    final_layer.adaln_modulation.{1,2}         -> norm_out.linear_{1,2}
    final_layer.linear                         -> proj_out

with diffusers' rope_scale (t, h, w) = sd-scripts' (1, 4, 4) extrapolation ratios, no learnable
position embedding (extra_per_block_abs_pos_emb False), the zero padding mask as the 17th channel (given to diffusers' model as
an input channel: its own concatenation needs torchvision).
"""
from __future__ import annotations

import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.models.families.anima import model as anima_model
from library.models.families.anima import tiny, weights


@pytest.fixture(scope="module")
def parts():
    return tiny.build()


_BLOCK_MAP = (("self_attn.q_proj", "attn1.to_q"), ("self_attn.k_proj", "attn1.to_k"),
              ("self_attn.v_proj", "attn1.to_v"), ("self_attn.output_proj", "attn1.to_out.0"),
              ("self_attn.q_norm", "attn1.norm_q"), ("self_attn.k_norm", "attn1.norm_k"),
              ("cross_attn.q_proj", "attn2.to_q"), ("cross_attn.k_proj", "attn2.to_k"),
              ("cross_attn.v_proj", "attn2.to_v"), ("cross_attn.output_proj", "attn2.to_out.0"),
              ("cross_attn.q_norm", "attn2.norm_q"), ("cross_attn.k_norm", "attn2.norm_k"),
              ("adaln_modulation_self_attn.1", "norm1.linear_1"), ("adaln_modulation_self_attn.2", "norm1.linear_2"),
              ("adaln_modulation_cross_attn.1", "norm2.linear_1"), ("adaln_modulation_cross_attn.2", "norm2.linear_2"),
              ("adaln_modulation_mlp.1", "norm3.linear_1"), ("adaln_modulation_mlp.2", "norm3.linear_2"),
              ("mlp.layer1", "ff.net.0.proj"), ("mlp.layer2", "ff.net.2"))
_TOP_MAP = (("x_embedder.proj.1", "patch_embed.proj"), ("t_embedder.1.linear_1", "time_embed.t_embedder.linear_1"),
            ("t_embedder.1.linear_2", "time_embed.t_embedder.linear_2"), ("t_embedding_norm", "time_embed.norm"),
            ("final_layer.adaln_modulation.1", "norm_out.linear_1"),
            ("final_layer.adaln_modulation.2", "norm_out.linear_2"), ("final_layer.linear", "proj_out"))


def _to_diffusers(sd: dict) -> dict:
    out = {}
    for key, v in sd.items():
        if key.startswith(("llm_adapter.", "pos_embedder.")):
            continue
        m = re.match(r"blocks\.(\d+)\.(.+)\.(weight|bias)$", key)
        if m:
            name = dict(_BLOCK_MAP)[m.group(2)]
            out[f"transformer_blocks.{m.group(1)}.{name}.{m.group(3)}"] = v
            continue
        stem, leaf = key.rsplit(".", 1)
        out[f"{dict(_TOP_MAP)[stem]}.{leaf}"] = v
    return out


def test_dit_forward_equals_diffusers_cosmos(parts):
    from diffusers import CosmosTransformer3DModel

    torch.set_num_threads(1)
    dit = parts["dit"]
    cfg = dit.config
    ref = CosmosTransformer3DModel(
        in_channels=17, out_channels=16, num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim,
        num_layers=cfg.num_blocks, mlp_ratio=cfg.mlp_hidden / cfg.model_channels, text_embed_dim=cfg.crossattn_dim,
        adaln_lora_dim=cfg.adaln_lora_dim, max_size=(128, 512, 512), patch_size=(1, 2, 2),
        rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=False, extra_pos_embed_type=None).eval()
    missing, unexpected = ref.load_state_dict(_to_diffusers(dit.state_dict()), strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 1, 6, 10, generator=g)
    sigma = torch.tensor([0.25, 0.8])
    ctx = torch.randn(2, 7, cfg.crossattn_dim, generator=g)
    with torch.no_grad():
        ours = dit(x, sigma, ctx)
        # diffusers concatenates the mask with torchvision's resize; the zero channel given directly
        theirs = ref(torch.cat([x, torch.zeros(2, 1, 1, 6, 10)], 1), sigma, ctx, return_dict=False)[0]
    assert ours.shape == theirs.shape == x.shape
    # float32, the same operations in a different order: a few ulps of the output's scale
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err < 1e-5, err
    # a 4-D latent gives the same values
    with torch.no_grad():
        assert torch.equal(dit(x[:, :, 0], sigma, ctx), ours[:, :, 0])


# --- the LLM adapter in float64, written from sd-scripts' formula ---------------------------

def _rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos):
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos[:, None] * inv[None]
    cos, sin = torch.cos(torch.cat([ang, ang], -1)), torch.sin(torch.cat([ang, ang], -1))
    half = d // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def _attn(sd, pre, xq, xkv, heads, kmask):
    b, lq, _ = xq.shape
    lk = xkv.shape[1]
    q = (xq @ sd[pre + "q_proj.weight"].T).view(b, lq, heads, -1)
    k = (xkv @ sd[pre + "k_proj.weight"].T).view(b, lk, heads, -1)
    v = (xkv @ sd[pre + "v_proj.weight"].T).view(b, lk, heads, -1)
    q = _rope_heads(_rms(q, sd[pre + "q_norm.weight"]), lq)
    k = _rope_heads(_rms(k, sd[pre + "k_norm.weight"]), lk)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~kmask[:, None, None, :], float("-inf"))
    w = torch.softmax(scores, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, lq, -1)
    return out @ sd[pre + "o_proj.weight"].T


def _rope_heads(x, length):
    pos = torch.arange(length, dtype=torch.float64)
    return _rope(x.transpose(1, 2), pos).transpose(1, 2)  # (b, h, l, d) rotated by position


def _adapter_reference(sd, cfg, src, ids, tmask, smask):
    sd = {k[len("llm_adapter."):]: v.double() for k, v in sd.items() if k.startswith("llm_adapter.")}
    x = sd["embed.weight"][ids]
    for i in range(cfg.num_layers):
        p = f"blocks.{i}."
        n = _rms(x, sd[p + "norm_self_attn.weight"])
        x = x + _attn(sd, p + "self_attn.", n, n, cfg.num_heads, tmask)
        x = x + _attn(sd, p + "cross_attn.", _rms(x, sd[p + "norm_cross_attn.weight"]), src, cfg.num_heads, smask)
        n = _rms(x, sd[p + "norm_mlp.weight"])
        h = n @ sd[p + "mlp.0.weight"].T + sd[p + "mlp.0.bias"]
        h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
        x = x + h @ sd[p + "mlp.2.weight"].T + sd[p + "mlp.2.bias"]
    return _rms(x @ sd["out_proj.weight"].T + sd["out_proj.bias"], sd["norm.weight"])


def test_llm_adapter_equals_float64_formula(parts):
    torch.set_num_threads(1)
    dit, q_tok, t_tok = parts["dit"], parts["qwen3_tokenizer"], parts["t5_tokenizer"]
    captions = ["a cat on a mat", "one red ball"]
    qi = q_tok(captions, padding="max_length", max_length=12, truncation=True, return_tensors="pt")
    ti = t_tok(captions, padding="max_length", max_length=9, truncation=True, return_tensors="pt")
    with torch.no_grad():
        src = parts["qwen3"](input_ids=qi["input_ids"], attention_mask=qi["attention_mask"]).last_hidden_state
        ours = dit.text_context(src, ti["input_ids"], ti["attention_mask"], qi["attention_mask"])
    ref = _adapter_reference(dit.state_dict(), dit.config.adapter, src.double(), ti["input_ids"],
                             ti["attention_mask"].bool(), qi["attention_mask"].bool())
    ref = ref * ti["attention_mask"].double()[..., None]  # the DiT zeroes T5's padding
    # float32 against float64 through 2 blocks of width 32: relative error ~1e-6
    err = (ours.double() - ref).abs().max() / ref.abs().max()
    assert err < 2e-5, err
    assert (ours[ti["attention_mask"] == 0] == 0).all()


def test_empty_source_gives_finite_context(parts):
    """A dropped caption (no Qwen3 token): the adapter's cross-attention has no key; it adds zero
    instead of SDPA's NaN."""
    dit = parts["dit"]
    src = torch.zeros(1, 4, 32)
    ids = torch.tensor([[5, 1, 0]])
    with torch.no_grad():
        out = dit.text_context(src, ids, torch.tensor([[1, 1, 0]]), torch.zeros(1, 4, dtype=torch.long))
    assert out.isfinite().all()


# --- the file layout --------------------------------------------------------------------------

def test_file_round_trip_and_separate_adapter(parts, tmp_path):
    dit = parts["dit"]
    path = str(tmp_path / "anima.safetensors")
    weights.save_dit(dit, path)
    sd = load_file(path)
    assert all(k.startswith("net.") for k in sd) and "net.llm_adapter.embed.weight" in sd
    back = weights.load_dit(path)
    assert back.config == dit.config
    for k, v in dit.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    # the DiT alone (no RoPE tables, no net.) and the adapter in its own file without its prefix
    core = {k[4:]: v for k, v in sd.items() if not k.startswith(("net.llm_adapter.", "net.pos_embedder."))}
    save_file(core, str(tmp_path / "dit.safetensors"))
    save_file({k[len("net.llm_adapter."):]: v for k, v in sd.items() if k.startswith("net.llm_adapter.")},
              str(tmp_path / "adapter.safetensors"))
    with pytest.raises(anima_model.AnimaModelError, match="llm_adapter_path"):
        weights.read_config(str(tmp_path / "dit.safetensors"))
    split = weights.load_dit(str(tmp_path / "dit.safetensors"), str(tmp_path / "adapter.safetensors"))
    assert all(torch.equal(split.state_dict()[k], v) for k, v in dit.state_dict().items())


@pytest.mark.parametrize("edit, message", [
    (lambda sd: sd.pop("net.blocks.1.mlp.layer2.weight"), "missing blocks.1.mlp.layer2.weight"),
    (lambda sd: sd.__setitem__("net.blocks.0.cross_attn.v_proj.weight", torch.zeros(64, 48)),
     r"blocks.0.cross_attn.v_proj.weight has shape \[64, 48\], expected \[64, 32\]"),
    (lambda sd: sd.__setitem__("net.lora_unet_x.weight", torch.zeros(1)), "keys that are not Anima's"),
    (lambda sd: sd.pop("net.x_embedder.proj.1.weight"), "not an Anima DiT"),
])
def test_bad_files_get_one_line_before_loading(parts, tmp_path, edit, message):
    path = str(tmp_path / "a.safetensors")
    weights.save_dit(parts["dit"], path)
    sd = load_file(path)
    edit(sd)
    save_file(sd, path)
    with pytest.raises(anima_model.AnimaModelError, match=message) as e:
        weights.read_config(path)
    assert "\n" not in str(e.value)


def test_full_size_config_from_shapes():
    """The released widths (2048, 28 blocks, 16 heads; adapter 1024 x 6) read back from shapes
    made on the meta device."""
    with torch.device("meta"):
        sd = anima_model.Anima(anima_model.FULL).state_dict()
    cfg = weights.config_from_shapes({k: tuple(v.shape) for k, v in sd.items()}, "full")
    assert cfg == anima_model.FULL
    weights.check_shapes(cfg, {k: tuple(v.shape) for k, v in sd.items()}, "full")
