"""networks/lora_sd3.py: module names and network_args as sd-scripts' networks/lora_sd3.py, files
that ComfyUI's key map loads with the trained delta, what diffusers 0.42 does with them, tools."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.models import t5
from library.models.families.sd3 import sd3_builtins, sd3_checkpoint
from networks import lora_dit, lora_sd3, resize_lora
from networks.lora import LoRAError
from tests.client_key_tables import comfy_dit_shapes


@pytest.fixture(scope="module")
def medium():
    """tiny SD3.5 medium (qk norm, the extra x_block attn2 in block 0) with the tiny T5 as the third encoder."""
    parts = sd3_builtins.build_builtin("tiny-sd3.5-medium")
    parts["t5"] = t5.build_tiny_t5()[0]
    return parts


def _tes(parts):
    return [parts["clip_l"], parts["clip_g"], parts["t5"]]


def _randomize(network, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)


def test_default_targets_are_every_joint_block_linear_and_both_clips(medium):
    net = lora_sd3.create_network(1.0, 4, 1, None, _tes(medium), medium["mmdit"])
    expected = {"lora_unet_" + k[:-len(".weight")].replace(".", "_") for k, v in medium["mmdit"].state_dict().items()
                if k.startswith("joint_blocks.") and k.endswith(".weight") and v.dim() == 2}
    unet = {lora.lora_name for lora in net.unet_loras}
    assert unet == expected
    assert {"lora_unet_joint_blocks_0_x_block_attn2_qkv", "lora_unet_joint_blocks_1_context_block_attn_qkv",
            "lora_unet_joint_blocks_0_context_block_adaLN_modulation_1"} <= unet
    assert "lora_unet_joint_blocks_1_context_block_attn_proj" not in unet  # the last context block is pre-only
    te = {lora.lora_name.split("_text_model_")[0] for lora in net.text_encoder_loras}
    assert te == {"lora_te1", "lora_te2"}  # T5 only with train_t5xxl


def test_block_indices_per_kind_ranks_and_emb_dims(medium):
    mmdit = medium["mmdit"]
    net = lora_sd3.create_network(1.0, 4, 1, None, [None], mmdit, train_block_indices="1")
    assert {lora.lora_name[:len("lora_unet_joint_blocks_1")] for lora in net.unet_loras} == {"lora_unet_joint_blocks_1"}
    net = lora_sd3.create_network(1.0, 4, 1, None, [None], mmdit, context_attn_dim="8", context_mlp_dim="0",
                                  context_mod_dim="2", x_attn_dim="3", x_mlp_dim="5", x_mod_dim="6",
                                  emb_dims="[1, 2, 3, 0, 4, 7]")
    rank = {lora.lora_name: lora.lora_dim for lora in net.unet_loras}
    b = "lora_unet_joint_blocks_0_"
    assert (rank[b + "context_block_attn_qkv"], rank[b + "context_block_adaLN_modulation_1"],
            rank[b + "x_block_attn2_proj"], rank[b + "x_block_mlp_fc2"], rank[b + "x_block_adaLN_modulation_1"]) \
        == (8, 2, 3, 5, 6)
    assert b + "context_block_mlp_fc1" not in rank
    assert (rank["lora_unet_context_embedder"], rank["lora_unet_t_embedder_mlp_2"], rank["lora_unet_x_embedder_proj"],
            rank["lora_unet_final_layer_adaLN_modulation_1"], rank["lora_unet_final_layer_linear"]) == (1, 2, 3, 4, 7)
    assert not any(n.startswith("lora_unet_y_embedder") for n in rank)
    assert isinstance(getattr(net, "lora_unet_x_embedder_proj").lora_down, torch.nn.Conv2d)


@pytest.mark.parametrize("args, message", [
    ({"emb_dims": "1,2"}, "emb_dims='1,2' for networks.lora_sd3 needs 6 ranks"),
    ({"x_attn_dim": "-1"}, "x_attn_dim"),
    ({"train_block_indices": "3-1"}, "train_block_indices='3-1' for networks.lora_sd3: invalid range"),
    ({"train_blocks": "single"}, "unknown key 'train_blocks' for networks.lora_sd3"),
    ({"rank_dropout": "1.5"}, "rank_dropout"),
])
def test_bad_network_args_are_one_line_naming_the_arg(args, message):
    with pytest.raises(LoRAError) as e:
        lora_sd3.check_network_args(args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_block_index_beyond_the_model(medium):
    with pytest.raises(LoRAError, match="train_block_indices.*block 2 does not exist"):
        lora_sd3.create_network(1.0, 4, 1, None, [None], medium["mmdit"], train_block_indices="0-2")


def test_every_name_maps_in_comfyui_and_the_clients_delta_is_the_trained_one(medium, tmp_path):
    """ComfyUI's key map knows every module name; its patch W + up @ down * alpha / rank (from the
    file) equals what the network adds at run time, split_qkv and the patch conv included."""
    net = lora_sd3.create_network(1.0, 2, 3, None, _tes(medium), medium["mmdit"], split_qkv="True",
                                  train_t5xxl="True", emb_dims="1,1,2,1,1,1")
    _randomize(net)
    path = str(tmp_path / "sd3.safetensors")
    net.save_weights(path, torch.float64, lora_sd3.file_metadata("sd3.5-medium"))
    sd = load_file(path)
    table = comfy_dit_shapes(medium["mmdit"], clip_l=medium["clip_l"], clip_g=medium["clip_g"], t5=medium["t5"])
    names = {k.split(".")[0] for k in sd}
    assert {n.split("_")[1] for n in names} == {"unet", "te1", "te2", "te3"}
    for name in names:
        assert name in table, name
        d, u, a = (sd[f"{name}.{p}"] for p in ("lora_down.weight", "lora_up.weight", "alpha"))
        if d.dim() == 4:  # a conv LoRA: the up is 1x1
            delta = (u.flatten(1) @ d.flatten(1)).reshape(u.shape[0], *d.shape[1:])
        else:
            delta = u @ d
        delta = delta * (float(a) / d.shape[0])
        assert tuple(delta.shape) == table[name], name
        lora = getattr(net, name)
        x = torch.randn((1, lora.org_module.in_channels, 4, 4) if d.dim() == 4 else (3, d.shape[1]),
                        dtype=torch.float64)
        lora.double()
        lora.org_forward = lambda v: torch.zeros((), dtype=torch.float64)  # the layer's own output is not under test
        runtime = lora(x)
        lora.org_forward = None
        client = torch.nn.functional.conv2d(x, delta, stride=lora.org_module.stride) if d.dim() == 4 else x @ delta.T
        torch.testing.assert_close(runtime, client, rtol=1e-10, atol=1e-12, msg=name)
    assert float(sd["lora_unet_joint_blocks_0_x_block_attn2_qkv.alpha"]) == 9.0  # 3 parts x alpha 3
    assert isinstance(getattr(net, "lora_unet_joint_blocks_0_x_block_attn2_qkv"), lora_dit.SplitLoRAModule)


def test_diffusers_042_has_no_kohya_sd3_conversion(medium, tmp_path):
    """Pinned: diffusers' SD3 loader reads only its own layout (PEFT keys under "transformer."), so a
    kohya SD3 file (sd-scripts', ours) patches nothing there; ComfyUI and Forge load it."""
    from diffusers.loaders.lora_pipeline import SD3LoraLoaderMixin

    net = lora_sd3.create_network(1.0, 4, 1, None, [None], medium["mmdit"])
    _randomize(net)
    state = SD3LoraLoaderMixin.lora_state_dict({k: v for k, v in net.state_dict().items()})
    transformer = sd3_checkpoint.mmdit_to_diffusers(medium["mmdit"])
    transformer.load_lora_adapter(state, prefix="transformer")
    assert not any(hasattr(m, "lora_A") and len(m.lora_A) for _, m in transformer.named_modules())


def test_network_from_weights_metadata_and_resize(medium, tmp_path):
    net = lora_sd3.create_network(1.0, 8, 4, None, _tes(medium), medium["mmdit"], emb_dims="0,0,2,0,0,3",
                                  train_t5xxl="True", x_mlp_dim="6")
    _randomize(net)
    src, dst = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    net.save_weights(src, None, lora_sd3.file_metadata("sd3.5-medium"))
    back, _ = lora_sd3.create_network_from_weights(1.0, src, None, _tes(medium), medium["mmdit"])
    back.load_weights(src)
    torch.testing.assert_close(back.state_dict(), load_file(src))
    resize_lora.main(["--model", src, "--save_to", dst, "--new_rank", "2"])
    a, b = load_file(src), load_file(dst)
    assert a.keys() == b.keys()
    assert b["lora_unet_x_embedder_proj.lora_down.weight"].shape == (2, 16, 2, 2)
    with safe_open(dst, "pt") as f:
        meta = f.metadata()
    assert (meta["ss_network_module"], meta["ss_base_model_version"], meta["modelspec.architecture"]) == \
        ("networks.lora_sd3", "5-medium", "stable-diffusion-3-5-medium/lora")


def test_runtime_equals_the_files_merged_weights(medium):
    """The network hooked into the whole MMDiT (split_qkv, every emb_dims layer, the patch conv
    included) gives the output of the model whose weights are W + up @ down * alpha / rank from
    the saved state (float64)."""
    import copy

    model = copy.deepcopy(medium["mmdit"]).double()
    net = lora_sd3.create_network(1.0, 2, 3, None, [None], model, split_qkv="True", emb_dims="1,1,2,1,1,1")
    _randomize(net)
    net.double()
    merged = copy.deepcopy(model)
    weights, sd = merged.state_dict(), net.state_dict()
    for lora in net.unet_loras:
        d, u, a = (sd[f"{lora.lora_name}.{p}"] for p in ("lora_down.weight", "lora_up.weight", "alpha"))
        delta = (u.flatten(1) @ d.flatten(1)).reshape(u.shape[0], *d.shape[1:]) * (float(a) / d.shape[0])
        key = next(k for k in weights if "lora_unet_" + k[:-len(".weight")].replace(".", "_") == lora.lora_name)
        weights[key] += delta
    g = torch.Generator().manual_seed(4)
    inputs = (torch.randn(1, 16, 8, 8, generator=g, dtype=torch.float64), torch.tensor([500.0], dtype=torch.float64),
              torch.randn(1, 96, generator=g, dtype=torch.float64),
              torch.randn(1, 5, 128, generator=g, dtype=torch.float64))
    net.apply_to(None, model, apply_text_encoder=False)
    try:
        out = model(*inputs)
    finally:
        net.remove_from()
    torch.testing.assert_close(out, merged(*inputs), rtol=1e-9, atol=1e-10)
    assert not torch.allclose(out, model(*inputs))  # the LoRA changes the output
