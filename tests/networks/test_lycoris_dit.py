"""LyCORIS (``lycoris.kohya``, the installed 3.x) on the FLUX.1 and SD3 transformers, as sd-scripts'
flux_train_network.py / sd3_train_network.py run it: the module names are the ones LyCORIS makes
on sd-scripts' module tree (its targets are block classes by name: FLUX's DoubleStreamBlock /
SingleStreamBlock, sd-scripts' SD3 SingleDiTBlock; the text encoders [CLIP-L, T5] / [CLIP-L,
CLIP-G, T5] as one list, prefixes lora_te1.. by position, T5 untouched), derived here from the
BFL / SAI checkpoint keys; every name is in ComfyUI's key map and the client's patch is what the
network adds at run time; each LyCORIS algorithm the SD models train with trains the FLUX.1
transformer."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from library.models import t5
from library.models.families.flux import flux, tiny_flux
from library.models.families.sd3 import sd3_builtins
from networks import adapter_weights, lora_names
from tests.client_key_tables import COMFY_TYPES, comfy_dit_shapes, modules_of_file

lycoris_kohya = pytest.importorskip("lycoris.kohya")


@pytest.fixture(scope="module")
def fx():
    return tiny_flux.build_tiny_flux("dev")


@pytest.fixture(scope="module")
def medium():
    parts = sd3_builtins.build_builtin("tiny-sd3.5-medium")
    parts["t5"] = t5.build_tiny_t5(parts["mmdit"].config.context_dim)[0]
    return parts


def _weight_names(model, prefix: str, under: tuple[str, ...]) -> set[str]:
    """Independent of any module walk: the kohya name of every 2-D weight of the checkpoint keys
    under the given paths."""
    return {f"{prefix}_" + k[:-len(".weight")].replace(".", "_") for k, v in model.state_dict().items()
            if k.endswith(".weight") and v.dim() == 2 and k.startswith(under)}


def _clip_names(clip, prefix: str) -> set[str]:
    """The CLIP attention and MLP projections, in transformers' text_model layout (what sd-scripts'
    CLIP models and the clients name)."""
    out = set()
    for k in clip.state_dict():
        path = k if k.startswith("text_model.") else "text_model." + k
        if ".layers." in path and path.endswith(("_proj.weight", "fc1.weight", "fc2.weight")):
            out.add(f"{prefix}_" + path[:-len(".weight")].replace(".", "_"))
    return out


def _file(net, tes, model) -> dict:
    """The state dict the trainer writes: LyCORIS' names translated by lora_names (as
    library/training/methods.py NetworkMethod.save does)."""
    return lora_names.rename_keys(net.state_dict(), lora_names.plain_to_kohya_names(tes, model))


def _create(tes, model, **args):
    net = lycoris_kohya.create_network(1.0, 4, 2, None, tes, model, **args)
    net.apply_to(tes, model, True, True)
    return net


def test_flux_names_are_sd_scripts_lycoris_names(fx):
    tes = [fx["clip_l"], fx["t5"]]
    sd = _file(_create(tes, fx["transformer"], algo="lokr"), tes, fx["transformer"])
    names = {k.split(".")[0] for k in sd}
    expected = _weight_names(fx["transformer"], "lora_unet", ("double_blocks.", "single_blocks.")) | \
        _clip_names(fx["clip_l"], "lora_te1")
    assert names == expected
    assert "lora_unet_double_blocks_0_img_attn_qkv" in names and "lora_unet_single_blocks_1_modulation_lin" in names
    assert "lora_unet_double_blocks_0_img_attn_qkv.lokr_w1" in sd
    # the attn-only preset: the double blocks' SelfAttention layers (BFL's class name)
    sd = _file(_create(tes, fx["transformer"], algo="locon", preset="attn-only"), tes, fx["transformer"])
    unet = {k.split(".")[0] for k in sd if k.startswith("lora_unet_")}
    assert unet == {n for n in _weight_names(fx["transformer"], "lora_unet", ("double_blocks.",)) if "_attn_" in n}
    lycoris_kohya.LycorisNetworkKohya.apply_preset(lycoris_kohya.PRESET["full"])  # the class keeps presets


def test_sd3_names_are_sd_scripts_lycoris_names(medium):
    """SingleDiTBlock (both streams of every joint block, the extra attn2 included) and both CLIPs;
    not the embedders, not the final layer (sd-scripts' UnPatch is no target), not T5."""
    tes = [medium["clip_l"], medium["clip_g"], medium["t5"]]
    sd = _file(_create(tes, medium["mmdit"], algo="loha"), tes, medium["mmdit"])
    names = {k.split(".")[0] for k in sd}
    expected = _weight_names(medium["mmdit"], "lora_unet", ("joint_blocks.",)) | \
        _clip_names(medium["clip_l"], "lora_te1") | _clip_names(medium["clip_g"], "lora_te2")
    assert names == expected
    assert "lora_unet_joint_blocks_0_x_block_attn2_qkv" in names
    assert "lora_unet_joint_blocks_0_context_block_attn_qkv" in names
    # attn-only: sd-scripts' SD3 attention class (AttentionLinears) is none of LyCORIS' targets
    sd = _file(_create(tes, medium["mmdit"], algo="locon", preset="attn-only"), tes, medium["mmdit"])
    assert not any(k.startswith("lora_unet_") for k in sd)
    lycoris_kohya.LycorisNetworkKohya.apply_preset(lycoris_kohya.PRESET["full"])


def _randomize(net, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1)


@pytest.mark.parametrize("family, algo", [("flux", "lokr"), ("flux", "loha"), ("sd3", "locon")])
def test_every_name_maps_in_comfyui_and_the_patch_is_the_trained_delta(fx, medium, family, algo):
    """ComfyUI's key map has each module, its weight adapter takes the module's tensors, and the
    patch a client computes from them (adapter_weights: up @ down, Hadamard, Kronecker, times
    alpha / rank) is what the LyCORIS module adds at run time (float64)."""
    if family == "flux":
        model, tes = fx["transformer"], [fx["clip_l"], fx["t5"]]
        table = comfy_dit_shapes(model, clip_l=fx["clip_l"], t5=fx["t5"])
    else:
        model, tes = medium["mmdit"], [medium["clip_l"], medium["clip_g"], medium["t5"]]
        table = comfy_dit_shapes(model, clip_l=medium["clip_l"], clip_g=medium["clip_g"], t5=medium["t5"])
    model, tes = copy.deepcopy(model).double(), [copy.deepcopy(te).double() for te in tes]
    net = lycoris_kohya.create_network(1.0, 4, 2, None, tes, model, algo=algo, factor=4)
    net.apply_to(tes, model, True, True)
    net.double()
    _randomize(net)
    sd = _file(net, tes, model)
    kohya_of = {v: k for k, v in lora_names.plain_to_kohya_names(tes, model).items()}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parts in modules_of_file(sd).items():
            assert name in table, name
            assert any(ok(parts) for ok in COMFY_TYPES.values()), (name, parts)
            delta = adapter_weights.module_delta({p: sd[f"{name}.{p}"] for p in parts},
                                                 torch.empty(table[name]), torch.float64)
            module = getattr(net, kohya_of.get(name, name))
            layer = module.org_module[0]
            assert tuple(delta.shape) == tuple(layer.weight.shape) == table[name]
            x = torch.randn(3, layer.weight.shape[1], generator=g, dtype=torch.float64)
            got = module(x) - F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(got, x @ delta.T, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("algo, dim", [("locon", 4), ("loha", 4), ("lokr", 4), ("dylora", 4), ("glora", 4),
                                       ("boft", 32), ("diag-oft", 4)])
def test_each_algorithm_trains_the_flux_transformer(algo, dim):
    """One forward and backward of tiny FLUX.1 dev with the algorithm's network (GUI types
    LyCORIS/LoCon, LoHa, LoKr, DyLoRA, GLoRA, BOFT, Diag-OFT): every Linear of the blocks has a
    module and every module gets a gradient (none is skipped or disconnected)."""
    model = tiny_flux.build_tiny_flux("dev")["transformer"]
    torch.manual_seed(0)
    # (BOFT: a rank of 4 cannot factor the tiny widths, "impossible to decompose 384 with factor 4")
    net = lycoris_kohya.create_network(1.0, dim, 2, None, None, model, algo=algo)
    net.apply_to(None, model, False, True)
    _randomize(net, 3)
    cfg = model.config
    g = torch.Generator().manual_seed(2)
    img = torch.randn(1, 16, cfg.in_channels, generator=g)
    txt = torch.randn(1, 8, cfg.context_in_dim, generator=g)
    out = model(img, flux.image_ids(4, 4), txt, flux.text_ids(8), torch.tensor([0.5]),
                torch.randn(1, cfg.vec_in_dim, generator=g), guidance=torch.tensor([3.5]))
    out.square().mean().backward()
    assert len(net.unet_loras) == len(_weight_names(model, "lora_unet", ("double_blocks.", "single_blocks.")))
    for m in net.unet_loras:
        grads = [p.grad for p in m.parameters() if p.requires_grad]
        assert grads and any(gr is not None and float(gr.abs().max()) > 0 for gr in grads), m.lora_name
