"""sd-scripts' own network kinds (networks.loha, lokr, dylora, lora_fa, oft): each module's output
against a float64 hand computation of the kind's formula, the file's keys and shapes against
sd-scripts' layout, the files against A1111's and ComfyUI's key tables (tests/client_key_tables.py)
and diffusers' loader where it reads the kind, the LoRA tools, and a two-step training run."""
from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from library.models.families.sd_common.tiny_models import build_tiny_components
from networks import (dylora, extract_lora_from_dylora, loha, lokr, lora_fa, merge_lora, oft, resize_lora,
                      svd_merge_lora)
from tests import client_key_tables as clients


def _randomize(net, seed=0, std=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _linear_and_conv():
    torch.manual_seed(0)
    return torch.nn.Linear(12, 8), torch.nn.Conv2d(6, 8, 3, padding=1)


def _forward64(module, org, x):
    """The hooked module's output next to the original layer's, both in float64 inputs' precision."""
    module.apply_to()
    try:
        return org(x)
    finally:
        module.restore()


def test_loha_forward_is_the_hadamard_product_of_two_low_rank_matrices():
    from networks.adapter_modules import LoHaModule

    lin, conv = _linear_and_conv()
    x = torch.randn(3, 12)
    m = LoHaModule("lora_unet_x", lin, multiplier=0.7, lora_dim=4, alpha=2.0)
    _randomize(m)
    got = _forward64(m, lin, x).double()
    w1a, w1b, w2a, w2b = (getattr(m, n).detach().double() for n in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"))
    delta = (w1a @ w1b) * (w2a @ w2b) * (2.0 / 4)
    want = x.double() @ (lin.weight.double() + 0.7 * delta).T + lin.bias.double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (m.hada_w1_a.shape, m.hada_w1_b.shape) == ((8, 4), (4, 12))

    # a 3x3 conv with Tucker cores: W = einsum(t, a, b) for each pair (LyCORIS' layout, rank x out)
    xc = torch.randn(2, 6, 5, 5)
    mc = LoHaModule("lora_unet_c", conv, multiplier=1.0, lora_dim=3, alpha=3.0, use_tucker=True)
    assert mc.hada_t1.shape == (3, 3, 3, 3) and mc.hada_w1_a.shape == (3, 8) and mc.hada_w1_b.shape == (3, 6)
    _randomize(mc, 1)
    got = _forward64(mc, conv, xc).double()
    p = {n: getattr(mc, n).detach().double() for n in ("hada_t1", "hada_w1_a", "hada_w1_b", "hada_t2", "hada_w2_a",
                                                        "hada_w2_b")}
    w1 = torch.einsum("ijkl,ip,jr->prkl", p["hada_t1"], p["hada_w1_a"], p["hada_w1_b"])
    w2 = torch.einsum("ijkl,ip,jr->prkl", p["hada_t2"], p["hada_w2_a"], p["hada_w2_b"])
    want = F.conv2d(xc.double(), conv.weight.double() + w1 * w2, conv.bias.double(), padding=1)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_lokr_forward_is_a_kronecker_product_with_sd_scripts_factors():
    from networks.adapter_modules import LoKrModule

    lin = torch.nn.Linear(64, 32)
    # factor -1: the most balanced factors, 64 = 8 x 8, 32 = 4 x 8; rank 2 < 8 / 2: w2 = a @ b
    m = LoKrModule("lora_unet_x", lin, multiplier=1.0, lora_dim=2, alpha=1.0)
    assert m.lokr_w1.shape == (4, 8) and m.lokr_w2_a.shape == (8, 2) and m.lokr_w2_b.shape == (2, 8)
    _randomize(m)
    x = torch.randn(3, 64)
    got = _forward64(m, lin, x).double()
    w1, a, b = (getattr(m, n).detach().double() for n in ("lokr_w1", "lokr_w2_a", "lokr_w2_b"))
    w2 = a @ b
    delta = torch.zeros(32, 64, dtype=torch.float64)
    for i in range(4):  # kron by hand: block (i, j) of the delta is w1[i, j] * w2
        for j in range(8):
            delta[i * 8:(i + 1) * 8, j * 8:(j + 1) * 8] = w1[i, j] * w2
    want = x.double() @ (lin.weight.double() + delta * 0.5).T + lin.bias.double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)

    # factor 4: 64 = 4 x 16, 32 = 4 x 8; rank 8 >= 16 / 2: w2 a full matrix, scale 1, alpha saved = rank
    f = LoKrModule("lora_unet_y", lin, lora_dim=8, alpha=1.0, factor=4)
    assert f.lokr_w1.shape == (4, 4) and f.lokr_w2.shape == (8, 16) and float(f.alpha) == 8.0 and f.scale == 1.0
    assert torch.count_nonzero(f.delta()) == 0  # w2 starts at zero: an exact no-op


def test_oft_rotates_each_block_of_output_rows():
    from networks.adapter_modules import OFTModule

    lin = torch.nn.Linear(6, 8)
    m = OFTModule("oft_unet_x", lin, multiplier=1.0, lora_dim=2, alpha=1.0)  # 2 blocks of 4 rows
    assert m.oft_blocks.shape == (2, 4, 4) and m.constraint == 8.0
    x = torch.randn(3, 6)
    assert torch.equal(_forward64(m, lin, x), lin(x))  # zero blocks: R = I
    _randomize(m, std=0.05)
    got = _forward64(m, lin, x).double()
    w = lin.weight.double()
    rows = []
    for k in range(2):
        b = m.oft_blocks.detach()[k].double()
        q = b - b.T
        r = (torch.eye(4, dtype=torch.float64) + q) @ torch.linalg.inv(torch.eye(4, dtype=torch.float64) - q)
        assert torch.allclose(r.T @ r, torch.eye(4, dtype=torch.float64), atol=1e-10)  # a rotation
        rows.append(r.T @ w[4 * k:4 * k + 4])
    want = x.double() @ torch.cat(rows).T + lin.bias.double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)

    # the constraint clamps the skew part's norm to alpha * out_dim
    tight = OFTModule("oft_unet_y", lin, lora_dim=2, alpha=1e-3)
    with torch.no_grad():
        tight.oft_blocks.copy_(m.oft_blocks)
    q = (tight.oft_blocks - tight.oft_blocks.transpose(1, 2)).detach()
    from networks.adapter_weights import oft_rotation
    r = oft_rotation(tight.oft_blocks.detach(), tight.constraint)
    qq = torch.linalg.solve((r + torch.eye(4)).transpose(1, 2), (r - torch.eye(4)).transpose(1, 2)).transpose(1, 2)
    assert math.isclose(float(qq.flatten().norm()), 8e-3, rel_tol=1e-3) and float(q.flatten().norm()) > 8e-3


def test_dylora_trains_one_unit_of_ranks_and_scales_by_the_drawn_rank():
    from networks.adapter_modules import DyLoRAModule

    lin = torch.nn.Linear(12, 8)
    m = DyLoRAModule("lora_unet_x", lin, multiplier=1.0, lora_dim=6, alpha=3.0, unit=2)
    _randomize(m)
    m.train()
    x = torch.randn(3, 12)
    random.seed(5)
    m.apply_to()
    y = lin(x)
    m.restore()
    b = m.last_rank
    assert b % 2 == 0 and 0 <= b < 6
    down, up = (t.detach().double() for t in m.down_up())
    want = x.double() @ lin.weight.double().T + lin.bias.double() + \
        (x.double() @ down.T @ up.T) * (3.0 / 6) * math.sqrt(6 / (b + 2))
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    with_grad = [i for i, p in enumerate(m.lora_A) if p.grad is not None]
    assert with_grad == [b, b + 1]
    assert [i for i, p in enumerate(m.lora_B) if p.grad is not None] == [b, b + 1]


def test_lora_fa_trains_only_the_up_projection():
    lin = torch.nn.Linear(64, 16)
    torch.manual_seed(0)
    m = lora_fa.LoRAFAModule("lora_unet_x", lin, lora_dim=8, alpha=4.0)
    assert [n for n, _ in m.named_parameters()] == ["lora_up.weight"]
    assert "lora_down.weight" in m.state_dict()
    std = float(m.lora_down.weight.std())
    assert abs(std - math.sqrt(2 / (64 + 8))) < 0.02  # sd-scripts' normal(0, sqrt(2 / (in + rank)))
    with torch.no_grad():
        m.lora_up.weight.normal_()
    x = torch.randn(2, 64)
    m.apply_to()
    y = lin(x)
    m.restore()
    want = x.double() @ (lin.weight.double() + m.lora_up.weight.double() @ m.lora_down.weight.double() * 0.5).T
    assert torch.allclose(y.double(), want + lin.bias.double(), rtol=1e-5, atol=1e-5)


# --- files: sd-scripts' layout, the clients' key tables ------------------------------------------

ARCH_FAMILY = {"sd15": "sd1", "sd2": "sd2", "sdxl": "sdxl"}
KINDS = {  # network module, its network_args, the kind the clients see
    "loha": (loha, {"conv_dim": "2", "conv_alpha": "1", "use_tucker": "true"}, "LoHa"),
    "lokr": (lokr, {"conv_dim": "2", "factor": "4"}, "LoKr"),
    "dylora": (dylora, {"unit": "2"}, "LoRA"),
    "lora_fa": (lora_fa, {"conv_dim": "2"}, "LoRA"),
    "oft": (oft, {"enable_all_linear": "true"}, "OFT"),
}


@pytest.fixture(scope="module")
def models():
    return {arch: build_tiny_components(arch) for arch in ARCH_FAMILY}


def _tes(c):
    return [c["text_encoder"]] + ([c["text_encoder_2"]] if "text_encoder_2" in c else [])


def _save(kind, c, path, seed=0):
    module, args, _ = KINDS[kind]
    tes = _tes(c)
    net = module.create_network(1.0, 4, 2.0, None, tes if len(tes) > 1 else tes[0], c["unet"], **args)
    net.apply_to(tes, c["unet"])
    _randomize(net, seed, 0.05)
    net.save_weights(path, None, {"ss_network_module": module.__name__})
    net.remove_from()
    return load_file(path)


@pytest.mark.parametrize("arch", sorted(ARCH_FAMILY))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_files_resolve_in_a1111_and_comfyui(kind, arch, models, tmp_path):
    c = models[arch]
    sd = _save(kind, c, str(tmp_path / f"{kind}.safetensors"))
    modules = clients.modules_of_file(sd)
    client_kind = KINDS[kind][2]
    assert all(clients.A1111_TYPES[client_kind](p) for p in modules.values())
    mapping = clients.a1111_module_shapes(c, ARCH_FAMILY[arch])
    targets = {n: clients.a1111_target(n, mapping) for n in modules}
    unmatched = sorted(n for n, t in targets.items() if t is None)
    for n, t in targets.items():  # the client's product has the shape of the weight it is added to
        if t is None:
            continue
        rows, numel = clients.client_delta({p: sd[n + "." + p] for p in modules[n]})
        shape = mapping[t]
        if t.endswith("_attn") and len(shape) == 2 and shape[0] == 3 * shape[1]:  # MHA: q, k or v rows
            shape = (shape[1], shape[1])
        assert rows == shape[0] and numel in (None, math.prod(shape)), (n, t, shape, rows, numel)
    comfy = clients.comfy_names(c, ARCH_FAMILY[arch])
    if kind == "oft":
        # sd-scripts' OFT names: A1111 maps oft_unet_ + SAI paths (SDXL) only; ComfyUI has no oft_unet_
        assert all(n.startswith("oft_unet_") for n in modules)
        assert (unmatched == []) == (arch == "sdxl"), unmatched[:3]
        if arch != "sdxl":
            assert len(unmatched) == len(modules)
        assert not set(modules) & comfy
        return
    assert unmatched == [], unmatched[:5]
    assert all(clients.COMFY_TYPES[client_kind](p) for p in modules.values())
    assert sorted(set(modules) - comfy) == []
    assert any(n.startswith("lora_te") for n in modules) and any(n.startswith("lora_unet") for n in modules)


def test_loha_lokr_key_layout_is_sd_scripts(models, tmp_path):
    c = models["sd15"]
    sd = _save("loha", c, str(tmp_path / "h.safetensors"))
    q = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"  # Linear 32 -> 32
    conv = "lora_unet_down_blocks_0_resnets_0_conv1"  # 3x3 conv 32 -> 32, Tucker, conv rank 2
    assert {k[len(q) + 1:]: tuple(v.shape) for k, v in sd.items() if k.startswith(q + ".")} == {
        "hada_w1_a": (32, 4), "hada_w1_b": (4, 32), "hada_w2_a": (32, 4), "hada_w2_b": (4, 32), "alpha": ()}
    assert {k[len(conv) + 1:]: tuple(v.shape) for k, v in sd.items() if k.startswith(conv + ".")} == {
        "hada_t1": (2, 2, 3, 3), "hada_w1_a": (2, 32), "hada_w1_b": (2, 32), "hada_t2": (2, 2, 3, 3),
        "hada_w2_a": (2, 32), "hada_w2_b": (2, 32), "alpha": ()}
    assert float(sd[q + ".alpha"]) == 2.0 and float(sd[conv + ".alpha"]) == 1.0
    sk = _save("lokr", c, str(tmp_path / "k.safetensors"))
    # factor 4: 32 = 4 x 8 on both sides; rank 4 >= 8 / 2: full w2, alpha saved as the rank
    assert {k[len(q) + 1:]: tuple(v.shape) for k, v in sk.items() if k.startswith(q + ".")} == {
        "lokr_w1": (4, 4), "lokr_w2": (8, 8), "alpha": ()}
    assert float(sk[q + ".alpha"]) == 4.0
    # a LoRA-layout kind: DyLoRA's per-rank parameters saved joined, as sd-scripts
    sdy = _save("dylora", c, str(tmp_path / "d.safetensors"))
    assert {k[len(q) + 1:]: tuple(v.shape) for k, v in sdy.items() if k.startswith(q + ".")} == {
        "lora_down.weight": (4, 32), "lora_up.weight": (32, 4), "alpha": ()}


@pytest.mark.parametrize("kind", ["dylora", "lora_fa"])
def test_lora_layout_kinds_load_in_diffusers(kind, models, tmp_path):
    pytest.importorskip("peft")
    from tests.conftest import diffusers_load_problems, diffusers_pipeline

    path = str(tmp_path / f"{kind}.safetensors")
    _save(kind, models["sd15"], path)
    pipe = diffusers_pipeline("sd15", build_tiny_components("sd15"))
    assert diffusers_load_problems(pipe, path) == []


# --- tools -----------------------------------------------------------------------------------------

def test_merge_into_the_model_equals_each_kinds_delta(models, tmp_path):
    c = build_tiny_components("sd15")
    q = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    base = dict(c["unet"].get_submodule(q).named_parameters())["weight"].detach().clone().double()
    for kind in ("loha", "lokr", "oft"):
        sd = _save(kind, models["sd15"], str(tmp_path / f"{kind}.safetensors"), seed=3)
        fresh = build_tiny_components("sd15")
        n = merge_lora.merge_lora_into([fresh["text_encoder"]], fresh["unet"], sd, 0.5)
        assert n == len({k.split(".")[0] for k in sd})
        merged = fresh["unet"].get_submodule(q).weight.detach().double()
        name = "lora_unet_" + q.replace(".", "_")
        p = {k[len(name) + 1:]: v.double() for k, v in sd.items() if k.startswith(name + ".")}
        if kind == "loha":
            want = base + 0.5 * (p["hada_w1_a"] @ p["hada_w1_b"]) * (p["hada_w2_a"] @ p["hada_w2_b"]) * 2 / 4
        elif kind == "lokr":
            want = base + 0.5 * torch.kron(p["lokr_w1"], p["lokr_w2"])  # full w2: scale 1
        else:
            p = {k[len("oft_unet_" + q.replace(".", "_")) + 1:]: v.double() for k, v in sd.items()
                 if k.startswith("oft_unet_" + q.replace(".", "_") + ".")}
            blocks = p["oft_blocks"]
            eye = torch.eye(blocks.shape[1], dtype=torch.float64)
            rows = []
            for k in range(blocks.shape[0]):
                qk = blocks[k] - blocks[k].T
                r = (eye + qk) @ torch.linalg.inv(eye - qk)
                r = 0.5 * (r - eye) + eye
                rows.append(r.T @ base[k * blocks.shape[1]:(k + 1) * blocks.shape[1]])
            want = torch.cat(rows)
        assert torch.allclose(merged, want, rtol=1e-5, atol=1e-6), kind


@pytest.mark.parametrize("kind, name", [("loha", "LoHa"), ("lokr", "LoKr"), ("oft", "OFT")])
def test_svd_tools_refuse_other_kinds_by_name(kind, name, models, tmp_path, capsys):
    path = str(tmp_path / f"{kind}.safetensors")
    _save(kind, models["sd15"], path)
    capsys.readouterr()  # what building the network logged (OFT: its alpha advice)
    out = str(tmp_path / "o.safetensors")
    for main, argv in ((resize_lora.main, ["--model", path, "--save_to", out]),
                       (svd_merge_lora.main, ["--models", path, "--save_to", out]),
                       (merge_lora.main, ["--models", path, "--save_to", out, "--concat"])):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"a {name} file; this tool handles LoRA files only" in err[0], (main, err)
    assert not os.path.exists(out)


def test_scale_weight_norms_stops_on_kinds_without_it(dataset, tmp_path, run_script):
    rc, out, err = run_script("train_lora", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset, "--output_dir", tmp_path / "o",
        "--resolution", "64", "--max_train_steps", "2", "--network_module", "networks.loha",
        "--scale_weight_norms", "1.0"])
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("error: scale_weight_norms: the network of networks.loha has no "), err[-800:]


def test_extract_lora_from_dylora_cuts_each_rank(models, tmp_path):
    path = str(tmp_path / "dy.safetensors")
    sd = _save("dylora", models["sd15"], path)
    assert extract_lora_from_dylora.main(["--model", path, "--save_to", str(tmp_path / "cut.safetensors"),
                                          "--unit", "2"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["cut-0002.safetensors", "dy.safetensors"]
    cut = load_file(str(tmp_path / "cut-0002.safetensors"))
    assert set(cut) == set(sd)
    for k, v in sd.items():
        if k.endswith("lora_down.weight"):
            assert torch.equal(cut[k], v[:2])
        elif k.endswith("lora_up.weight"):
            assert torch.equal(cut[k], v[:, :2])
        else:
            assert torch.equal(cut[k], v)
    with safe_open(str(tmp_path / "cut-0002.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_dim"] == "2" and meta["ss_training_comment"].startswith("split from DyLoRA, rank 4 to 2")


def test_oft_trains_two_steps_and_writes_sd_scripts_metadata(dataset, tmp_path, run_script):
    rc, out, err = run_script("train_lora", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset, "--output_dir", tmp_path / "o",
        "--resolution", "64", "--max_train_steps", "2", "--network_module", "networks.oft", "--network_dim", "4",
        "--network_alpha", "1e-3", "--network_args", "enable_conv=true", "--learning_rate", "1e-3"])
    assert rc == 0, err[-2000:]
    files = [f for f in os.listdir(tmp_path / "o") if f.endswith(".safetensors")]
    with safe_open(str(tmp_path / "o" / files[0]), "pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    assert keys and all(k.startswith("oft_unet_") and k.split(".")[1] in ("oft_blocks", "alpha") for k in keys)
    assert any("resnets_0_conv1" in k for k in keys)
    assert meta["ss_network_module"] == "networks.oft" and meta["ss_network_dim"] == "4"
    assert json.loads(meta["ss_network_args"]) == {"enable_conv": "true"}
    trained = load_file(str(tmp_path / "o" / files[0]))
    assert any(v.abs().sum() > 0 for k, v in trained.items() if k.endswith("oft_blocks"))


def test_dylora_resume_is_exact(dataset, tmp_path, run_script):
    """The rank drawn per forward comes from Python's generator, which the training state keeps:
    2 steps + resume + 2 steps write the same file as 4 steps."""
    common = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset, "--resolution", "64",
              "--network_module", "networks.dylora", "--network_args", "unit=2", "--learning_rate", "1e-3"]
    assert run_script("train_lora", common + ["--output_dir", tmp_path / "a", "--max_train_steps", "4"])[0] == 0
    assert run_script("train_lora", common + ["--output_dir", tmp_path / "b", "--max_train_steps", "2",
                                              "--save_state"])[0] == 0
    rc, out, err = run_script("train_lora", common + ["--output_dir", tmp_path / "b", "--max_train_steps", "4",
                                                      "--resume", tmp_path / "b" / "last-state"])
    assert rc == 0, err[-1500:]
    a, b = load_file(str(tmp_path / "a" / "last.safetensors")), load_file(str(tmp_path / "b" / "last.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_network_args_of_the_gui_that_sd_scripts_ignores_warn(caplog):
    # GUI "Kohya DyLoRA" with conv_dim 0: conv_alpha is still written; sd-scripts reads it only with conv_dim
    dylora.check_network_args({"conv_alpha": "1", "unit": "1"})
    assert "conv_alpha has no effect on networks.dylora without conv_dim" in caplog.text
    # the LyCORIS keys of the GUI's LyCORIS types: not read by sd-scripts' native LoKr
    lokr.check_network_args({"use_scalar": "False", "train_norm": "False", "factor": "4"})
    assert "use_scalar has no effect on networks.lokr" in caplog.text
    from networks.lora import LoRAError
    with pytest.raises(LoRAError, match="network_args: unknown key 'factr' for networks.lokr"):
        lokr.check_network_args({"factr": "4"})
    with pytest.raises(LoRAError, match="network_args: network_reg_dims .* of sd-scripts' networks.loha is not"):
        loha.check_network_args({"network_reg_dims": "a=4"})
    with pytest.raises(LoRAError, match="network_args: unit=.0. must be >= 1"):
        dylora.check_network_args({"unit": "0"})


@pytest.mark.parametrize("kind", ["loha", "lokr", "oft", "dylora"])
def test_check_lora_weights_lists_every_kinds_tensors(kind, models, tmp_path, capsys):
    from networks import check_lora_weights

    path = str(tmp_path / f"{kind}.safetensors")
    sd = _save(kind, models["sd15"], path)
    assert check_lora_weights.main([path]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    tensors = [k for k in sd if not k.endswith(".alpha")]
    assert lines[0] == f"adapter kinds: {KINDS[kind][2]}" and lines[1] == f"number of LoRA modules: {len(tensors)}"
    first = lines[2].split(",")
    v = sd[first[0]].float().abs()
    assert first[1] == str(tuple(v.shape)).replace(", ", "-")
    assert math.isclose(float(first[2]), float(v.mean()), rel_tol=1e-6)
    assert {line.split(",")[0] for line in lines[2:]} == set(tensors)
