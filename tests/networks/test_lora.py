"""networks/lora.py: kohya names and module sets, multiplier 0, save/load, dims from weights,
optimizer groups, option errors, hashes."""
from __future__ import annotations

import hashlib
import os
from collections import Counter

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from library.models.families.sd_common.tiny_models import build_tiny_components  # noqa: E402
from tests.conftest import count_sd_scripts_modules  # noqa: E402
from networks import lora  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = build_tiny_components(arch)
        return cache[arch]
    return get


def fresh(arch):
    return build_tiny_components(arch)


def tes(c):
    return [c["text_encoder"]] + ([c["text_encoder_2"]] if "text_encoder_2" in c else [])


def names_by_prefix(keys):
    return Counter(k.split(".")[0].split("_")[1] for k in keys if k.endswith(".lora_down.weight"))


def unet_and_te_inputs(c, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c["tokenizer"].vocab_size, (2, 77), generator=g)
    latents = torch.randn(2, 4, 8, 8, generator=g)
    return ids, latents


def run_model(c, ids, latents):
    """Text encoder(s) -> U-Net, so LoRA on both sides shows in the output."""
    with torch.no_grad():
        if "text_encoder_2" in c:
            h1 = c["text_encoder"](ids, output_hidden_states=True).hidden_states[-2]
            out2 = c["text_encoder_2"](ids, output_hidden_states=True)
            hidden = torch.cat([h1, out2.hidden_states[-2]], dim=-1)
            cond = {"text_embeds": out2.text_embeds, "time_ids": torch.tensor([[64, 64, 0, 0, 64, 64]] * ids.shape[0],
                                                                                dtype=torch.float32)}
            return c["unet"](latents, 500, encoder_hidden_states=hidden, added_cond_kwargs=cond).sample
        hidden = c["text_encoder"](ids)[0]
        return c["unet"](latents, 500, encoder_hidden_states=hidden).sample


def randomize_up(net, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.text_encoder_loras + net.unet_loras:
            m.lora_up.weight.copy_(torch.randn(m.lora_up.weight.shape, generator=g) * 0.1)


# --- names and module sets --------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sd15", "sd2"])
@pytest.mark.parametrize("conv", [False, True])
def test_sd12_names_and_counts(tiny, arch, conv):
    c = tiny(arch)
    kwargs = {"conv_dim": "2"} if conv else {}
    net = lora.create_network(1.0, 4, 1.0, c["vae"], c["text_encoder"], c["unet"], **kwargs)
    sd = net.state_dict()
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in sd
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight" in sd
    assert "lora_te_text_model_encoder_layers_3_mlp_fc2.alpha" in sd
    counts = names_by_prefix(sd)
    assert counts == count_sd_scripts_modules(c, conv=conv)
    # The SD1.5 topology: 16 transformers x (proj_in, proj_out, 2 x 4 attention, 2 ff) = 192;
    # 4 text-encoder layers x (q, k, v, out, fc1, fc2) = 24.
    if not conv:
        assert counts["unet"] == 16 * 12 and counts["te"] == 4 * 6
    else:
        assert "lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight" in sd
        assert "lora_unet_down_blocks_1_resnets_0_conv_shortcut.lora_down.weight" in sd
        assert "lora_unet_down_blocks_0_downsamplers_0_conv.lora_down.weight" in sd
        assert "lora_unet_up_blocks_0_upsamplers_0_conv.lora_down.weight" in sd
        assert sd["lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight"].shape[:1] == (2,)
        # time-embedding projections and 1x1 shortcuts are "small" modules: network_dim, not conv_dim
        assert sd["lora_unet_mid_block_resnets_0_time_emb_proj.lora_down.weight"].shape[0] == 4
    for key, value in sd.items():
        if key.endswith(".alpha"):
            assert value.dim() == 0 and value.dtype == torch.float32


@pytest.mark.parametrize("conv", [False, True])
def test_sdxl_names_and_counts(tiny, conv):
    c = tiny("sdxl")
    kwargs = {"conv_dim": "2", "conv_alpha": "1"} if conv else {}
    net = lora.create_network(1.0, 4, 1.0, c["vae"], tes(c), c["unet"], **kwargs)
    sd = net.state_dict()
    for key in ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k.lora_down.weight",
                "lora_unet_input_blocks_8_1_transformer_blocks_9_ff_net_2.lora_up.weight",
                "lora_unet_middle_block_1_transformer_blocks_9_attn1_to_out_0.alpha",
                "lora_unet_output_blocks_0_1_transformer_blocks_0_attn1_to_q.lora_down.weight",
                "lora_unet_output_blocks_5_1_proj_out.lora_down.weight",
                "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight",
                "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight",
                "lora_te2_text_model_encoder_layers_3_mlp_fc1.alpha"):
        assert key in sd, key
    assert not any("down_blocks" in k or "up_blocks" in k or "mid_block_" in k for k in sd)
    counts = names_by_prefix(sd)
    assert counts == count_sd_scripts_modules(c, conv=conv)
    if not conv:
        # SDXL's transformer depths (2x1 + 2x2... = 70 blocks x 10) + 11 transformers x proj_in/out
        assert counts["unet"] == 722
    else:
        for key in ("lora_unet_input_blocks_1_0_in_layers_2", "lora_unet_input_blocks_1_0_emb_layers_1",
                    "lora_unet_input_blocks_1_0_out_layers_3", "lora_unet_input_blocks_4_0_skip_connection",
                    "lora_unet_input_blocks_3_0_op", "lora_unet_input_blocks_6_0_op",
                    "lora_unet_middle_block_0_in_layers_2", "lora_unet_middle_block_2_out_layers_3",
                    "lora_unet_output_blocks_2_2_conv", "lora_unet_output_blocks_5_2_conv",
                    "lora_unet_output_blocks_8_0_skip_connection"):
            assert key + ".lora_down.weight" in sd, key


def test_sdxl_names_hit_the_sai_modules(tiny):
    """Each SAI name points at the module of the same shape in the diffusers model's SAI
    counterpart: check shapes against a hand-written table of the SDXL layout."""
    c = tiny("sdxl")
    net = lora.create_network(1.0, 4, 1.0, None, tes(c), c["unet"], conv_dim="2")
    by_name = {m.lora_name: m.org_module for m in net.unet_loras}
    u = c["unet"]
    assert by_name["lora_unet_input_blocks_3_0_op"] is u.down_blocks[0].downsamplers[0].conv
    assert by_name["lora_unet_input_blocks_5_1_proj_in"] is u.down_blocks[1].attentions[1].proj_in
    assert by_name["lora_unet_input_blocks_7_0_in_layers_2"] is u.down_blocks[2].resnets[0].conv1
    assert by_name["lora_unet_middle_block_2_emb_layers_1"] is u.mid_block.resnets[1].time_emb_proj
    assert by_name["lora_unet_output_blocks_3_0_skip_connection"] is u.up_blocks[1].resnets[0].conv_shortcut
    assert by_name["lora_unet_output_blocks_5_2_conv"] is u.up_blocks[1].upsamplers[0].conv
    assert by_name["lora_unet_output_blocks_7_0_out_layers_3"] is u.up_blocks[2].resnets[1].conv2


# --- behaviour --------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
def test_multiplier_zero_is_exactly_the_base_model(arch):
    c = fresh(arch)
    ids, latents = unet_and_te_inputs(c)
    base = run_model(c, ids, latents)
    net = lora.create_network(1.0, 4, 4.0, c["vae"], tes(c), c["unet"], conv_dim="2")
    net.apply_to(tes(c), c["unet"])
    randomize_up(net)
    with_lora = run_model(c, ids, latents)
    assert not torch.allclose(with_lora, base)
    net.set_multiplier(0.0)
    assert torch.equal(run_model(c, ids, latents), base)
    # the original modules kept their own weights: removing the hooks gives the base model too
    net.set_multiplier(1.0)
    net.remove_from()
    assert torch.equal(run_model(c, ids, latents), base)


@pytest.mark.parametrize("ext,dtype", [(".safetensors", None), (".safetensors", torch.float16), (".pt", None),
                                       (".ckpt", torch.bfloat16)])
def test_save_load_round_trip(tmp_path, ext, dtype):
    c = fresh("sd15")
    net = lora.create_network(1.0, 4, 2.0, c["vae"], c["text_encoder"], c["unet"], conv_dim="3", conv_alpha="1.5")
    net.apply_to(c["text_encoder"], c["unet"])
    randomize_up(net)
    path = str(tmp_path / ("out" + ext))
    net.save_weights(path, dtype, {"ss_network_dim": "4", "ss_network_alpha": "2.0"})
    assert os.listdir(tmp_path) == ["out" + ext]  # no temp file left behind

    saved = lora.load_state_dict_file(path)
    expected = {k: v.to(dtype) if dtype else v for k, v in net.state_dict().items()}
    assert saved.keys() == expected.keys()
    for k in saved:
        assert saved[k].dtype == expected[k].dtype and torch.equal(saved[k], expected[k]), k

    other, _ = lora.create_network_from_weights(1.0, path, c["vae"], c["text_encoder"], fresh("sd15")["unet"])
    other.load_weights(path)
    for k, v in other.state_dict().items():
        assert torch.equal(v, saved[k].float()), k


def test_from_weights_reproduces_dims_and_outputs(tmp_path):
    c = fresh("sdxl")
    net = lora.create_network(0.7, 4, 2.0, c["vae"], tes(c), c["unet"], conv_dim="3", conv_alpha="1.5")
    net.apply_to(tes(c), c["unet"])
    randomize_up(net)
    path = str(tmp_path / "x.safetensors")
    net.save_weights(path, None, None)
    ids, latents = unet_and_te_inputs(c)
    out_a = run_model(c, ids, latents)

    d = fresh("sdxl")
    other, weights = lora.create_network_from_weights(0.7, path, d["vae"], tes(d), d["unet"])
    dims = {m.lora_name: (m.lora_dim, float(m.alpha), m.lora_down.weight.shape)
            for m in other.text_encoder_loras + other.unet_loras}
    assert dims == {m.lora_name: (m.lora_dim, float(m.alpha), m.lora_down.weight.shape)
                    for m in net.text_encoder_loras + net.unet_loras}
    assert {v[0] for v in dims.values()} == {3, 4}
    other.load_state_dict(weights)
    other.apply_to(tes(d), d["unet"])
    assert torch.equal(run_model(d, ids, latents), out_a)


def test_from_weights_wrong_base_model_is_a_clear_error(tmp_path):
    c = fresh("sd15")
    net = lora.create_network(1.0, 4, 1.0, None, c["text_encoder"], c["unet"])
    path = str(tmp_path / "sd1.safetensors")
    net.save_weights(path, None, {})
    x = fresh("sdxl")
    with pytest.raises(lora.LoRAError, match="do not exist in this model"):
        lora.create_network_from_weights(1.0, path, None, tes(x), x["unet"])
    with pytest.raises(lora.LoRAError, match="not found"):
        lora.create_network_from_weights(1.0, str(tmp_path / "missing.safetensors"), None, c["text_encoder"], c["unet"])


def test_apply_to_unet_only_drops_text_encoder_modules(tiny):
    c = tiny("sd15")
    net = lora.create_network(1.0, 4, 1.0, None, c["text_encoder"], c["unet"])
    net.apply_to(c["text_encoder"], c["unet"], apply_text_encoder=False, apply_unet=True)
    try:
        assert net.text_encoder_loras == [] and not any(k.startswith("lora_te") for k in net.state_dict())
        groups, desc = net.prepare_optimizer_params(None, 1e-4, 1e-3)
        assert desc == ["unet"] and groups[0]["lr"] == 1e-4
    finally:
        net.remove_from()


def test_prepare_optimizer_params_groups(tiny):
    c = tiny("sdxl")
    net = lora.create_network(1.0, 4, 1.0, None, tes(c), c["unet"])
    n_te1 = sum(1 for m in net.text_encoder_loras if m.lora_name.startswith("lora_te1_"))
    groups, desc = net.prepare_optimizer_params([1e-5, 2e-5], 1e-4, 1e-3)
    assert desc == ["textencoder 1", "textencoder 2", "unet"]
    assert [g["lr"] for g in groups] == [1e-5, 2e-5, 1e-4]
    assert len(groups[0]["params"]) == 2 * n_te1
    all_ids = {id(p) for g in groups for p in g["params"]}
    assert all_ids == {id(p) for p in net.get_trainable_params()}
    groups, desc = net.prepare_optimizer_params(None, 0, 1e-3)  # unet_lr 0 -> unet frozen (left out)
    assert desc == ["textencoder 1", "textencoder 2"] and [g["lr"] for g in groups] == [1e-3, 1e-3]
    plus = lora.create_network(1.0, 4, 1.0, None, c["text_encoder"], c["unet"], loraplus_lr_ratio="16")
    groups, desc = plus.prepare_optimizer_params(1e-5, 1e-4, 1e-3)
    assert desc == ["textencoder", "textencoder plus", "unet", "unet plus"]
    assert [g["lr"] for g in groups] == [1e-5, 1e-5 * 16, 1e-4, 1e-4 * 16]


@pytest.mark.parametrize("kwargs,match", [
    ({"conv_dims": "4"}, "unknown key 'conv_dims'.*known keys: conv_dim, conv_alpha"),
    ({"conv_dim": "four"}, "conv_dim='four' is not an integer"),
    ({"conv_dim": "0"}, "conv_dim='0' must be >= 1"),
    ({"rank_dropout": "1.5"}, "rank_dropout='1.5' must be"),
    ({"conv_alpha": "2"}, "conv_alpha is given without conv_dim"),
])
def test_bad_network_args(tiny, kwargs, match):
    c = tiny("sd15")
    with pytest.raises(lora.LoRAError, match=match) as e:
        lora.create_network(1.0, 4, 1.0, None, c["text_encoder"], c["unet"], **kwargs)
    assert "\n" not in str(e.value)


def test_dropouts_only_in_training(tiny):
    c = tiny("sd15")
    net = lora.create_network(1.0, 4, 1.0, None, c["text_encoder"], None, neuron_dropout=0.5,
                              rank_dropout="0.5", module_dropout="0.5")
    m = net.text_encoder_loras[0]
    assert (m.dropout, m.rank_dropout, m.module_dropout) == (0.5, 0.5, 0.5)
    m.apply_to()
    try:
        with torch.no_grad():
            m.lora_up.weight.normal_()
        x = torch.randn(2, 5, m.lora_down.in_features)
        net.eval()
        assert torch.equal(m.org_module(x), m.org_module(x))
        net.train()
        torch.manual_seed(0)
        outs = [m.org_module(x) for _ in range(8)]
        assert any(not torch.equal(outs[0], o) for o in outs[1:])
    finally:
        m.restore()


def test_safetensors_metadata_and_hashes(tmp_path):
    c = fresh("sd15")
    net = lora.create_network(1.0, 16, 1.0, None, c["text_encoder"], c["unet"])  # > 1 MiB file
    path = str(tmp_path / "h.safetensors")
    meta = {"ss_network_dim": "4", "modelspec.title": "x"}
    net.save_weights(path, None, meta)
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        got = f.metadata()
    assert got["ss_network_dim"] == "4" and got["modelspec.title"] == "x"
    # Independent recomputation of sd-webui-additional-networks' hashes: both are over the file
    # as written with only ss_* metadata; the model hash skips the header.
    from safetensors.torch import save
    data = save({k: v.contiguous() for k, v in net.state_dict().items()}, {"ss_network_dim": "4"})
    header_len = int.from_bytes(data[:8], "little")
    assert got["sshs_model_hash"] == hashlib.sha256(data[8 + header_len:]).hexdigest()
    assert got["sshs_legacy_hash"] == hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]
    assert len(data) > 0x100000  # so the legacy hash covers real bytes


def test_one_writer_for_training_and_tools(tmp_path):
    """networks/lora.py write_weights writes the trained network's file and every tool's
    (lora_svd.save_lora is it): metadata as strings, stale sshs_* hashes replaced by ones
    computed over the tensors written (here in float16, alpha included), a non-finite tensor
    refused with the previous file kept."""
    from safetensors import safe_open
    from safetensors.torch import save

    path = str(tmp_path / "w.safetensors")
    sd = {"lora_unet_x.lora_down.weight": torch.randn(2, 8), "lora_unet_x.lora_up.weight": torch.randn(8, 2),
          "lora_unet_x.alpha": torch.tensor(2.0)}
    lora.write_weights(path, sd, torch.float16, {"ss_network_dim": 2, "sshs_model_hash": "stale"})
    with safe_open(path, "pt") as f:
        got, dtypes = f.metadata(), {k: f.get_tensor(k).dtype for k in f.keys()}
    assert got["ss_network_dim"] == "2" and set(dtypes.values()) == {torch.float16}
    data = save({k: v.to(torch.float16).contiguous() for k, v in sd.items()}, {"ss_network_dim": "2"})
    header_len = int.from_bytes(data[:8], "little")
    assert got["sshs_model_hash"] == hashlib.sha256(data[8 + header_len:]).hexdigest()
    before = open(path, "rb").read()
    bad = dict(sd, **{"lora_unet_x.lora_up.weight": torch.full((8, 2), float("nan"))})
    with pytest.raises(lora.LoRAError, match="lora_unet_x.lora_up.weight has non-finite values"):
        lora.write_weights(path, bad, None, {})
    assert open(path, "rb").read() == before
