"""networks/lora_flux.py: module names and network_args as sd-scripts' networks/lora_flux.py, files
that diffusers' kohya FLUX converter and ComfyUI's key map load, split_qkv, tools."""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.models.families.flux import flux_checkpoint, flux_saving, tiny_flux
from networks import lora_dit, lora_flux, resize_lora
from networks.lora import LoRAError, write_weights
from tests.client_key_tables import comfy_dit_shapes
from tests.helpers import load_lora_logged


@pytest.fixture(scope="module")
def parts():
    return tiny_flux.build_tiny_flux("dev")


def _randomize(network, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def _block_weight_names(flux) -> set[str]:
    """Independent of the module walk: the kohya name of every 2-D weight of the blocks."""
    return {"lora_unet_" + k[:-len(".weight")].replace(".", "_") for k, v in flux.state_dict().items()
            if k.endswith(".weight") and v.dim() == 2 and k.startswith(("double_blocks.", "single_blocks."))}


def test_default_targets_are_every_block_linear_and_clip(parts):
    net = lora_flux.create_network(1.0, 4, 1, None, [parts["clip_l"], parts["t5"]], parts["transformer"])
    unet = {lora.lora_name for lora in net.unet_loras}
    assert unet == _block_weight_names(parts["transformer"])
    assert "lora_unet_double_blocks_0_img_attn_qkv" in unet and "lora_unet_single_blocks_1_modulation_lin" in unet
    te = {lora.lora_name for lora in net.text_encoder_loras}
    assert te and all(n.startswith("lora_te1_text_model_encoder_layers_") for n in te)  # no T5 by default
    assert len(te) == 6 * parts["clip_l"].config.num_hidden_layers


def test_block_selection_and_per_kind_ranks(parts):
    flux = parts["transformer"]
    net = lora_flux.create_network(1.0, 4, 1, None, [None], flux, train_blocks="single")
    assert {lora.lora_name.split("_")[2] for lora in net.unet_loras} == {"single"}
    net = lora_flux.create_network(1.0, 4, 1, None, [None], flux, train_double_block_indices="1",
                                   train_single_block_indices="none")
    assert {lora.lora_name[:len("lora_unet_double_blocks_1")] for lora in net.unet_loras} == \
        {"lora_unet_double_blocks_1"}
    dims = dict(img_attn_dim="8", txt_attn_dim="0", img_mlp_dim="2", txt_mlp_dim="3", img_mod_dim="5",
                txt_mod_dim="6", single_dim="7", single_mod_dim="0", in_dims="[1, 0, 2, 3, 0]")
    net = lora_flux.create_network(1.0, 4, 1, None, [None], flux, **dims)
    rank = {lora.lora_name: lora.lora_dim for lora in net.unet_loras}
    b = "lora_unet_double_blocks_0_"
    assert (rank[b + "img_attn_qkv"], rank[b + "img_attn_proj"], rank[b + "img_mlp_2"], rank[b + "img_mod_lin"],
            rank[b + "txt_mlp_0"], rank[b + "txt_mod_lin"]) == (8, 8, 2, 5, 3, 6)
    assert b + "txt_attn_qkv" not in rank and "lora_unet_single_blocks_0_modulation_lin" not in rank
    assert rank["lora_unet_single_blocks_1_linear1"] == rank["lora_unet_single_blocks_1_linear2"] == 7
    assert (rank["lora_unet_img_in"], rank["lora_unet_vector_in_out_layer"], rank["lora_unet_guidance_in_in_layer"]) \
        == (1, 2, 3)
    assert not any(n.startswith(("lora_unet_time_in", "lora_unet_txt_in")) for n in rank)


@pytest.mark.parametrize("args, message", [
    ({"train_blocks": "both"}, "train_blocks='both'"),
    ({"img_attn_dim": "x"}, "img_attn_dim"),
    ({"in_dims": "1,2,3"}, "in_dims='1,2,3' for networks.lora_flux needs 5 ranks"),
    ({"train_double_block_indices": "0-a"}, "train_double_block_indices"),
    ({"split_qkv": "maybe"}, "split_qkv"),
    ({"ggpo_beta": "0.01"}, "ggpo_beta (sd-scripts' LoRA-GGPO) is not supported"),
    ({"block_dims": "1,2"}, "unknown key 'block_dims' for networks.lora_flux"),
])
def test_bad_network_args_are_one_line_naming_the_arg(args, message):
    with pytest.raises(LoRAError) as e:
        lora_flux.check_network_args(args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_block_index_beyond_the_model(parts):
    with pytest.raises(LoRAError, match="train_single_block_indices.*block 5 does not exist.*0-1"):
        lora_flux.create_network(1.0, 4, 1, None, [None], parts["transformer"], train_single_block_indices="0,5")


def test_split_qkv_module_is_sd_scripts_split_lora_and_its_file_is_exact(parts, tmp_path):
    flux = parts["transformer"]
    net = lora_flux.create_network(1.0, 2, 3, None, [None], flux, split_qkv="True", train_blocks="single")
    _randomize(net)
    lora = getattr(net, "lora_unet_single_blocks_0_linear1")
    assert isinstance(lora, lora_dit.SplitLoRAModule)
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    # sd-scripts' split forward: each part has its own down (r x in) and up; the output parts concatenated
    down = lora.lora_down.weight.double()
    ups = [p.weight.double() for p in lora.lora_up.parts]
    expected = torch.cat([x @ down[i * 2:(i + 1) * 2].T @ u.T for i, u in enumerate(ups)], -1) * (3 / 2)
    lora.double()
    net.apply_to(None, flux, apply_text_encoder=False)
    try:
        base = torch.nn.functional.linear(x, flux.single_blocks[0].linear1.weight.double(),
                                          flux.single_blocks[0].linear1.bias.double())
        flux.double()
        got = flux.single_blocks[0].linear1(x) - base
    finally:
        net.remove_from()
        flux.float()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    path = str(tmp_path / "split.safetensors")
    net.save_weights(path, torch.float64, None)
    sd = load_file(path)
    d, u, a = (sd["lora_unet_single_blocks_0_linear1." + k] for k in ("lora_down.weight", "lora_up.weight", "alpha"))
    assert d.shape == (8, 64) and u.shape == (64 * 3 + 256, 8) and float(a) == 12.0  # 4 parts x alpha 3
    # what a client computes from the file is the trained delta
    torch.testing.assert_close(u @ d * (a / d.shape[0]),
                               torch.cat([u_i @ down[i * 2:(i + 1) * 2] for i, u_i in enumerate(ups)]) * 1.5)
    # read back by a split network; a non-block-diagonal up (e.g. a resized file) is refused by name
    again = lora_flux.create_network(1.0, 2, 3, None, [None], flux, split_qkv="True", train_blocks="single")
    again.load_weights(path)
    torch.testing.assert_close(again.state_dict(), {k: v.float() for k, v in sd.items()})
    sd["lora_unet_single_blocks_0_linear1.lora_up.weight"] += 1.0
    write_weights(path, sd, None, None)
    with pytest.raises(LoRAError, match="lora_unet_single_blocks_0_linear1: lora_up.weight is not block-diagonal"):
        again.load_weights(path)


def _expected(weights, sd, prefix, path_of):
    """float64 W + up @ down * alpha / rank for every weight the file names, W elsewhere."""
    out = {}
    for k, w in weights.items():
        exp = w.double().clone()
        name = prefix + path_of(k.rsplit(".", 1)[0]).replace(".", "_")
        if k.endswith(".weight") and name + ".lora_down.weight" in sd:
            d, u, a = (sd[f"{name}.{p}"] for p in ("lora_down.weight", "lora_up.weight", "alpha"))
            exp += u.double() @ d.double() * (float(a) / d.shape[0])
        out[k] = exp
    return out


def test_file_loads_in_diffusers_every_key_consumed_and_weights_exact(parts, tmp_path):
    from diffusers import FluxPipeline

    folder = str(tmp_path / "tiny-flux")
    flux_saving.save_diffusers_folder(parts, "dev", folder)
    net = lora_flux.create_network(1.0, 4, 2, None, [parts["clip_l"], parts["t5"]], parts["transformer"],
                                   in_dims="[1,2,3,4,5]", split_qkv="True")
    _randomize(net)
    # diffusers' converter hard-codes FLUX.1's widths for single_blocks linear1 (3072 x 3 + 12288): the
    # tiny model's linear1 leaves the file here and is checked at full width below
    sd = {k: v for k, v in net.state_dict().items() if "_linear1." not in k}
    path = str(tmp_path / "flux_lora.safetensors")
    write_weights(path, sd, torch.float64, lora_flux.file_metadata("dev"))
    pipe = FluxPipeline.from_pretrained(folder, torch_dtype=torch.float64)
    log = load_lora_logged(pipe, path)
    assert "unsupported keys" not in log and "unexpected" not in log and "incompatible" not in log, log
    file_sd = load_file(path)
    n_modules = sum(1 for k in file_sd if k.endswith(".alpha"))
    # diffusers splits each fused qkv into to_q, to_k, to_v: one PEFT layer per part
    n_qkv = sum(1 for k in file_sd if k.endswith("_qkv.alpha"))
    # diffusers 0.42 converts in_dims' layers (img_in, time_in, vector_in, guidance_in, txt_in) to
    # keys without its "transformer." prefix and then drops them without a word: pinned here
    in_layers = {n for n in (k.split(".")[0] for k in file_sd) if n.startswith(tuple(
        "lora_unet_" + layer for layer in lora_flux.IN_LAYERS))}
    assert len(in_layers) == 8
    layers = [m for _, m in list(pipe.transformer.named_modules()) + list(pipe.text_encoder.named_modules())
              if hasattr(m, "lora_A") and len(m.lora_A)]
    assert len(layers) == n_modules - len(in_layers) + 2 * n_qkv
    pipe.fuse_lora(components=["transformer", "text_encoder"])
    pipe.unload_lora_weights()
    fused = flux_checkpoint.diffusers_to_bfl(pipe.transformer.state_dict(), parts["transformer"].config)
    applied = {k: v for k, v in file_sd.items() if k.split(".")[0] not in in_layers}
    expected = _expected(parts["transformer"].state_dict(), applied, "lora_unet_", lambda p: p)
    assert fused.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(fused[k], expected[k], rtol=0, atol=1e-12, msg=k)
    te_expected = _expected(parts["clip_l"].state_dict(), file_sd, "lora_te1_",
                            lambda p: p if p.startswith("text_model.") else "text_model." + p)
    te_fused = pipe.text_encoder.state_dict()
    for k in te_expected:
        torch.testing.assert_close(te_fused[k].double(), te_expected[k], rtol=0, atol=1e-12, msg=k)


def test_full_width_linear1_converts_in_diffusers_to_the_same_delta():
    """single_blocks linear1 at FLUX.1's real widths (the module without the model): diffusers'
    to_q / to_k / to_v / proj_mlp deltas are the row slices of up @ down * alpha / rank, for a
    split_qkv file (block-diagonal up) and a plain one; compared as linear maps on random probes
    (the full 21504 x 3072 products cost seconds)."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    h, mlp, r = 3072, 12288, 2
    probe = torch.randn(h, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for split in (True, False):
        layer = torch.nn.Linear(h, 3 * h + mlp, device="meta")
        cls = lora_dit.SplitLoRAModule if split else lora_dit.LoRAModule
        kwargs = {"widths": (h, h, h, mlp)} if split else {}
        with torch.device("cpu"):
            module = cls("lora_unet_single_blocks_0_linear1", layer, 1.0, r, 3.0, **kwargs)
        _randomize(module, seed=1)
        sd = {"lora_unet_single_blocks_0_linear1." + k: v.double() for k, v in module.state_dict().items()}
        d, u, a = (sd["lora_unet_single_blocks_0_linear1." + k]
                   for k in ("lora_down.weight", "lora_up.weight", "alpha"))
        delta_probe = u @ (d @ probe) * (float(a) / d.shape[0])
        out = _convert_kohya_flux_lora_to_diffusers(dict(sd))
        rows = 0
        for part, width in (("attn.to_q", h), ("attn.to_k", h), ("attn.to_v", h), ("proj_mlp", mlp)):
            key = f"transformer.single_transformer_blocks.0.{part}"
            got = out.pop(key + ".lora_B.weight") @ (out.pop(key + ".lora_A.weight") @ probe)
            torch.testing.assert_close(got, delta_probe[rows:rows + width], rtol=0, atol=1e-12)
            rows += width
        assert not out


def test_every_name_maps_in_comfyui(parts, tmp_path):
    net = lora_flux.create_network(1.0, 4, 1, None, [parts["clip_l"], parts["t5"]], parts["transformer"],
                                   in_dims="1,1,1,1,1", train_t5xxl="True", split_qkv="True")
    path = str(tmp_path / "all.safetensors")
    net.save_weights(path, None, lora_flux.file_metadata("dev"))
    table = comfy_dit_shapes(parts["transformer"], clip_l=parts["clip_l"], t5=parts["t5"])
    sd = load_file(path)
    names = {k.split(".")[0] for k in sd}
    assert any(n.startswith("lora_te3_encoder_block_") for n in names)
    for name in names:
        assert name in table, name
        out_dim, in_dim = table[name][0], table[name][1]
        assert (sd[name + ".lora_up.weight"].shape[0], sd[name + ".lora_down.weight"].shape[1]) == (out_dim, in_dim)


def test_network_from_weights_and_metadata(parts, tmp_path):
    net = lora_flux.create_network(1.0, 4, 2, None, [parts["clip_l"], parts["t5"]], parts["transformer"],
                                   in_dims="1,0,0,2,0", train_t5xxl="True", single_dim="3")
    _randomize(net)
    path = str(tmp_path / "f.safetensors")
    net.save_weights(path, None, lora_flux.file_metadata("schnell"))
    back, _ = lora_flux.create_network_from_weights(1.0, path, None, [parts["clip_l"], parts["t5"]],
                                                    parts["transformer"])
    back.load_weights(path)
    torch.testing.assert_close(back.state_dict(), load_file(path))
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert (meta["ss_network_module"], meta["ss_base_model_version"], meta["modelspec.architecture"]) == \
        ("networks.lora_flux", "flux1", "flux-1-schnell/lora")
    with pytest.raises(LoRAError, match=r"\(state dict\): a LoHa file, not a LoRA file"):
        lora_flux.create_network_from_weights(1.0, None, None, [None], parts["transformer"], weights_sd={
            f"lora_unet_single_blocks_0_linear2.hada_{p}": torch.zeros(1, 1) for p in ("w1_a", "w1_b", "w2_a", "w2_b")})
    # a file of another model: one line naming a module
    with pytest.raises(LoRAError, match="do not exist in this model.*lora_unet_"):
        lora_flux.create_network_from_weights(1.0, None, None, [None], parts["transformer"],
                                              weights_sd={"lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight":
                                                          torch.zeros(1, 1)})


def test_resize_keeps_keys_and_family_metadata(parts, tmp_path):
    net = lora_flux.create_network(1.0, 8, 4, None, [parts["clip_l"]], parts["transformer"], split_qkv="True")
    _randomize(net)
    src, dst = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    net.save_weights(src, None, lora_flux.file_metadata("dev"))
    resize_lora.main(["--model", src, "--save_to", dst, "--new_rank", "4"])
    a, b = load_file(src), load_file(dst)
    assert a.keys() == b.keys()
    assert b["lora_unet_double_blocks_0_img_mlp_0.lora_down.weight"].shape[0] == 4
    with safe_open(dst, "pt") as f:
        meta = f.metadata()
    assert (meta["ss_network_module"], meta["ss_base_model_version"], meta["modelspec.architecture"]) == \
        ("networks.lora_flux", "flux1", "flux-1-dev/lora")


def test_lora_tools_keep_the_flux_layout(parts, tmp_path, capsys):
    """svd_merge_lora and merge_lora --concat over two FLUX files (one split_qkv), show_metadata and
    check_lora_weights: kohya FLUX names and the family's metadata survive."""
    from networks import check_lora_weights, merge_lora, svd_merge_lora
    from tools import show_metadata

    files = []
    for seed, extra in ((0, {}), (1, {"split_qkv": "True"})):
        net = lora_flux.create_network(1.0, 4, 2, None, [parts["clip_l"]], parts["transformer"], **extra)
        _randomize(net, seed)
        files.append(str(tmp_path / f"in{seed}.safetensors"))
        net.save_weights(files[-1], None, lora_flux.file_metadata("dev"))
    keys = set(load_file(files[0]))
    for tool, out, args in ((svd_merge_lora, "svd.safetensors", ["--new_rank", "4"]),
                            (merge_lora, "concat.safetensors", ["--concat"])):
        dst = str(tmp_path / out)
        assert tool.main(["--models", *files, "--save_to", dst, *args]) in (0, None)
        assert set(load_file(dst)) == keys, tool.__name__
        with safe_open(dst, "pt") as f:
            meta = f.metadata()
        assert (meta["ss_base_model_version"], meta["modelspec.architecture"], meta["ss_network_module"]) == \
            ("flux1", "flux-1-dev/lora", "networks.lora_flux")
    capsys.readouterr()
    assert show_metadata.main(["--model", files[1], "--json"]) in (0, None)
    assert '"ss_network_module": "networks.lora_flux"' in capsys.readouterr().out
    assert check_lora_weights.main([files[1]]) in (0, None)
    assert "lora_unet_single_blocks_0_linear1" in capsys.readouterr().out


def test_runtime_equals_the_files_merged_weights_groups_and_max_norm(parts):
    """The network hooked into the whole transformer (split_qkv, input layers, CLIP-L and T5 in
    the same network) gives the output of the model whose weights are W + up @ down * alpha /
    rank from the saved state (float64); gradients reach every LoRA parameter and no base
    weight; one optimizer group per text encoder; max-norm keeps split ups block-diagonal."""
    import copy

    from library.models.families.flux import flux

    model = copy.deepcopy(parts["transformer"]).double()
    tes = [copy.deepcopy(parts["clip_l"]), copy.deepcopy(parts["t5"])]
    net = lora_flux.create_network(1.0, 2, 3, None, tes, model, split_qkv="True", in_dims="1,1,1,1,1",
                                   train_t5xxl="True")
    _randomize(net)
    net.double()
    g = torch.Generator().manual_seed(3)
    inputs = dict(img=torch.randn(1, 4, 64, generator=g, dtype=torch.float64), img_ids=flux.image_ids(2, 2),
                  txt=torch.randn(1, 3, 32, generator=g, dtype=torch.float64), txt_ids=flux.text_ids(3),
                  timesteps=torch.tensor([0.3], dtype=torch.float64),
                  y=torch.randn(1, 32, generator=g, dtype=torch.float64),
                  guidance=torch.tensor([3.5], dtype=torch.float64))
    merged = copy.deepcopy(model)
    weights = merged.state_dict()
    for name, v in _expected(model.state_dict(), net.state_dict(), "lora_unet_", lambda p: p).items():
        weights[name].copy_(v)
    model.requires_grad_(False)
    net.apply_to(tes, model, apply_text_encoder=True, apply_unet=True)
    try:
        out = model(**inputs)
        out.square().sum().backward()
    finally:
        net.remove_from()
    torch.testing.assert_close(out, merged(**inputs), rtol=1e-9, atol=1e-10)
    unet_params = [p for lora in net.unet_loras for p in lora.parameters()]
    assert unet_params and all(p.grad is not None and p.grad.abs().sum() > 0 for p in unet_params)
    assert all(p.grad is None for p in model.parameters())
    groups, names = net.prepare_optimizer_params([1e-4, 2e-4], 1e-3, 1e-3)
    assert names == ["textencoder 1", "textencoder 3", "unet"]
    assert [grp["lr"] for grp in groups] == [1e-4, 2e-4, 1e-3]
    n, _, max_after = net.apply_max_norm_regularization(0.01, "cpu")
    assert n == len(net.text_encoder_loras) + len(net.unet_loras)
    assert max_after <= 0.01 * (1 + 1e-6)  # reported in float32
    sd = net.state_dict()
    for lora in net.unet_loras:
        d, u, a = (sd[f"{lora.lora_name}.{p}"] for p in ("lora_down.weight", "lora_up.weight", "alpha"))
        assert float(torch.linalg.vector_norm(u @ d * (a / d.shape[0]))) <= 0.01 * (1 + 1e-6)  # norms in float32
    up = sd["lora_unet_single_blocks_0_linear1.lora_up.weight"]
    assert torch.equal(up[:64, 2:], torch.zeros_like(up[:64, 2:]))


def test_verbose_lists_every_module(parts, caplog):
    with caplog.at_level(logging.INFO, logger="sdtk"):
        net = lora_flux.create_network(1.0, 4, 1, None, [None], parts["transformer"], verbose="True",
                                       train_blocks="double", img_mod_dim="2")
    listed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("\t")]
    assert len(listed) == len(net.unet_loras) == 20
    assert any("lora_unet_double_blocks_1_img_mod_lin" in m and "rank 2, alpha 1" in m for m in listed)


def test_flux_extract_lora_recovers_a_known_low_rank_change(parts, tmp_path):
    """networks/flux_extract_lora.py: tuned = org + a known rank-2 change on two block weights
    (and nothing elsewhere); the extracted file (dim 2, no clamp) has every default target name,
    reproduces the change (float32 SVD, 1e-5) and is zero elsewhere; it loads as networks.lora_flux
    weights and its names map in ComfyUI."""
    from networks import flux_extract_lora

    org = parts["transformer"].state_dict()
    g = torch.Generator().manual_seed(5)
    changes = {"double_blocks.1.txt_mlp.0.weight": None, "single_blocks.0.linear1.weight": None}
    tuned = {k: v.clone() for k, v in org.items()}
    for key in changes:
        out_dim, in_dim = org[key].shape
        changes[key] = torch.randn(out_dim, 2, generator=g) @ torch.randn(2, in_dim, generator=g) * 0.01
        tuned[key] += changes[key]
    src, dst = str(tmp_path / "org.safetensors"), str(tmp_path / "tuned.safetensors")
    from safetensors.torch import save_file
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in org.items()}, src)  # ComfyUI-style prefix
    save_file({k: v.contiguous() for k, v in tuned.items()}, dst)
    out = str(tmp_path / "extracted.safetensors")
    assert flux_extract_lora.main(["--model_org", src, "--model_tuned", dst, "--save_to", out, "--dim", "2",
                                   "--clamp_quantile", "1"]) in (0, None)
    sd = load_file(out)
    names = {k.split(".")[0] for k in sd}
    assert names == _block_weight_names(parts["transformer"])
    for name in names:
        d, u, a = (sd[f"{name}.{p}"].double() for p in ("lora_down.weight", "lora_up.weight", "alpha"))
        key = next(k for k in org if "lora_unet_" + k[:-len(".weight")].replace(".", "_") == name)
        expected = changes.get(key, torch.zeros(org[key].shape)).double()
        torch.testing.assert_close(u @ d * (a / d.shape[0]), expected, rtol=0, atol=1e-5, msg=name)
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert (meta["ss_network_module"], meta["modelspec.architecture"]) == ("networks.lora_flux", "flux-1-dev/lora")
    net, _ = lora_flux.create_network_from_weights(1.0, out, None, [None], parts["transformer"])
    net.load_weights(out)
    table = comfy_dit_shapes(parts["transformer"])
    assert names <= set(table)
    # a LoRA file is not a transformer: one line, exit 2
    assert flux_extract_lora.main(["--model_org", out, "--model_tuned", dst, "--save_to", out + "2"]) == 2


def test_flux_merge_lora_into_the_transformer(parts, tmp_path):
    """networks/flux_merge_lora.py: two files (one split_qkv, one with input layers) at ratios 1
    and 0.5 merged into a BFL file == W + sum of ratio x up @ down x alpha / rank (float64
    reference); without --flux_model the files become one LoRA; text-encoder modules are refused."""
    from networks import flux_merge_lora

    flux = parts["transformer"]
    base = str(tmp_path / "flux.safetensors")
    flux_checkpoint.save_flux_transformer(base, flux.state_dict(), "bfl", flux.config)
    files, expected = [], {k: v.double() for k, v in flux.state_dict().items()}
    for seed, ratio, extra in ((0, 1.0, {"split_qkv": "True"}), (1, 0.5, {"in_dims": "1,1,1,1,1"})):
        net = lora_flux.create_network(1.0, 2, 3, None, [None], flux, **extra)
        _randomize(net, seed)
        files.append(str(tmp_path / f"l{seed}.safetensors"))
        net.save_weights(files[-1], None, lora_flux.file_metadata("dev"))
        for k, v in _expected(flux.state_dict(), load_file(files[-1]), "lora_unet_", lambda p: p).items():
            expected[k] += (v - flux.state_dict()[k].double()) * ratio
    out = str(tmp_path / "merged.safetensors")
    assert flux_merge_lora.main(["--flux_model", base, "--models", *files, "--ratios", "1", "0.5",
                                 "--save_to", out]) in (0, None)
    merged = flux_checkpoint.read_transformer(out).state_dict
    assert merged.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(merged[k].double(), expected[k], rtol=1e-6, atol=1e-6, msg=k)
    lora_out = str(tmp_path / "one.safetensors")
    assert flux_merge_lora.main(["--models", *files, "--save_to", lora_out, "--concat"]) in (0, None)
    assert set(load_file(lora_out)) == set(load_file(files[0])) | set(load_file(files[1]))
    with_te = lora_flux.create_network(1.0, 2, 3, None, [parts["clip_l"]], flux)
    te_file = str(tmp_path / "te.safetensors")
    with_te.save_weights(te_file, None, None)
    assert flux_merge_lora.main(["--flux_model", base, "--models", te_file, "--save_to", out]) == 2
    assert flux_merge_lora.main(["--flux_model", base, "--models", files[0], "--save_to", out,
                                 "--clip_l", "clip.safetensors"]) == 2


def test_diffusers_042_drops_t5_modules(parts):
    """Pinned: diffusers' kohya FLUX conversion keeps lora_unet_ / lora_te1_ modules and drops T5's
    lora_te3_ ones (ComfyUI applies them: test_every_name_maps_in_comfyui)."""
    from diffusers import FluxPipeline

    net = lora_flux.create_network(1.0, 2, 1, None, [parts["clip_l"], parts["t5"]], parts["transformer"],
                                   train_t5xxl="True", train_blocks="double")  # linear1: tiny widths
    _randomize(net)
    sd = net.state_dict()
    assert any(k.startswith("lora_te3_") for k in sd)
    converted = FluxPipeline.lora_state_dict(dict(sd))
    converted = converted[0] if isinstance(converted, tuple) else converted
    assert converted and not any("encoder.block" in k or "te3" in k for k in converted)
    assert any(k.startswith("text_encoder.") for k in converted)
    assert any(k.startswith("transformer.") for k in converted)
