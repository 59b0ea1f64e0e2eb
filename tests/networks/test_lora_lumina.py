"""networks/lora_lumina.py: module names and network_args as sd-scripts' networks/lora_lumina.py,
files whose every key ComfyUI's key map loads with the trained delta, the hooked network equal to
the merged weights, what diffusers 0.42's Lumina 2 loader does with them, and another family's
file refused."""
from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from library.models.families.lumina import nextdit, tiny
from networks import lora_dit, lora_lumina
from networks.lora import LoRAError
from tests.client_key_tables import comfy_dit_shapes
from tests.networks.test_lora_sd3 import _randomize


@pytest.fixture(scope="module")
def parts():
    return tiny.build_tiny_lumina()


def test_default_targets_by_hand(parts):
    net = lora_lumina.create_network(1.0, 4, 1, None, [parts["gemma2"]], parts["transformer"])
    block = ["attention_qkv", "attention_out", "feed_forward_w1", "feed_forward_w2", "feed_forward_w3"]
    want = {f"lora_unet_context_refiner_0_{n}" for n in block}
    for b in ("noise_refiner_0", "layers_0", "layers_1"):
        want |= {f"lora_unet_{b}_{n}" for n in block + ["adaLN_modulation_1"]}
    want |= {"lora_unet_final_layer_linear", "lora_unet_final_layer_adaLN_modulation_1"}
    assert {lora.lora_name for lora in net.unet_loras} == want
    te = {lora.lora_name for lora in net.text_encoder_loras}
    assert "lora_te_layers_0_self_attn_q_proj" in te and "lora_te_layers_2_mlp_down_proj" in te
    assert len(te) == 3 * 7  # 3 layers x (q, k, v, o, gate, up, down)


def test_blocks_ranks_and_embedders(parts):
    m = parts["transformer"]
    net = lora_lumina.create_network(1.0, 4, 1, None, [None], m, train_blocks="transformer")
    assert {lora.lora_name.split("_")[2] for lora in net.unet_loras} == {"layers"}
    net = lora_lumina.create_network(1.0, 4, 1, None, [None], m, train_blocks="refiners")
    assert {lora.lora_name.split("_")[2] for lora in net.unet_loras} == {"context", "noise"}
    net = lora_lumina.create_network(1.0, 4, 1, None, [None], m, attn_dim="8", mlp_dim="0", mod_dim="2",
                                     refiner_dim="3", embedder_dims="[1, 2, 5]")
    rank = {lora.lora_name: lora.lora_dim for lora in net.unet_loras}
    assert rank["lora_unet_layers_0_attention_qkv"] == 8 and rank["lora_unet_noise_refiner_0_attention_out"] == 8
    assert not any("feed_forward" in n for n in rank)  # mlp_dim 0 (feed_forward before refiner_dim)
    assert rank["lora_unet_layers_1_adaLN_modulation_1"] == 2 and rank["lora_unet_final_layer_adaLN_modulation_1"] == 2
    assert rank["lora_unet_noise_refiner_0_adaLN_modulation_1"] == 2  # modulation before refiner
    assert rank["lora_unet_final_layer_linear"] == 4
    assert (rank["lora_unet_x_embedder"], rank["lora_unet_t_embedder_mlp_0"], rank["lora_unet_t_embedder_mlp_2"],
            rank["lora_unet_cap_embedder_1"]) == (1, 2, 2, 5)


@pytest.mark.parametrize("args, message", [
    ({"embedder_dims": "1,2"}, "embedder_dims='1,2' for networks.lora_lumina needs 3 ranks"),
    ({"attn_dim": "-1"}, "attn_dim"),
    ({"train_blocks": "single"}, "train_blocks='single' for networks.lora_lumina: one of all, transformer"),
    ({"train_block_indices": "0"}, "unknown key 'train_block_indices' for networks.lora_lumina"),
])
def test_bad_network_args_are_one_line(args, message):
    with pytest.raises(LoRAError) as e:
        lora_lumina.check_network_args(args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_every_name_maps_in_comfyui_with_the_trained_delta(parts, tmp_path):
    """ComfyUI's key map (lora_unet_ + the original layout's path, which its Lumina 2 model keeps)
    knows every transformer name; W + up @ down * alpha / rank from the file is the runtime delta,
    split_qkv included (alpha written as 3 x alpha)."""
    net = lora_lumina.create_network(1.0, 2, 3, None, [None], parts["transformer"], split_qkv="True",
                                     embedder_dims="1,1,1")
    _randomize(net)
    path = str(tmp_path / "lumina.safetensors")
    net.save_weights(path, torch.float64, lora_lumina.file_metadata())
    sd = load_file(path)
    table = comfy_dit_shapes(parts["transformer"])
    names = {k.split(".")[0] for k in sd}
    for name in names:
        assert name in table, name
        d, u, a = (sd[f"{name}.{p}"] for p in ("lora_down.weight", "lora_up.weight", "alpha"))
        delta = u @ d * (float(a) / d.shape[0])
        assert tuple(delta.shape) == table[name], name
        lora = copy.deepcopy(getattr(net, name)).double()
        x = torch.randn(3, d.shape[1], dtype=torch.float64)
        lora.org_forward = lambda v: torch.zeros((), dtype=torch.float64)
        torch.testing.assert_close(lora(x), x @ delta.T, rtol=1e-10, atol=1e-12, msg=name)
    assert float(sd["lora_unet_layers_0_attention_qkv.alpha"]) == 9.0
    assert isinstance(getattr(net, "lora_unet_layers_0_attention_qkv"), lora_dit.SplitLoRAModule)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert (meta["ss_network_module"], meta["ss_base_model_version"], meta["modelspec.architecture"]) == \
        ("networks.lora_lumina", "lumina2", "lumina-2/lora")


def test_runtime_equals_the_merged_weights(parts):
    """The network hooked into the whole Next-DiT gives the output of the model whose weights are
    W + up @ down * alpha / rank (float64)."""
    model = copy.deepcopy(parts["transformer"]).double()
    net = lora_lumina.create_network(1.0, 2, 3, None, [None], model, split_qkv="True", embedder_dims="1,1,2")
    _randomize(net)
    net.double()
    merged = copy.deepcopy(model)
    weights, sd = merged.state_dict(), net.state_dict()
    for lora in net.unet_loras:
        d, u, a = (sd[f"{lora.lora_name}.{p}"] for p in ("lora_down.weight", "lora_up.weight", "alpha"))
        key = next(k for k in weights if "lora_unet_" + k[:-len(".weight")].replace(".", "_") == lora.lora_name)
        weights[key] += u @ d * (float(a) / d.shape[0])
    g = torch.Generator().manual_seed(4)
    inputs = (torch.randn(2, 16, 8, 8, generator=g, dtype=torch.float64), torch.tensor([0.2, 0.7], dtype=torch.float64),
              torch.randn(2, 6, nextdit.TINY.cap_feat_dim, generator=g, dtype=torch.float64),
              torch.tensor([[1] * 6, [1] * 4 + [0] * 2]))
    net.apply_to(None, model, apply_text_encoder=False)
    try:
        out = model(*inputs)
    finally:
        net.remove_from()
    torch.testing.assert_close(out, merged(*inputs), rtol=1e-9, atol=1e-10)
    assert not torch.allclose(out, model(*inputs))


def test_from_weights_round_trip_and_other_family_refused(parts, tmp_path):
    net = lora_lumina.create_network(1.0, 4, 2, None, [parts["gemma2"]], parts["transformer"], mlp_dim="3")
    _randomize(net)
    src = str(tmp_path / "in.safetensors")
    net.save_weights(src, None, lora_lumina.file_metadata())
    back, _ = lora_lumina.create_network_from_weights(1.0, src, None, [parts["gemma2"]], parts["transformer"])
    back.load_weights(src)
    torch.testing.assert_close(back.state_dict(), load_file(src))
    flux = str(tmp_path / "flux.safetensors")
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 64),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(192, 4),
               "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(4.0)}, flux)
    with pytest.raises(LoRAError) as e:
        lora_lumina.create_network_from_weights(1.0, flux, None, [None], parts["transformer"])
    assert "do not exist in this model" in str(e.value) and "lora_unet_double_blocks_0_img_attn_qkv" in str(e.value)


def test_diffusers_042_lumina2_loader_reads_no_kohya_file(parts):
    """Pinned: diffusers' Lumina2LoraLoaderMixin converts only the ``diffusion_model.`` (PEFT
    lora_A / lora_B) form; a kohya file (sd-scripts', ours) patches nothing in its transformer."""
    from diffusers import Lumina2Transformer2DModel
    from diffusers.loaders.lora_pipeline import Lumina2LoraLoaderMixin

    from library.models.families.lumina import layout

    net = lora_lumina.create_network(1.0, 4, 1, None, [None], parts["transformer"])
    _randomize(net)
    cfg = {k: v for k, v in layout.diffusers_config(nextdit.TINY).items() if k != "_class_name"}
    transformer = Lumina2Transformer2DModel(**cfg)
    state = Lumina2LoraLoaderMixin.lora_state_dict(dict(net.state_dict()))
    assert set(state) == set(net.state_dict())  # no conversion: its converter needs "diffusion_model."
    transformer.load_lora_adapter(state, prefix="transformer")
    assert not any(hasattr(m, "lora_A") and len(m.lora_A) for _, m in transformer.named_modules())
