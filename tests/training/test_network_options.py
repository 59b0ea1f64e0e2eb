"""sd-scripts' network options: block-wise ranks / alphas / lr weights, scale_weight_norms,
dim_from_weights, base_weights, SDXL block_lr, and LyCORIS file names on SDXL.

Every expectation is computed here by hand: block indices from explicit tables of the tiny
models' blocks, learning rates from the documented formulas, norms and merged weights in float64.
"""
import copy
import math
import os
import re

import pytest
import torch

from tests.conftest import read
from tests.training.test_train_lora_e2e import base_args

# --- hand tables ------------------------------------------------------------------------------

# tiny-sd15: 4 down levels (3 with attention), 2 layers each; sd-scripts' 25 blocks
SD15_BLOCKS = {
    "down_blocks_0_resnets_0": 1, "down_blocks_0_attentions_0": 1,
    "down_blocks_0_resnets_1": 2, "down_blocks_0_attentions_1": 2, "down_blocks_0_downsamplers_0": 3,
    "down_blocks_1_resnets_0": 4, "down_blocks_1_attentions_0": 4,
    "down_blocks_1_resnets_1": 5, "down_blocks_1_attentions_1": 5, "down_blocks_1_downsamplers_0": 6,
    "down_blocks_2_resnets_0": 7, "down_blocks_2_attentions_0": 7,
    "down_blocks_2_resnets_1": 8, "down_blocks_2_attentions_1": 8, "down_blocks_2_downsamplers_0": 9,
    "down_blocks_3_resnets_0": 10, "down_blocks_3_resnets_1": 11,
    "mid_block_resnets_0": 12, "mid_block_attentions_0": 12, "mid_block_resnets_1": 12,
    "up_blocks_0_resnets_0": 13, "up_blocks_0_resnets_1": 14, "up_blocks_0_resnets_2": 15,
    "up_blocks_0_upsamplers_0": 15,
    **{f"up_blocks_{i}_{kind}_{j}": 13 + 3 * i + j for i in (1, 2, 3) for j in range(3)
       for kind in ("resnets", "attentions")},
    "up_blocks_1_upsamplers_0": 18, "up_blocks_2_upsamplers_0": 21,
}
_SD15_BLOCK_RE = re.compile(r"^lora_unet_((?:down|up)_blocks_\d_(?:resnets|attentions|downsamplers|upsamplers)_\d"
                            r"|mid_block_(?:resnets|attentions)_\d)_")
# SAI layout (SDXL): input_blocks.N -> 1 + N, middle_block.N -> 10 + N, output_blocks.N -> 13 + N
_SDXL_BLOCK_RE = re.compile(r"^lora_unet_(input_blocks|middle_block|output_blocks)_(\d+)_")
_SDXL_BASE = {"input_blocks": 1, "middle_block": 10, "output_blocks": 13}


def sd15_block(module: str) -> int:
    return SD15_BLOCKS[_SD15_BLOCK_RE.match(module).group(1)]


def sdxl_block(module: str) -> int:
    m = _SDXL_BLOCK_RE.match(module)
    return _SDXL_BASE[m.group(1)] + int(m.group(2))


def modules_of(sd):
    return sorted(k[:-len(".lora_down.weight")] for k in sd if k.endswith(".lora_down.weight"))


def delta64(sd, name):
    """up @ down * alpha / rank in float64 (the 3x3 case as a sum over the rank)."""
    down = sd[name + ".lora_down.weight"].double()
    up = sd[name + ".lora_up.weight"].double()
    rank = down.shape[0]
    d = torch.einsum("or,ri...->oi...", up.flatten(1), down)
    return d * float(sd[name + ".alpha"]) / rank


def comps(arch):
    from library.models.families.sd_common.tiny_models import build_tiny_components

    return build_tiny_components(arch)


def te_arg(c):
    return [c["text_encoder"], c["text_encoder_2"]] if "text_encoder_2" in c else c["text_encoder"]


# --- block indexing and block-wise ranks --------------------------------------------------------

def test_block_index_follows_sd_scripts():
    from networks.lora_blocks import block_index

    for prefix, block in SD15_BLOCKS.items():
        assert block_index(f"lora_unet_{prefix}_proj_in", False) == block, prefix
    assert block_index("lora_unet_up_blocks_3_attentions_2_proj_out", False) == 24
    assert block_index("lora_te_text_model_encoder_layers_0_mlp_fc1", False) == -1
    for name, block in (("input_blocks_4_1_proj_in", 5), ("input_blocks_8_0_in_layers_2", 9),
                        ("middle_block_1_proj_in", 11), ("middle_block_2_out_layers_3", 12),
                        ("output_blocks_0_1_proj_out", 13), ("output_blocks_8_0_skip_connection", 21),
                        ("time_embed_0", 0), ("out_2", 22)):
        assert block_index("lora_unet_" + name, True) == block, name


def _block_values(n, fn):
    return ",".join(str(fn(i)) for i in range(n))


def test_block_dims_sd15_saved_ranks_and_alphas(train, dataset, tmp_path):
    """A trained file: every U-Net module has its block's rank and alpha (3x3 convs: the conv
    lists); blocks at rank 0 have no modules; the text encoder keeps network_dim / alpha."""
    dims = [0 if i in (2, 17) else 1 + i % 3 for i in range(25)]
    alphas = [0.5 + i for i in range(25)]
    conv_dims = [0 if i == 5 else 1 + i % 2 for i in range(25)]
    conv_alphas = [0.25 * (i + 1) for i in range(25)]
    args = ["block_dims=" + ",".join(map(str, dims)), "block_alphas=" + ",".join(map(str, alphas)),
            "conv_block_dims=" + ",".join(map(str, conv_dims)),
            "conv_block_alphas=" + ",".join(map(str, conv_alphas))]
    out = tmp_path / "out"
    rc, _, err, _ = train("train_lora", base_args("tiny-sd15", dataset, str(out), "--max_train_steps", "1",
                                                  "--network_args", *args))
    assert rc == 0, err[-2000:]
    sd, md = read(out / "last.safetensors")
    seen = {False: set(), True: set()}  # blocks with Linear / 1x1 modules, with 3x3 conv modules
    for name in modules_of(sd):
        down = sd[name + ".lora_down.weight"]
        if name.startswith("lora_te_"):
            assert down.shape[0] == 4 and float(sd[name + ".alpha"]) == 2.0
            continue
        b = sd15_block(name)
        conv3 = down.dim() == 4 and down.shape[2:] == (3, 3)
        seen[conv3].add(b)
        assert down.shape[0] == (conv_dims if conv3 else dims)[b], name
        assert float(sd[name + ".alpha"]) == (conv_alphas if conv3 else alphas)[b], name
    # the down samplers (3, 6, 9) and the up samplers have 3x3 convs only
    assert seen[False] == set(range(1, 25)) - {2, 17, 3, 6, 9}
    assert seen[True] == set(range(1, 25)) - {5}
    assert "block_dims" in md["ss_network_args"] and "conv_block_alphas" in md["ss_network_args"]


def test_block_dims_sdxl_ranks_and_alphas_in_the_file(tmp_path):
    from networks import lora

    c = comps("sdxl")
    dims = [1 + i % 4 for i in range(23)]
    dims[11] = 0  # the middle block's attention
    alphas = [1.0 + i / 4 for i in range(23)]
    net = lora.create_network(1.0, 8, 8, c["vae"], te_arg(c), c["unet"], block_dims=_block_values(23, dims.__getitem__),
                              block_alphas=_block_values(23, alphas.__getitem__))
    net.apply_to(te_arg(c), c["unet"], True, True)
    path = str(tmp_path / "x.safetensors")
    net.save_weights(path, None, {})
    sd, _ = read(path)
    blocks = set()
    for name in modules_of(sd):
        if name.startswith("lora_te"):
            assert sd[name + ".lora_down.weight"].shape[0] == 8
            continue
        b = sdxl_block(name)
        blocks.add(b)
        assert sd[name + ".lora_down.weight"].shape[0] == dims[b], name
        assert float(sd[name + ".alpha"]) == alphas[b], name
    assert 11 not in blocks and {5, 6, 8, 9, 13, 14, 15, 16, 17, 18} <= blocks
    with pytest.raises(lora.LoRAError, match="block_dims has 25 values; SDXL has 23 blocks"):
        lora.create_network(1.0, 4, 1, None, te_arg(c), c["unet"], block_dims=",".join(["4"] * 25))


def test_lr_weights_give_per_block_groups_with_loraplus():
    """sd-scripts' groups: unet_block<i> (and '... plus' for LoRA+) at unet_lr x the block's
    weight; weights at or below block_lr_zero_threshold leave the block's modules out."""
    from networks import lora

    c = comps("sd15")
    net = lora.create_network(1.0, 4, 1, c["vae"], c["text_encoder"], c["unet"],
                              down_lr_weight="0.5,0,2", mid_lr_weight="0.25", up_lr_weight="linear+0.1",
                              block_lr_zero_threshold="0.3", loraplus_unet_lr_ratio="4",
                              loraplus_lr_ratio="2")
    groups, names = net.prepare_optimizer_params(1e-4, 1e-3, 5e-5)
    # the down list starts at IN00 (block 0, conv_in: no module) and is filled with 1.0
    weight = {0: 0.5, 1: 0.0, 2: 2.0, 4: 1.0, 5: 1.0, 7: 1.0, 8: 1.0, 12: 0.0}
    weight.update({13 + i: (i / 11 + 0.1 if i / 11 + 0.1 > 0.3 else 0.0) for i in range(12)})
    expected = [("textencoder", 1e-4), ("textencoder plus", 2e-4)]
    for b in (1, 2, 4, 5, 7, 8, 12, 16, 17, 18, 19, 20, 21, 22, 23, 24):  # blocks with attentions
        if weight[b]:
            expected += [(f"unet_block{b}", 1e-3 * weight[b]), (f"unet_block{b} plus", 4e-3 * weight[b])]
    assert names == [n for n, _ in expected]
    assert [g["lr"] for g in groups] == pytest.approx([lr for _, lr in expected], rel=1e-12)
    created = {sd15_block(lo.lora_name) for lo in net.unet_loras}
    assert created.isdisjoint({1, 12, 13, 14, 15}) and {2, 16} <= created  # weight 0: not created (not trained, not saved)
    by_param = {id(p): (lo.lora_name, pname) for lo in net.unet_loras for pname, p in lo.named_parameters()}
    for name, g in zip(names, groups):
        if name.startswith("unet_block"):
            b = int(name.split()[0][len("unet_block"):])
            assert {sd15_block(by_param[id(p)][0]) for p in g["params"]} == {b}
            # LoRA+: the up weights in the "plus" group, the down weights in the other
            assert {by_param[id(p)][1] for p in g["params"]} == \
                {"lora_up.weight" if name.endswith("plus") else "lora_down.weight"}


def test_sdxl_lr_weights_follow_the_23_block_layout():
    """SDXL: 9 down, 3 mid, 9 up weights, between the fixed 1.0 of blocks 0 and 22."""
    from networks import lora

    c = comps("sdxl")
    net = lora.create_network(1.0, 4, 1, c["vae"], te_arg(c), c["unet"], down_lr_weight="zeros+0.5",
                              mid_lr_weight="1,0,2", up_lr_weight="reverse_linear")
    net.apply_to(te_arg(c), c["unet"], False, True)
    groups, names = net.prepare_optimizer_params(None, 1e-3, 1e-4)
    # attentions (no conv_dim): input blocks 4, 5, 7, 8; middle block 1; output blocks 0-5
    weight = {5: 0.5, 6: 0.5, 8: 0.5, 9: 0.5, **{13 + i: (8 - i) / 8 for i in range(6)}}
    assert names == [f"unet_block{b}" for b in weight]  # block 11 (weight 0): no module, no group
    assert [g["lr"] for g in groups] == pytest.approx([1e-3 * w for w in weight.values()], rel=1e-12)
    assert not any(lo.lora_name.startswith("lora_unet_middle_block_1_") for lo in net.unet_loras)


@pytest.mark.parametrize("args, message", [
    ({"block_dims": "4,x"}, "block_dims: 'x' is not an integer"),
    ({"up_lr_weight": "sinus"}, "up_lr_weight: 'sinus' is not a number list or one of"),
    ({"conv_block_alphas": "1"}, "conv_block_alphas is given without conv_block_dims"),
    ({"down_lr_weight": "0.5"}, "down_lr_weight='0.5': one number is not a block list"),
    ({"block_lr_zero_threshold": "a"}, "block_lr_zero_threshold"),
])
def test_bad_block_args_are_one_line_errors(args, message):
    from networks import lora

    with pytest.raises(lora.LoRAError, match=re.escape(message)):
        lora.check_network_args(args)


# --- scale_weight_norms -----------------------------------------------------------------------

def test_max_norm_regularization_against_float64():
    """Random LoRA weights: the modules whose norm exceeds the bound end at it, the others are
    bit-identical; the count, mean and max match a float64 computation."""
    from networks import lora

    c = comps("sd15")
    net = lora.create_network(1.0, 4, 2, c["vae"], c["text_encoder"], c["unet"], conv_dim="2", conv_alpha="3")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i, p in enumerate(net.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * (0.05 + 0.5 * (i % 7) / 7))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    norms = {n: float(delta64(before, n).norm()) for n in modules_of(before)}
    bound = sorted(norms.values())[len(norms) // 2]
    keys_scaled, mean, mx = net.apply_max_norm_regularization(bound, "cpu")
    after = net.state_dict()
    assert keys_scaled == sum(v > bound for v in norms.values()) > 0
    final = []
    for n, v in norms.items():
        new = float(delta64(after, n).norm())
        final.append(min(v, bound))
        if v > bound:
            assert new == pytest.approx(bound, rel=1e-5), n
        else:
            for t in (".lora_down.weight", ".lora_up.weight"):
                assert torch.equal(after[n + t], before[n + t]), n
    assert mean == pytest.approx(sum(final) / len(final), rel=1e-5)
    assert mx == pytest.approx(max(final), rel=1e-5)


def _assert_norms_bounded(sd, bound, rel):
    for n in modules_of(sd):
        assert float(delta64(sd, n).norm()) <= bound * (1 + rel), n


def _events(folder):
    from tests.outputs.test_tracking import events

    (run,) = os.listdir(folder)
    return events(os.path.join(folder, run))


@pytest.mark.parametrize("mode", ["plain", "fused_backward_pass", "fused_optimizer_groups", "full_bf16"])
def test_scale_weight_norms_trains_bounded(mode, train, dataset, tmp_path):
    extra = {"plain": ["--ema_decay", "0"], "fused_backward_pass": ["--fused_backward_pass"],
             "fused_optimizer_groups": ["--fused_optimizer_groups", "2"],
             "full_bf16": ["--full_bf16", "--mixed_precision", "bf16"]}[mode]
    out, logs = tmp_path / "out", tmp_path / "logs"
    bound = 0.02
    rc, _, err, r = train("train_lora", base_args(
        "tiny-sd15", dataset, str(out), "--learning_rate", "1e-2", "--scale_weight_norms", str(bound),
        "--logging_dir", str(logs), *extra))
    assert rc == 0, err[-2000:]
    sd, md = read(out / "last.safetensors")
    # bf16: the scaled weights are rounded to bf16 (8 bits of mantissa) after scaling
    _assert_norms_bounded(sd, bound, 2e-2 if mode == "full_bf16" else 1e-5)
    assert md["ss_scale_weight_norms"] == str(bound)
    assert "Keys Scaled=" in err and "Average key norm=" in err  # sd-scripts' progress-bar postfix
    ev = _events(logs)
    n_modules = len(modules_of(sd))
    assert [s for s, _ in ev["max_norm/keys_scaled"]] == [1, 2]
    assert all(0 < v <= n_modules for _, v in ev["max_norm/keys_scaled"])
    assert all(v <= bound * 1.02 for _, v in ev["max_norm/max_key_norm"])
    assert all(v <= bound * 1.02 for _, v in ev["norm/avg_key_norm"])
    if mode == "plain":  # ema_decay 0: the EMA is the weights it saw after each step
        ema, _ = read(out / "last-ema.safetensors")
        assert all(torch.equal(ema[k], sd[k]) for k in sd)


def test_scale_weight_norms_with_deepspeed_is_rejected(run_script, dataset, tmp_path, no_weight_loading):
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, str(tmp_path / "o"),
                                                    "--scale_weight_norms", "1", "--deepspeed"))
    assert rc == 2 and "scale_weight_norms cannot be combined with deepspeed" in err, err[-2000:]


# --- dim_from_weights and base_weights --------------------------------------------------------

def _random_lora_file(path, arch, seed, **network_args):
    """A kohya LoRA file over the tiny model with non-zero random weights."""
    from networks import lora

    c = comps(arch)
    net = lora.create_network(1.0, 4, 2, c["vae"], te_arg(c), c["unet"], **network_args)
    net.apply_to(te_arg(c), c["unet"], True, True)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    net.save_weights(str(path), None, {})
    return read(path)[0]


def test_dim_from_weights_takes_ranks_and_alphas_from_the_file(train, run_script, dataset, tmp_path):
    src = tmp_path / "src.safetensors"
    source = _random_lora_file(src, "sd15", 1, block_dims=_block_values(25, lambda i: 1 + i % 3),
                               block_alphas=_block_values(25, lambda i: i / 2), conv_dim="3", conv_alpha="5")
    out = tmp_path / "out"
    rc, _, err, _ = train("train_lora", base_args("tiny-sd15", dataset, str(out), "--max_train_steps", "1",
                                                  "--dim_from_weights", "--network_weights", str(src),
                                                  "--network_dim", "16"))
    assert rc == 0, err[-2000:]
    sd, _ = read(out / "last.safetensors")
    assert sorted(sd) == sorted(source)
    for k, v in source.items():
        assert sd[k].shape == v.shape, k
        if k.endswith(".alpha"):
            assert float(sd[k]) == float(v), k
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, str(out), "--dim_from_weights"))
    assert rc == 2 and "dim_from_weights needs network_weights" in err


def test_lr_weights_on_a_network_from_weights_freeze_the_blocks(tmp_path):
    """From a file, the modules exist; a block at weight 0 gets no group and no gradient."""
    from networks import lora

    src = tmp_path / "src.safetensors"
    _random_lora_file(src, "sd15", 4)
    c = comps("sd15")
    net, _ = lora.create_network_from_weights(1.0, str(src), c["vae"], c["text_encoder"], c["unet"],
                                              mid_lr_weight="0", up_lr_weight="zeros+2")
    net.apply_to(c["text_encoder"], c["unet"], True, True)
    net.prepare_grad_etc(c["text_encoder"], c["unet"])
    groups, names = net.prepare_optimizer_params(1e-4, 1e-3, 1e-4)
    assert names == ["textencoder"] + [f"unet_block{b}" for b in (1, 2, 4, 5, 7, 8, 16, 17, 18, 19, 20, 21, 22, 23, 24)]
    assert [g["lr"] for g in groups[7:]] == pytest.approx([2e-3] * 9)
    mid = [lo for lo in net.unet_loras if sd15_block(lo.lora_name) == 12]
    assert mid and not any(p.requires_grad for lo in mid for p in lo.parameters())
    grouped = {id(p) for g in groups for p in g["params"]}
    assert all((id(p) in grouped) == p.requires_grad for p in net.parameters())


def test_base_weights_are_merged_before_training(train, dataset, tmp_path):
    """U-Net and text-encoder weights = W + sum m * up @ down * alpha / rank (float64 here)."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    files = [(_random_lora_file(a, "sd15", 2), 0.5), (_random_lora_file(b, "sd15", 3, conv_dim="2"), -1.5)]
    rc, _, err, r = train("train_lora", base_args(
        "tiny-sd15", dataset, str(tmp_path / "out"), "--max_train_steps", "1", "--base_weights", str(a), str(b),
        "--base_weights_multiplier", "0.5", "-1.5"))
    assert rc == 0, err[-2000:]
    fresh = comps("sd15")
    checked = 0
    for root, prefix in (("unet", "lora_unet"), ("text_encoder", "lora_te")):
        trained = dict(r.parts.bundle.components()[root].named_modules())
        for path, module in fresh[root].named_modules():
            if not isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                continue
            te_path = path if root == "unet" or path.startswith("text_model.") else "text_model." + path
            name = (prefix + "." + te_path).replace(".", "_")
            want = module.weight.double()
            for sd, m in files:
                if name + ".lora_down.weight" in sd:
                    want = want + m * delta64(sd, name).reshape(want.shape)
            got = trained[path].weight.double()
            assert torch.allclose(got, want, rtol=0, atol=1e-6), path
            checked += int(not torch.equal(want, module.weight.double()))
    assert checked > 100


@pytest.mark.parametrize("extra, message", [
    (["--base_weights", "missing.safetensors"], "base_weights: file not found: missing.safetensors"),
    (["--base_weights", "{a}", "--base_weights_multiplier", "1", "2"],
     "base_weights_multiplier: 2 value(s) for 1 base_weights file(s)"),
])
def test_base_weights_errors_before_loading(extra, message, run_script, dataset, tmp_path, no_weight_loading):
    a = tmp_path / "a.safetensors"
    a.write_bytes(b"x")
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, str(tmp_path / "o"),
                                                    *[e.format(a=a) for e in extra]))
    assert rc == 2 and message in err, err[-2000:]


def test_base_weights_bad_file_names_it(run_script, dataset, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, str(tmp_path / "o"),
                                                    "--base_weights", str(bad)))
    assert rc == 2 and f"base_weights: {bad}: cannot read LoRA weights file" in err, err[-2000:]
    assert len([ln for ln in err.splitlines() if ln.startswith("error")]) == 1


# --- block_lr (SDXL full fine-tuning) -----------------------------------------------------------

# diffusers parameter prefix -> sdxl_train.py block, for tiny-sdxl (3 levels, 2 layers each)
SDXL_PARAM_BLOCKS = [
    ("time_embedding.", 0), ("add_embedding.", 0), ("conv_in.", 1),
    ("down_blocks.0.resnets.0.", 2), ("down_blocks.0.resnets.1.", 3), ("down_blocks.0.downsamplers.", 4),
    ("down_blocks.1.resnets.0.", 5), ("down_blocks.1.attentions.0.", 5), ("down_blocks.1.resnets.1.", 6),
    ("down_blocks.1.attentions.1.", 6), ("down_blocks.1.downsamplers.", 7),
    ("down_blocks.2.resnets.0.", 8), ("down_blocks.2.attentions.0.", 8), ("down_blocks.2.resnets.1.", 9),
    ("down_blocks.2.attentions.1.", 9),
    ("mid_block.resnets.0.", 10), ("mid_block.attentions.0.", 11), ("mid_block.resnets.1.", 12),
    *[(f"up_blocks.{i}.{k}.{j}.", 13 + 3 * i + j) for i in range(3) for j in range(3)
      for k in ("resnets", "attentions")],
    ("up_blocks.0.upsamplers.", 15), ("up_blocks.1.upsamplers.", 18),
    ("conv_norm_out.", 22), ("conv_out.", 22),
]


def test_block_lr_groups_sdxl_unet_by_block(train, dataset, tmp_path):
    from tests.training.test_train_dreambooth_e2e import base_args as db_args

    lrs = [0.0 if i in (0, 11) else 1e-4 * (i + 1) for i in range(23)]
    rc, _, err, r = train("train_dreambooth", db_args("tiny-sdxl", dataset, str(tmp_path / "out"),
                                                      "--max_train_steps", "1",
                                                      "--block_lr", ",".join(map(str, lrs))))
    assert rc == 0, err[-2000:]
    unet = r.parts.bundle.unet
    block_of = {}
    for name, p in unet.named_parameters():
        (b,) = {b for prefix, b in SDXL_PARAM_BLOCKS if name.startswith(prefix)}
        block_of[id(p)] = b
    groups = r.parts.stepper.optimizer.param_groups
    assert r.parts.method.group_names == [f"block{i}" for i in range(23) if lrs[i]]
    for name, g in zip(r.parts.method.group_names, groups):
        b = int(name[len("block"):])
        assert {block_of[id(p)] for p in g["params"]} == {b} and g["lr"] == pytest.approx(lrs[b])
    assert sum(len(g["params"]) for g in groups) == sum(1 for p in unet.parameters() if lrs[block_of[id(p)]])
    frozen = [p for p in unet.parameters() if not lrs[block_of[id(p)]]]
    assert frozen and not any(p.requires_grad for p in frozen)


def test_block_lr_errors(run_script, dataset, tmp_path, no_weight_loading):
    from tests.training.test_train_dreambooth_e2e import base_args as db_args

    rc, _, err = run_script("train_dreambooth", db_args("tiny-sdxl", dataset, str(tmp_path / "o"),
                                                        "--block_lr", "1e-4,1e-4"))
    assert rc == 2 and "block_lr: 2 value(s) given; SDXL's U-Net has 23 blocks" in err, err[-2000:]
    rc, _, err = run_script("train_dreambooth", db_args("tiny-sd15", dataset, str(tmp_path / "o"),
                                                        "--block_lr", ",".join(["1e-4"] * 23)))
    assert rc == 2 and "block_lr is for SDXL's U-Net" in err, err[-2000:]


# --- LyCORIS on SDXL: kohya (SAI-layout) names --------------------------------------------------

def test_lycoris_sdxl_file_uses_our_kohya_names_and_loads_back(train, dataset, tmp_path):
    pytest.importorskip("lycoris")
    from networks import lora

    c = comps("sdxl")
    ours = lora.create_network(1.0, 4, 1, c["vae"], te_arg(c), c["unet"], conv_dim="2")
    our_names = {lo.lora_name for lo in ours.text_encoder_loras + ours.unet_loras}
    out = tmp_path / "out"
    net_args = ["algo=loha", "conv_dim=2", "conv_alpha=1"]
    rc, _, err, _ = train("train_lora", base_args("tiny-sdxl", dataset, str(out), "--max_train_steps", "1",
                                                  "--network_module", "lycoris.kohya", "--network_args", *net_args))
    assert rc == 0, err[-2000:]
    sd, _ = read(out / "last.safetensors")
    names = {k.split(".")[0] for k in sd}
    assert any(k.endswith(".hada_w1_a") for k in sd)
    assert not any("down_blocks" in n or "up_blocks" in n or "mid_block" in n for n in names)
    # LyCORIS also adapts the layers outside the blocks, under their SAI names
    assert names - our_names == {"lora_unet_input_blocks_0_0", "lora_unet_time_embed_0", "lora_unet_time_embed_2",
                                 "lora_unet_out_2"}
    assert our_names <= names
    # network_weights: the SAI names load back into the LyCORIS modules (a tiny step keeps them)
    out2 = tmp_path / "out2"
    rc, _, err, _ = train("train_lora", base_args("tiny-sdxl", dataset, str(out2), "--max_train_steps", "1",
                                                  "--network_module", "lycoris.kohya", "--network_args", *net_args,
                                                  "--network_weights", str(out / "last.safetensors"),
                                                  "--learning_rate", "1e-12"))
    assert rc == 0, err[-2000:]
    again, _ = read(out2 / "last.safetensors")
    assert sorted(again) == sorted(sd)
    assert all(torch.allclose(again[k], sd[k], rtol=0, atol=1e-8) for k in sd)


def test_scale_weight_norms_without_the_method_is_one_line(run_script, dataset, tmp_path, monkeypatch):
    from networks import lora

    monkeypatch.delattr(lora.LoRANetwork, "apply_max_norm_regularization")
    rc, _, err = run_script("train_lora", base_args("tiny-sd15", dataset, str(tmp_path / "o"),
                                                    "--scale_weight_norms", "1"))
    assert rc == 2 and "scale_weight_norms: the network of networks.lora has no " \
                      "apply_max_norm_regularization" in err, err[-2000:]
    assert len([ln for ln in err.splitlines() if ln.startswith("error")]) == 1


@pytest.mark.slow
def test_scale_weight_norms_on_two_processes_equals_one_process(tmp_path):
    """2 processes x batch 1 (each scaling its own copy) == 1 process x batch 2, and both ranks
    end bit-identical (SGD at lr 1; many modules end at the bound)."""
    from tests.training.test_equivalence import make_two_bucket_dataset, max_rel_diff, read_file, train_args, train_in_process
    from tests.distributed.test_multiprocess import ISSUE_TOL, NORM_FLOOR, launch_two_processes

    data = make_two_bucket_dataset(str(tmp_path / "data"))
    common = ["--max_train_steps", "3", "--scale_weight_norms", "0.002"]
    out, report = tmp_path / "two", tmp_path / "report"
    report.mkdir()
    proc = launch_two_processes(str(report), train_args(data, str(out), "--train_batch_size", "1", *common))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    w0, w1 = (read_file(str(report / f"rank{r}.safetensors"))[0] for r in (0, 1))
    assert all(w0[k].equal(w1[k]) for k in w0)
    two = read_file(str(out / "last.safetensors"))[0]
    _assert_norms_bounded(two, 0.002, 1e-5)
    at_bound = [n for n in modules_of(two) if float(delta64(two, n).norm()) == pytest.approx(0.002, rel=1e-4)]
    assert len(at_bound) > 10  # the scaling engaged
    ref = train_in_process(train_args(data, str(tmp_path / "one"), "--train_batch_size", "2", *common))
    worst, key = max_rel_diff(two, ref["tensors"], floor=NORM_FLOOR)
    assert worst <= ISSUE_TOL, f"{key}: {worst:.2e}"


def test_option_forms_in_toml_and_on_the_command_line(tmp_path):
    from library.config.parse import parse_args

    run = tmp_path / "run.toml"
    head = 'pretrained_model_name_or_path = "tiny-sdxl"\ntrain_data_dir = "d"\noutput_dir = "o"\n' \
           'resolution = 64\nmax_train_steps = 1\n'
    run.write_text(head + 'block_lr = "1e-6,2e-6"\n')  # sd-scripts: one comma-separated string
    assert parse_args("train_dreambooth", ["--config", str(run)]).block_lr == [1e-6, 2e-6]
    run.write_text(head + 'base_weights = ["a", "b"]\nbase_weights_multiplier = [1, 0.5]\n'
                   'scale_weight_norms = 0\n[network_args]\nblock_dims = [1, 2, 3]\n')
    o = parse_args("train_lora", ["--config", str(run)])
    assert o.base_weights == ["a", "b"] and o.base_weights_multiplier == [1.0, 0.5]
    assert o.scale_weight_norms is None  # 0 is off (sd-scripts, and what the kohya_ss GUI writes)
    assert o.network_args == {"block_dims": "1,2,3"}  # as sd-scripts passes it to the module
    o = parse_args("train_lora", ["--config", str(run), "--base_weights", "c", "--base_weights_multiplier",
                                  "-1.5", "--scale_weight_norms", "1"])
    assert o.base_weights == ["c"] and o.base_weights_multiplier == [-1.5] and o.scale_weight_norms == 1.0
    o = parse_args("train_dreambooth", ["--pretrained_model_name_or_path", "tiny-sdxl", "--train_data_dir", "d",
                                        "--output_dir", "o", "--resolution", "64", "--max_train_steps", "1",
                                        "--block_lr", "1e-6,2e-6", "3e-6"])
    assert o.block_lr == [1e-6, 2e-6, 3e-6]


def test_unset_network_dim_leaves_the_module_its_default(tmp_path):
    """network_dim unset reaches create_network as None (sd-scripts' default), so networks.oft_v2
    takes its block size 32 (sd-scripts' oft_v2._create_network_args), networks.lora its rank 4;
    a given network_dim is the block size / rank."""
    from library.models.loading import load_model_bundle
    from library.training.methods import NetworkMethod
    from tests.helpers import options_from_values

    bundle = load_model_bundle("tiny-sd15")

    def network(**values):  # on a copy of the model: setup applies the network to it
        opts = options_from_values("train_lora", dict(pretrained_model_name_or_path="tiny-sd15",
                                                      output_dir=str(tmp_path), **values))
        method = NetworkMethod(opts, copy.deepcopy(bundle))
        method.setup()
        return method.network

    def sizes(net):  # block size of the layers whose inputs 32 and 8 both divide
        return {m.block_size for m in net.unet_loras if m.n_blocks * m.block_size % 32 == 0}

    assert sizes(network(network_module="networks.oft_v2")) == {32}
    assert sizes(network(network_module="networks.oft_v2", network_dim=8)) == {8}
    assert {m.lora_dim for m in network(network_module="networks.lora").unet_loras} == {4}
