"""networks/convert_flux_lora.py: a kohya FLUX.1 LoRA converted to ai-toolkit's layout loads in
diffusers' FluxPipeline with every key consumed and the kohya deltas; an ai-toolkit file made by
PEFT converted to kohya's layout loads in networks.lora_flux and ComfyUI's key map with PEFT's
merged weights; sd-scripts' fused-qkv construction exactly; bad input one line, exit 2."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from library.models.families.flux import flux_checkpoint, flux_saving, tiny_flux
from networks import convert_flux_lora, lora_flux
from networks.lora import write_weights
from tests.client_key_tables import comfy_dit_shapes
from tests.conftest import ROOT
from tests.helpers import load_lora_logged


@pytest.fixture(scope="module")
def parts():
    return tiny_flux.build_tiny_flux("dev")


@pytest.fixture(scope="module")
def folder(parts, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("flux") / "tiny-flux")
    flux_saving.save_diffusers_folder(parts, "dev", path)
    return path


def _randomize(network, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)


def _kohya_expected(weights: dict, sd: dict) -> dict:
    """float64 W + up @ down * alpha / rank for every BFL weight the kohya file names; W elsewhere."""
    out = {}
    for k, w in weights.items():
        exp = w.double().clone()
        name = "lora_unet_" + k.rsplit(".", 1)[0].replace(".", "_")
        if k.endswith(".weight") and name + ".lora_down.weight" in sd:
            d, u, a = (sd[f"{name}.{p}"].double() for p in ("lora_down.weight", "lora_up.weight", "alpha"))
            exp += u @ d * (float(a) / d.shape[0])
        out[k] = exp
    return out


def test_kohya_file_converted_loads_in_diffusers_with_the_kohya_deltas(parts, folder, tmp_path, capsys):
    """One file with both of sd-scripts' fused cases: split_qkv modules (block-diagonal up: cut into
    the parts' own A / B) on block 0, plain ones (each part gets the whole down) on block 1, the
    input layers, scales 3/4 and 1/4 (sd-scripts' powers-of-two balance), and CLIP-L modules
    (left out with a warning). diffusers loads the PEFT keys directly: every key consumed, every
    fused weight W + up @ down * alpha / rank of the kohya file in float64."""
    from diffusers import FluxPipeline

    flux = parts["transformer"]
    split = lora_flux.create_network(1.0, 4, 3, None, [parts["clip_l"]], flux, split_qkv="True",
                                     train_double_block_indices="0", train_single_block_indices="0")
    plain = lora_flux.create_network(1.0, 4, 1, None, [None], flux, in_dims="1,2,3,4,5",
                                     train_double_block_indices="1", train_single_block_indices="1")
    _randomize(split, 0)
    _randomize(plain, 1)
    sd = {**split.state_dict(), **plain.state_dict()}
    src, dst = str(tmp_path / "kohya.safetensors"), str(tmp_path / "ait.safetensors")
    write_weights(src, sd, torch.float64, lora_flux.file_metadata("dev"))
    assert convert_flux_lora.main(["--src", "sd-scripts", "--dst", "ai-toolkit", "--src_path", src,
                                   "--dst_path", dst]) == 0
    err = capsys.readouterr().err
    n_te = 6 * parts["clip_l"].config.num_hidden_layers
    assert f"warning: {n_te} text-encoder modules left out" in err and "lora_te1_text_model_encoder_layers_0" in err
    ait = load_file(dst)
    assert all(k.startswith("transformer.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in ait)
    # the split module's parts have their own rank 4; the plain one's parts the whole down (rank 4 too)
    assert ait["transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight"].shape == (4, 64)
    assert torch.equal(ait["transformer.transformer_blocks.1.attn.to_q.lora_A.weight"],
                       ait["transformer.transformer_blocks.1.attn.to_v.lora_A.weight"])
    with safe_open(dst, "pt") as f:
        assert f.metadata()["ss_network_module"] == "networks.lora_flux"  # kept, as sd-scripts

    pipe = FluxPipeline.from_pretrained(folder, torch_dtype=torch.float64)
    log = load_lora_logged(pipe, dst)
    # the one note diffusers gives: the file has no CLIP-L keys (ai-toolkit's layout has none)
    log = "\n".join(line for line in log.splitlines() if "cliptextmodel" not in line)
    assert "unexpected" not in log and "unsupported" not in log and "incompatible" not in log, log
    layers = [m for m in pipe.transformer.modules() if hasattr(m, "lora_A") and len(m.lora_A)]
    assert len(layers) == sum(k.endswith(".lora_A.weight") for k in ait)
    pipe.fuse_lora(components=["transformer"])
    pipe.unload_lora_weights()
    fused = flux_checkpoint.diffusers_to_bfl(pipe.transformer.state_dict(), flux.config)
    expected = _kohya_expected(flux.state_dict(), load_file(src))
    changed = [k for k in expected if not torch.equal(expected[k], flux.state_dict()[k].double())]
    assert "single_blocks.0.linear1.weight" in changed and "guidance_in.out_layer.weight" in changed
    for k in expected:
        torch.testing.assert_close(fused[k], expected[k], rtol=0, atol=1e-12, msg=k)


def _peft_file(folder: str, path: str):
    """An ai-toolkit-layout file made by PEFT (diffusers' save_lora_weights), r 2, lora_alpha 4, on
    every Linear of the tiny transformer (final layer and norm_out included), random B; and the
    transformer's weights with the adapter merged by PEFT (BFL layout, float64)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = FluxTransformer2DModel.from_pretrained(os.path.join(folder, "transformer"), torch_dtype=torch.float64)
    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
               "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear",
               "norm1_context.linear", "norm.linear", "proj_mlp", "proj_out", "x_embedder", "context_embedder",
               "linear_1", "linear_2", "norm_out.linear"]
    config = LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights="gaussian")
    model.add_adapter(config)
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    lora_sd = get_peft_model_state_dict(model)
    FluxPipeline.save_lora_weights(os.path.dirname(path), transformer_lora_layers=lora_sd,
                                   transformer_lora_adapter_metadata=config.to_dict(),
                                   weight_name=os.path.basename(path))
    model.fuse_lora(lora_scale=1.0)
    model.unload_lora()
    return len(lora_sd) // 2, model.state_dict()


def test_peft_file_converted_loads_in_lora_flux_and_comfyui_with_peft_deltas(parts, folder, tmp_path, capsys):
    flux = parts["transformer"]
    src, dst = str(tmp_path / "peft.safetensors"), str(tmp_path / "kohya.safetensors")
    n_peft, peft_merged = _peft_file(folder, src)
    merged = flux_checkpoint.diffusers_to_bfl(peft_merged, flux.config)  # the reference: PEFT's own merge
    assert convert_flux_lora.main(["--src_path", src, "--dst_path", dst]) == 0  # sd-scripts' defaults
    assert "converted" in capsys.readouterr().out
    sd = load_file(dst)
    names = {k.split(".")[0] for k in sd}
    # the q/k/v of 2 double blocks x 2 streams and the q/k/v/mlp of 2 single blocks become one module each
    assert len(names) == n_peft - 2 * 2 * 2 - 2 * 3
    # ComfyUI's key map: every name a real weight of the shape up @ down makes; its delta is PEFT's
    table = comfy_dit_shapes(flux)
    base = {k: v.double() for k, v in flux.state_dict().items()}
    for name in names:
        assert name in table, name
        assert (sd[name + ".lora_up.weight"].shape[0], sd[name + ".lora_down.weight"].shape[1]) == table[name][:2]
    expected = _kohya_expected(base, sd)
    assert sum(not torch.equal(expected[k], base[k]) for k in expected) == len(names)
    for k in expected:
        torch.testing.assert_close(expected[k], merged[k].double(), rtol=0, atol=1e-12, msg=k)
    # our network reads it (the final layer is no networks.lora_flux target: left to the clients);
    # each module's own delta, scale x up @ down in float64, is PEFT's
    ours = {k: v for k, v in sd.items() if not k.startswith("lora_unet_final_layer")}
    net, _ = lora_flux.create_network_from_weights(1.0, None, None, [None], flux, weights_sd=ours)
    net.double()
    assert not net.load_state_dict(ours, strict=True).missing_keys
    assert len(net.unet_loras) == len(names) - 2
    for lora in net.unet_loras:
        key = lora.lora_name[len("lora_unet_"):]
        key = next(k for k in base if k.endswith(".weight") and k[:-len(".weight")].replace(".", "_") == key)
        delta = lora.lora_up.weight @ lora.lora_down.weight * lora.scale
        torch.testing.assert_close(base[key] + delta, merged[key].double(), rtol=0, atol=1e-12, msg=key)
    with safe_open(dst, "pt") as f:
        meta = f.metadata()
    assert (meta["ss_network_module"], meta["ss_base_model_version"], meta["ss_network_dim"]) == \
        ("networks.lora_flux", "flux1", "Dynamic")
    assert "lora_adapter_metadata" not in meta  # its alpha is now in the factors / .alpha


def test_ai_toolkit_qkv_becomes_sd_scripts_block_diagonal_module(tmp_path):
    """sd-scripts' convert_to_sd_scripts_cat, by hand: down = the parts' A stacked, up block-
    diagonal of the parts' B, alpha = parts x rank; a single module keeps A / B with alpha = rank.
    Back to ai-toolkit the parts come out bit for bit (the up is block-diagonal)."""
    g = torch.Generator().manual_seed(0)
    parts = {"to_q": 64, "to_k": 64, "to_v": 64, "proj_mlp": 256}
    ait = {}
    for part, width in parts.items():
        key = f"transformer.single_transformer_blocks.3.{'attn.' if part != 'proj_mlp' else ''}{part}"
        ait[key + ".lora_A.weight"] = torch.randn(2, 64, generator=g)
        ait[key + ".lora_B.weight"] = torch.randn(width, 2, generator=g)
    ait["transformer.single_transformer_blocks.3.proj_out.lora_A.weight"] = torch.randn(3, 320, generator=g)
    ait["transformer.single_transformer_blocks.3.proj_out.lora_B.weight"] = torch.randn(64, 3, generator=g)
    src, dst, back = (str(tmp_path / f"{n}.safetensors") for n in ("ait", "kohya", "back"))
    save_file(ait, src)
    assert convert_flux_lora.main(["--src", "ai-toolkit", "--dst", "sd-scripts", "--src_path", src,
                                   "--dst_path", dst]) == 0
    sd = load_file(dst)
    name = "lora_unet_single_blocks_3_linear1"
    a = [ait[f"transformer.single_transformer_blocks.3.{p}.lora_A.weight"]
         for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")]
    b = [ait[f"transformer.single_transformer_blocks.3.{p}.lora_B.weight"]
         for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")]
    assert torch.equal(sd[name + ".lora_down.weight"], torch.cat(a))
    assert torch.equal(sd[name + ".lora_up.weight"], torch.block_diag(*b))
    assert float(sd[name + ".alpha"]) == 8.0
    assert torch.equal(sd["lora_unet_single_blocks_3_linear2.lora_down.weight"],
                       ait["transformer.single_transformer_blocks.3.proj_out.lora_A.weight"])
    assert float(sd["lora_unet_single_blocks_3_linear2.alpha"]) == 3.0
    assert convert_flux_lora.main(["--src", "sd-scripts", "--dst", "ai-toolkit", "--src_path", dst,
                                   "--dst_path", back]) == 0
    again = load_file(back)
    assert again.keys() == ait.keys() and all(torch.equal(again[k], ait[k]) for k in ait)


@pytest.mark.parametrize("case, message", [
    ("missing", "--src_path {d}/none.safetensors: file not found"),
    ("same", "--dst_path {d}/kohya.safetensors: is --src_path"),
    ("layout", "{d}/kohya.safetensors: a kohya (sd-scripts) LoRA file (lora_down / lora_up keys); use --src sd-scripts"),
    ("sd3", "{d}/sd3.safetensors: module lora_unet_joint_blocks_0_x_block_attn_qkv is not one of a FLUX.1 "
            "transformer"),
    ("src", "--src 'kohya': expected ai-toolkit or sd-scripts"),
    ("partial", "has single_transformer_blocks.0.attn.to_q but not single_transformer_blocks.0.attn.to_k"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, case, message):
    d = str(tmp_path)
    kohya = str(tmp_path / "kohya.safetensors")
    save_file({"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": torch.ones(2, 8),
               "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": torch.ones(8, 2)}, kohya)
    save_file({"lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight": torch.ones(2, 8),
               "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight": torch.ones(24, 2)}, d + "/sd3.safetensors")
    save_file({"transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 8),
               "transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(8, 2)},
              d + "/partial.safetensors")
    out = d + "/out.safetensors"
    argv = {"missing": ["--src_path", d + "/none.safetensors", "--dst_path", out],
            "same": ["--src", "sd-scripts", "--dst", "ai-toolkit", "--src_path", kohya, "--dst_path", kohya],
            "layout": ["--src_path", kohya, "--dst_path", out],
            "sd3": ["--src", "sd-scripts", "--dst", "ai-toolkit", "--src_path", d + "/sd3.safetensors",
                    "--dst_path", out],
            "src": ["--src", "kohya", "--src_path", kohya, "--dst_path", out],
            "partial": ["--src_path", d + "/partial.safetensors", "--dst_path", out]}[case]
    before = load_file(kohya)
    assert convert_flux_lora.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message.format(d=d) in err, err
    assert not os.path.exists(out) and sorted(os.listdir(d)) == ["kohya.safetensors", "partial.safetensors",
                                                                 "sd3.safetensors"]
    assert all(torch.equal(v, before[k]) for k, v in load_file(kohya).items())


def test_help_from_a_plain_checkout():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "networks", "convert_flux_lora.py"), "--help"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "--src_path" in proc.stdout and "--save_precision" in proc.stdout, proc.stderr
