"""networks/oft_flux.py (sd-scripts' networks/oft_flux.py): its targets and file keys derived from
the BFL checkpoint key names, the rotation against a float64 computation written out here, a file
in sd-scripts' layout loading back (create_network_from_weights), merge == run time, and which
clients read the file (none: ComfyUI's key map has no oft_unet_ names)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.models.families.flux import tiny_flux
from networks import oft_flux
from networks.lora import LoRAError
from tests.client_key_tables import COMFY_TYPES, comfy_dit_shapes, modules_of_file


@pytest.fixture(scope="module")
def parts():
    return tiny_flux.build_tiny_flux("dev")


def _fresh():
    return tiny_flux.build_tiny_flux("dev")["transformer"]


def _expected(flux, all_linear: bool) -> dict[str, tuple]:
    """From the BFL key names: the oft name of each targeted 2-D weight -> the widths of its parts
    (sd-scripts: a double block's qkv is q, k, v; a single block's linear1 q, k, v and the MLP
    input, FLUX.1's 3072 / 12288 being the hidden and MLP widths)."""
    h, mlp = flux.config.hidden_size, flux.config.mlp_hidden_dim
    out = {}
    for k, v in flux.state_dict().items():
        if not (k.endswith(".weight") and v.dim() == 2):
            continue
        path = k[:-len(".weight")]
        if not all_linear and not (path.startswith("double_blocks.") and "_attn." in path):
            continue
        if all_linear and not path.startswith(("double_blocks.", "single_blocks.")):
            continue
        split = (h, h, h) if path.endswith("_attn.qkv") else (h, h, h, mlp) if path.endswith(".linear1") else (v.shape[0],)
        out["oft_unet_" + path.replace(".", "_")] = split
    return out


def write_sd_scripts_oft_file(flux, path: str, scale: float, seed: int, metadata: dict | None = None) -> dict:
    """An all-linear OFT file in sd-scripts' layout for ``flux`` (4 blocks per part, N(0, scale)
    oft_blocks, alpha 0.5 per module), written to ``path``; returns its tensors."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, split in _expected(flux, True).items():
        for i, width in enumerate(split):
            sd[f"{name}.oft_blocks.{i}"] = torch.randn(4, width // 4, width // 4, generator=g) * scale
        sd[name + ".alpha"] = torch.tensor(0.5)
    save_file(sd, path, metadata)
    return sd


@pytest.mark.parametrize("all_linear", [False, True])
def test_file_keys_are_sd_scripts_and_no_client_maps_them(parts, tmp_path, all_linear):
    flux = parts["transformer"]
    net = oft_flux.create_network(1.0, 4, 1e-3, None, [parts["clip_l"], parts["t5"]], flux,
                                  enable_all_linear=str(all_linear))
    path = str(tmp_path / "oft.safetensors")
    net.save_weights(path, None, {"ss_network_module": "networks.oft_flux"})
    sd = load_file(path)
    expected = _expected(flux, all_linear)
    assert not net.text_encoder_loras
    keys = {f"{n}.oft_blocks.{i}" for n, split in expected.items() for i in range(len(split))}
    assert set(sd) == keys | {n + ".alpha" for n in expected}
    for name, split in expected.items():
        for i, width in enumerate(split):
            assert tuple(sd[f"{name}.oft_blocks.{i}"].shape) == (4, width // 4, width // 4)
        assert sd[name + ".alpha"].shape == () and float(sd[name + ".alpha"]) == pytest.approx(1e-3)
    # ComfyUI: its key map has no oft_unet_ names (and its weight adapters no OFT of .oft_blocks.N)
    table = comfy_dit_shapes(flux, clip_l=parts["clip_l"], t5=parts["t5"])
    assert not set(modules_of_file(sd)) & set(table)
    assert not any(ok(p) for p in modules_of_file(sd).values() for ok in COMFY_TYPES.values())


def _reference(weight, bias, blocks, alpha, multiplier, split, x):
    """float64: per part, Q = S - S^T with its Frobenius norm clamped to alpha * width (sd-scripts'
    (min(n, c) + 1e-8) / (n + 1e-8) factor), R = (I + Q)(I - Q)^-1 per block, R_m = m (R - I) + I,
    the part's rows of each block k replaced by R_m,k^T W_k; y = x W'^T + b."""
    w = weight.double()
    rows, row = [], 0
    for s, width in zip(blocks, split):
        s = s.detach().double()
        q = s - s.transpose(1, 2)
        n = float(torch.linalg.norm(q.flatten()))
        q = q * ((min(n, alpha * width) + 1e-8) / (n + 1e-8))
        k, b = s.shape[0], s.shape[1]
        eye = torch.eye(b, dtype=torch.float64)
        part = w[row:row + width]
        for j in range(k):
            r = (eye + q[j]) @ torch.linalg.inv(eye - q[j])
            r = multiplier * (r - eye) + eye
            rows.append(r.T @ part[j * b:(j + 1) * b])
        row += width
    w_new = torch.cat(rows)
    return x.double() @ w_new.T + bias.double(), w_new


@pytest.mark.parametrize("alpha, multiplier", [(1e-3, 1.0), (10.0, 0.6)], ids=["clamped", "free"])
def test_rotation_and_merge_against_float64(alpha, multiplier):
    """Each module's output (a single block's linear1: four parts; qkv: three; the rest one) is
    the float64 rotation's; alpha 1e-3 clamps every part's skew matrix, 10 none; merge_to writes
    the same rotated weight into the layer."""
    flux = _fresh()
    net = oft_flux.create_network(multiplier, 2, alpha, None, None, flux, enable_all_linear="true")
    net.apply_to(None, flux, False, True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    chosen = ["oft_unet_double_blocks_0_img_attn_qkv", "oft_unet_single_blocks_1_linear1",
              "oft_unet_double_blocks_1_txt_mlp_2", "oft_unet_single_blocks_0_modulation_lin"]
    split = _expected(flux, True)
    merged = {}
    for name in chosen:
        m = getattr(net, name)
        layer = m.org_module
        x = torch.randn(5, layer.in_features, generator=g)
        want, w_new = _reference(layer.weight.detach(), layer.bias.detach(), list(m.oft_blocks), alpha, multiplier,
                                 split[name], x)
        with torch.no_grad():
            got = layer(x)  # the hooked forward
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
        merged[name] = w_new
    # the rotation is not the identity: the outputs moved
    assert float((merged[chosen[0]] - getattr(net, chosen[0]).org_module.weight.double()).abs().max()) > 1e-4
    sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    net.merge_to(None, flux, sd)
    for name, w_new in merged.items():
        torch.testing.assert_close(getattr(net, name).org_module.weight.double(), w_new, rtol=2e-5, atol=2e-6)


def test_a_file_in_sd_scripts_layout_loads_back(parts, tmp_path):
    """A file written as sd-scripts' OFTNetwork.save_weights writes it (safetensors save_file of
    oft_blocks.<part> and a 0-dim alpha per module, BFL names), made here from the key names
    alone: create_network_from_weights builds a network of exactly its keys, load_weights takes
    them, and the modules compute the float64 rotation of the file's tensors."""
    flux = _fresh()
    path = str(tmp_path / "sd_scripts_oft.safetensors")
    sd = write_sd_scripts_oft_file(flux, path, 0.02, seed=1, metadata={"ss_network_module": "networks.oft_flux"})
    net, _ = oft_flux.create_network_from_weights(1.0, path, None, [parts["clip_l"], parts["t5"]], flux)
    net.apply_to(None, flux, False, True)
    net.load_weights(path)
    assert set(net.state_dict()) == set(sd)
    name, expected = "oft_unet_single_blocks_0_linear1", _expected(flux, True)
    layer = getattr(net, name).org_module
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(2))
    want, _ = _reference(layer.weight.detach(), layer.bias.detach(), [sd[f"{name}.oft_blocks.{i}"] for i in range(4)],
                         0.5, 1.0, expected[name], x)
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("call, message", [
    (lambda f: oft_flux.create_network(1.0, 5, 1e-3, None, None, f),
     "networks.oft_flux: network_dim 5 (blocks) does not divide the 64 outputs of oft_unet_double_blocks_0_img_attn_qkv "
     "(a part of it); choose a divisor"),
    (lambda f: oft_flux.create_network(1.0, 4, 1e-3, None, None, f).apply_to(None, f, True, False),
     "networks.oft_flux trains the FLUX.1 transformer only; network_train_text_encoder_only leaves it nothing"),
    (lambda f: oft_flux.create_network_from_weights(1.0, None, None, None, f,
                                                    weights_sd={"lora_unet_x.lora_down.weight": torch.zeros(1, 1)}),
     "weights (state dict): a LoRA file, not an OFT file of networks.oft_flux"),
    (lambda f: oft_flux.create_network_from_weights(1.0, None, None, None, f,
                                                    weights_sd={"oft_unet_img_in.oft_blocks.0": torch.zeros(4, 1, 1)}),
     "1 module(s) do not exist in this model (wrong base model?), e.g. oft_unet_img_in"),
])
def test_bad_input_is_one_line(call, message):
    with pytest.raises(LoRAError) as e:
        call(_fresh())
    assert message in str(e.value) and "\n" not in str(e.value)
