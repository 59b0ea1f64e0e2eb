"""networks/lora_anima.py and networks/convert_anima_lora_to_comfy.py on tiny-anima: sd-scripts'
module choice and names, every key in ComfyUI's key map (tests/client_key_tables.py) with the
patched weight W + up @ down * alpha / rank giving the LoRA forward, files of another family refused
in one line, and the ComfyUI layout round trip."""
from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.models.families.anima import tiny
from networks import convert_anima_lora_to_comfy as conv
from networks import lora_anima
from networks.lora import LoRAError
from tests.client_key_tables import comfy_dit_shapes


@pytest.fixture(scope="module")
def m():
    return tiny.build()


def _expected(prefix: str, blocks: int, layers) -> set[str]:
    return {f"lora_unet_{prefix}{i}_{layer}" for i in range(blocks) for layer in layers}


DIT_LAYERS = [f"{a}_{p}_proj" for a in ("self_attn", "cross_attn") for p in ("q", "k", "v", "output")] + \
    ["mlp_layer1", "mlp_layer2"]
ADAPTER_LAYERS = [f"{a}_{p}_proj" for a in ("self_attn", "cross_attn") for p in ("q", "k", "v", "o")] + \
    ["mlp_0", "mlp_2"]


def _names(net):
    return {lora.lora_name: lora.lora_dim for lora in net.unet_loras}


def test_targets_and_network_args(m):
    dit = copy.deepcopy(m["dit"])
    net = lora_anima.create_network(1.0, 4, 2, None, [m["qwen3"]], dit)
    assert set(_names(net)) == _expected("blocks_", 2, DIT_LAYERS) and not net.text_encoder_loras
    net = lora_anima.create_network(1.0, 4, 2, None, [m["qwen3"]], dit, train_llm_adapter="true",
                                    exclude_patterns="['.*mlp.*']", include_patterns="['blocks\\\\.1\\\\.mlp.*']",
                                    network_reg_dims="blocks\\.0\\..*=8")
    names = _names(net)
    want = (_expected("blocks_", 2, DIT_LAYERS) | _expected("llm_adapter_blocks_", 2, ADAPTER_LAYERS)) - \
        {n for n in _expected("blocks_", 1, DIT_LAYERS) if "mlp" in n} - \
        {n for n in _expected("llm_adapter_blocks_", 2, ADAPTER_LAYERS) if "mlp" in n}
    assert set(names) == want
    assert names["lora_unet_blocks_0_self_attn_q_proj"] == 8 and names["lora_unet_blocks_1_mlp_layer1"] == 4
    for bad, msg in ((dict(network_reg_lrs="a=1"), "network_reg_lrs .* not supported"),
                     (dict(train_llm_adapter="maybe"), "train_llm_adapter"),
                     (dict(exclude_patterns="['(']"), "bad regular expression"),
                     (dict(split_qkv="true"), "unknown key 'split_qkv'")):
        with pytest.raises(LoRAError, match=msg) as e:
            lora_anima.check_network_args(bad)
        assert "\n" not in str(e.value)


def test_file_keys_are_comfy_keys_and_patch_the_weights(m, tmp_path):
    torch.set_num_threads(1)
    dit = copy.deepcopy(m["dit"])
    net = lora_anima.create_network(1.0, 4, 3.0, None, None, dit, train_llm_adapter="true")
    net.apply_to(None, dit, apply_text_encoder=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lora in net.unet_loras:
            lora.lora_up.weight.normal_(0, 0.1, generator=g)
    path = str(tmp_path / "lora.safetensors")
    net.save_weights(path, None, lora_anima.file_metadata())
    sd = load_file(path)
    comfy = comfy_dit_shapes(m["dit"])
    modules = {k.split(".")[0] for k in sd}
    assert modules == set(_names(net))
    for name in modules:
        up, down = sd[name + ".lora_up.weight"], sd[name + ".lora_down.weight"]
        assert comfy[name] == (up.shape[0], down.shape[1]), name
    # the clients' patch: W + up @ down * alpha / rank, on every module the file names
    merged = copy.deepcopy(m["dit"])
    weights_by_name = {"lora_unet_" + k[:-len(".weight")].replace(".", "_"): p
                       for k, p in merged.named_parameters() if k.endswith(".weight")}
    with torch.no_grad():
        for name in modules:
            up, down, alpha = sd[name + ".lora_up.weight"], sd[name + ".lora_down.weight"], sd[name + ".alpha"]
            weights_by_name[name] += up.double().matmul(down.double()).float() * (float(alpha) / down.shape[0])
    x, sigma = torch.randn(1, 16, 4, 4, generator=g), torch.tensor([0.5])
    src, ids = torch.randn(1, 5, 32, generator=g), torch.tensor([[3, 4, 1, 0]])
    tmask, smask = (ids != 0).long(), torch.ones(1, 5, dtype=torch.long)
    with torch.no_grad():
        a = dit(x, sigma, src, ids, tmask, smask)
        b = merged(x, sigma, src, ids, tmask, smask)
        base = m["dit"](x, sigma, src, ids, tmask, smask)
    assert (a - base).abs().max() > 1e-3  # the LoRA changes the output
    assert (a - b).abs().max() / b.abs().max() < 1e-5
    # the file loads back as a network of the same shape
    net2, _ = lora_anima.create_network_from_weights(1.0, path, None, None, copy.deepcopy(m["dit"]))
    assert _names(net2) == _names(net)


def test_lora_of_another_family_is_refused(m, tmp_path):
    flux = {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 64),
            "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(192, 4),
            "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(4.0)}
    path = str(tmp_path / "flux.safetensors")
    save_file(flux, path)
    with pytest.raises(LoRAError, match="do not exist in this model.*double_blocks_0_img_attn_qkv") as e:
        lora_anima.create_network_from_weights(1.0, path, None, None, m["dit"])
    assert "\n" not in str(e.value)
    sdxl = {"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(4, 32)}
    with pytest.raises(LoRAError, match="text-encoder module; an Anima LoRA trains the DiT alone"):
        lora_anima.create_network_from_weights(1.0, None, None, None, m["dit"], weights_sd=sdxl)
    with pytest.raises(LoRAError, match="no module of Anima"):
        conv.to_comfy(flux, path)


def test_comfy_layout_round_trip(m, tmp_path):
    dit = copy.deepcopy(m["dit"])
    net = lora_anima.create_network(1.0, 2, 1.0, None, None, dit, train_llm_adapter="true",
                                    include_patterns="['x_embedder.*', 'final_layer.linear']")
    net.apply_to(None, dit, apply_text_encoder=False)
    src = str(tmp_path / "k.safetensors")
    net.save_weights(src, None, {"ss_network_module": lora_anima.NETWORK_MODULE})
    lora_anima.check_network_weights(src)  # every module (adapter, x_embedder, final_layer) is Anima's
    dst, back = str(tmp_path / "c.safetensors"), str(tmp_path / "b.safetensors")
    assert conv.main([src, dst]) == 0
    comfy = load_file(dst)
    assert "diffusion_model.llm_adapter.blocks.1.cross_attn.o_proj.lora_A.weight" in comfy
    assert "diffusion_model.x_embedder.proj.1.lora_B.weight" in comfy
    assert "diffusion_model.blocks.0.mlp.layer2.alpha" in comfy
    # every ComfyUI key names a module of the model (its weight's path)
    paths = {k for k, _ in m["dit"].named_parameters()}
    assert all(k.rsplit(".", 2)[0] + ".weight" in {"diffusion_model." + p for p in paths}
               or k.rsplit(".", 1)[0] + ".weight" in {"diffusion_model." + p for p in paths} for k in comfy)
    assert conv.main([dst, back, "--reverse"]) == 0
    a, b = load_file(src), load_file(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert conv.main([src, src]) == 2
