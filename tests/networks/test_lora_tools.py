"""The LoRA toolbox (networks/resize_lora.py, extract_lora_from_models.py, svd_merge_lora.py,
merge_lora.py without --sd_model, tools/show_metadata.py) against float64 references: numpy SVDs,
hand-built spectra, hand-built low-rank deltas, weighted sums formed independently."""
from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from library.models.families.sd_common.tiny_models import build_tiny_components  # noqa: E402
from networks import extract_lora_from_models, merge_lora, resize_lora, svd_merge_lora  # noqa: E402
from networks import lora  # noqa: E402
from tests.conftest import count_sd_scripts_modules, diffusers_load_problems, read  # noqa: E402
from tests.networks.test_merge_lora import make_lora_file, tes  # noqa: E402
from tools import show_metadata  # noqa: E402


# --- independent references ---------------------------------------------------------------------

# References in float64 through torch (one thread, from the conftest fixture): numpy's threaded
# BLAS crawls on a loaded 2-core machine.

def ref_delta(sd, name) -> np.ndarray:
    """up @ down * alpha / rank in float64, flattened to (out, in * k * k)."""
    down = sd[name + ".lora_down.weight"].double()
    up = sd[name + ".lora_up.weight"].double()
    rank = down.shape[0]
    alpha = float(sd[name + ".alpha"]) if name + ".alpha" in sd else rank
    return (up.reshape(up.shape[0], rank) @ down.reshape(rank, -1) * (alpha / rank)).numpy()


def modules_in(sd):
    return sorted({k.split(".")[0] for k in sd})


def rel(a: np.ndarray, b: np.ndarray) -> float:
    n = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / n) if n > 0 else float(np.linalg.norm(a))


def truncated(mat: np.ndarray, rank: int) -> np.ndarray:
    """The best rank-`rank` approximation (Eckart-Young), from a float64 SVD of the full matrix."""
    U, S, Vh = torch.linalg.svd(torch.from_numpy(mat), full_matrices=False)
    return ((U[:, :rank] * S[:rank]) @ Vh[:rank]).numpy()


def tensor_data_sha256(path) -> str:
    """sd-webui-additional-networks' model hash: SHA-256 of everything after the header."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        f.seek(8 + n)
        return hashlib.sha256(f.read()).hexdigest()


def one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture(scope="module")
def lora_a(tmp_path_factory):
    """SD1 tiny LoRA: dim 4 / alpha 2, LoCon conv_dim 3 / alpha 1, text encoder included."""
    return make_lora_file("sd15", tmp_path_factory.mktemp("a") / "a.safetensors", seed=1)


@pytest.fixture(scope="module")
def lora_b(tmp_path_factory):
    """dim 2 / alpha 1, no 3x3 convs, no text encoder."""
    return make_lora_file("sd15", tmp_path_factory.mktemp("b") / "b.safetensors", seed=2, dim=2, alpha=1.0,
                          conv_dim=None, text_encoder=False)


# --- resize_lora ----------------------------------------------------------------------------------

def test_resize_to_full_rank_reproduces_every_delta(lora_a, tmp_path):
    out = tmp_path / "full.safetensors"
    assert resize_lora.main(["--model", lora_a, "--save_to", str(out), "--new_rank", "4",
                             "--new_conv_rank", "3"]) == 0
    old, _ = read(lora_a)
    new, md = read(out)
    assert modules_in(new) == modules_in(old)
    for name in modules_in(old):
        assert rel(ref_delta(new, name), ref_delta(old, name)) < 1e-5, name
        # the scale alpha / rank is kept
        assert float(new[name + ".alpha"]) / new[name + ".lora_down.weight"].shape[0] == pytest.approx(
            float(old[name + ".alpha"]) / old[name + ".lora_down.weight"].shape[0])
    assert md["ss_network_dim"] == "4" and float(md["ss_network_alpha"]) == 2.0
    assert json.loads(md["ss_network_args"]) == {"conv_dim": "3", "conv_alpha": "1.0"}
    assert md["ss_training_comment"].startswith("dimension is resized from 4 to 4 (conv: 3)")
    assert md["sshs_model_hash"] == tensor_data_sha256(out)


def test_resize_lower_rank_is_the_best_approximation_and_never_grows(lora_a, tmp_path, capsys):
    out = tmp_path / "r2.safetensors"
    assert resize_lora.main(["--model", lora_a, "--save_to", str(out), "--new_rank", "2",
                             "--new_conv_rank", "8", "--save_precision", "fp16"]) == 0
    old, _ = read(lora_a)
    new, md = read(out)
    assert all(v.dtype == torch.float16 for v in new.values())
    for name in modules_in(old):
        r_old = old[name + ".lora_down.weight"].shape[0]
        r_new = new[name + ".lora_down.weight"].shape[0]
        conv3x3 = old[name + ".lora_down.weight"].dim() == 4 and old[name + ".lora_down.weight"].shape[-1] == 3
        assert r_new == (r_old if conv3x3 else 2), name  # conv: 8 asked, 3 kept (never grows)
        # Eckart-Young: the rank-r truncation of the float64 delta (fp16 storage: 1e-3)
        assert rel(ref_delta(new, name), truncated(ref_delta(old, name), r_new)) < 2e-3, name
    assert md["ss_network_dim"] == "2" and json.loads(md["ss_network_args"])["conv_dim"] == "3"
    assert "saved" in capsys.readouterr().out


def _orthonormal(n, k, seed):
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, k)))
    return q


def spectrum_lora(path, spectra: dict[str, list[float]], alpha=4.0):
    """Linear modules (out 16, in 12) whose up @ down has exactly the given singular values."""
    from safetensors.torch import save_file
    sd = {}
    for i, (name, s) in enumerate(spectra.items()):
        r = len(s)
        up = _orthonormal(16, r, 2 * i) * np.asarray(s)
        down = _orthonormal(12, r, 2 * i + 1).T
        sd[name + ".lora_down.weight"] = torch.tensor(down, dtype=torch.float32).contiguous()
        sd[name + ".lora_up.weight"] = torch.tensor(up, dtype=torch.float32)
        sd[name + ".alpha"] = torch.tensor(alpha)
    save_file(sd, str(path), {"ss_network_dim": "8", "ss_training_comment": "hand-built"})
    return str(path)


SPECTRA = {"lora_unet_a": [8, 4, 2, 1, 0.5, 0.25, 0.125, 0.0625], "lora_unet_flat": [1.0] * 8}


@pytest.mark.parametrize("method,param,expected", [
    # keep S_i >= 8 / 10: 8, 4, 2, 1 -> 4; the flat spectrum keeps all 8
    ("sv_ratio", 10, {"lora_unet_a": 4, "lora_unet_flat": 8}),
    # cumulative sums / 15.9375: .502 .753 .878 .941 .973 -> first >= 0.95 at 5; flat: 8 (7/8 < .95)
    ("sv_cumulative", 0.95, {"lora_unet_a": 5, "lora_unet_flat": 8}),
    # squares 64 16 4 1 ... / 85.33: .750 .9375 .984 -> 0.99^2 = .9801 reached at 3; flat: 8
    ("sv_fro", 0.99, {"lora_unet_a": 3, "lora_unet_flat": 8}),
])
def test_dynamic_methods_keep_the_criterion_rank(method, param, expected, tmp_path, capsys):
    src = spectrum_lora(tmp_path / "s.safetensors", SPECTRA)
    out = tmp_path / "d.safetensors"
    assert resize_lora.main(["--model", src, "--save_to", str(out), "--new_rank", "8", "--dynamic_method",
                             method, "--dynamic_param", str(param), "--verbose"]) == 0
    printed = capsys.readouterr().out
    new, md = read(out)
    old, _ = read(src)
    for name, rank in expected.items():
        assert new[name + ".lora_down.weight"].shape[0] == rank
        assert float(new[name + ".alpha"]) == pytest.approx(4.0 / 8 * rank)  # old scale * new rank
        assert rel(ref_delta(new, name), truncated(ref_delta(old, name), rank)) < 1e-5
        s = np.asarray(SPECTRA[name])
        fro = np.sqrt((s[:rank] ** 2).sum() / (s ** 2).sum())
        assert f"{name:75} | rank 8 -> {rank}, fro retained {fro:.1%}" in printed
    assert md["ss_network_dim"] == "Dynamic" and md["ss_network_alpha"] == "Dynamic"
    assert md["ss_training_comment"] == f"Dynamic resize with {method}: {float(param)} from 8; hand-built"
    assert "Frobenius norm retained: mean" in printed

    # --new_rank caps the dynamic rank
    assert resize_lora.main(["--model", src, "--save_to", str(out), "--new_rank", "2", "--dynamic_method",
                             method, "--dynamic_param", str(param)]) == 0
    assert {read(out)[0][n + ".lora_down.weight"].shape[0] for n in expected} == {2}


def test_resize_errors_are_one_line(lora_a, tmp_path, capsys):
    out = str(tmp_path / "o.safetensors")
    assert resize_lora.main(["--model", str(tmp_path / "nope.safetensors"), "--save_to", out]) == 2
    one_line_error(capsys, "--model", "not found")
    model = tmp_path / "model.safetensors"
    from safetensors.torch import save_file
    save_file({"model.diffusion_model.x.weight": torch.zeros(2, 2)}, str(model))
    assert resize_lora.main(["--model", str(model), "--save_to", out]) == 2
    one_line_error(capsys, "not a kohya LoRA file")
    assert resize_lora.main(["--model", lora_a, "--save_to", out, "--new_rank", "0"]) == 2
    one_line_error(capsys, "--new_rank 0")
    assert resize_lora.main(["--model", lora_a, "--save_to", out, "--dynamic_method", "sv_fro"]) == 2
    one_line_error(capsys, "--dynamic_param")
    assert resize_lora.main(["--model", lora_a, "--save_to", out, "--dynamic_method", "sv_fro",
                             "--dynamic_param", "1.5"]) == 2
    one_line_error(capsys, "(0, 1]")
    assert resize_lora.main(["--model", lora_a, "--save_to", str(tmp_path / "o.txt")]) == 2
    one_line_error(capsys, "--save_to")
    assert not os.path.exists(out)
    nan = tmp_path / "nan.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.ones(2, 3),
               "lora_unet_x.lora_up.weight": torch.tensor([[float("inf"), 1.0]] * 4)}, str(nan))
    assert resize_lora.main(["--model", str(nan), "--save_to", out, "--new_rank", "1"]) == 2
    one_line_error(capsys, "lora_unet_x", "non-finite")
    # a result that overflows its dtype is never written; the file already there stays as it was
    big = tmp_path / "big.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.eye(3)[:2].contiguous(),
               "lora_unet_x.lora_up.weight": torch.full((4, 2), 1e5)}, str(big))
    with open(out, "wb") as f:
        f.write(b"previous")
    assert resize_lora.main(["--model", str(big), "--save_to", out, "--new_rank", "1",
                             "--save_precision", "fp16"]) == 2
    one_line_error(capsys, "non-finite", out)
    assert open(out, "rb").read() == b"previous"
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


# --- extract_lora_from_models -------------------------------------------------------------------------

def _low_rank(shape, rank, seed, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape[0], rank, generator=g, dtype=torch.float64)
    b = torch.randn(rank, int(np.prod(shape[1:])), generator=g, dtype=torch.float64)
    return (a @ b * scale / rank).reshape(shape)


@pytest.mark.parametrize("arch,form", [("sd15", "single_file"), ("sd15", "diffusers"),
                                       ("sdxl", "single_file"), ("sdxl", "diffusers")])
def test_extract_recovers_low_rank_deltas(arch, form, tmp_path, capsys):
    from library.models import sd_checkpoint
    family = {"sd15": "sd1", "sdxl": "sdxl"}[arch]
    c = build_tiny_components(arch)
    net = lora.LoRANetwork(tes(c), c["unet"], lora_dim=4, alpha=4, conv_lora_dim=3, conv_alpha=3)
    targets = {m.lora_name: m.org_module for m in net.text_encoder_loras + net.unet_loras}
    first_te = "lora_te1_" if arch == "sdxl" else "lora_te_"
    chosen = [next(n for n in targets if n.startswith(first_te)),
              next(n for n in targets if n.endswith("attn2_to_k")),
              next(n for n in targets if n.endswith("_ff_net_2")),
              next(n for n in targets if n.endswith("resnets_0_conv1") or n.endswith("_0_in_layers_2"))]
    assert targets[chosen[3]].kernel_size == (3, 3)
    deltas = {}
    with torch.no_grad():
        for i, name in enumerate(chosen):
            w = targets[name].weight
            deltas[name] = _low_rank(tuple(w.shape), 2 if i < 3 else 3, seed=i)
            w.add_(deltas[name].float())
    if form == "single_file":
        org, tuned = f"tiny-{arch}", str(tmp_path / "tuned.safetensors")
        sd_checkpoint.save_single_file(c, family, tuned)
    else:
        org, tuned = str(tmp_path / "org"), str(tmp_path / "tuned")
        sd_checkpoint.save_diffusers(build_tiny_components(arch), family, org)
        sd_checkpoint.save_diffusers(c, family, tuned)

    out = tmp_path / "x.safetensors"
    flags = ["--sdxl"] if arch == "sdxl" else []
    assert extract_lora_from_models.main(["--model_org", org, "--model_tuned", tuned, "--save_to", str(out),
                                          "--dim", "4", "--conv_dim", "3", "--clamp_quantile", "1", *flags]) == 0
    printed = capsys.readouterr().out
    sd, md = read(out)
    # every U-Net module training creates with conv_dim; only the changed text encoder
    counts = count_sd_scripts_modules(c, conv=True)
    got = {}
    for name in modules_in(sd):
        p = name.split("_")[1]
        got[p] = got.get(p, 0) + 1
    expected = {"unet": counts["unet"], ("te1" if arch == "sdxl" else "te"): counts["te1" if arch == "sdxl" else "te"]}
    assert got == expected
    if arch == "sdxl":
        assert "lora_te2: max |diff| 0 (min_diff 0.01): unchanged, not extracted" in printed
    for name in modules_in(sd):
        d = ref_delta(sd, name)
        if name in deltas:
            assert rel(d, deltas[name].reshape(d.shape[0], -1).numpy()) < 1e-4, name
        else:
            assert np.abs(d).max() < 1e-6, name
    assert sd[chosen[3] + ".lora_down.weight"].shape[1:] == targets[chosen[3]].weight.shape[1:]
    assert md["ss_network_dim"] == "4" and float(md["ss_network_alpha"]) == 4.0
    assert json.loads(md["ss_network_args"]) == {"conv_dim": "3", "conv_alpha": "3.0"}
    assert md["ss_base_model_version"] == {"sd15": "sd_v1", "sdxl": "sdxl_base_v1-0"}[arch]
    assert md["modelspec.architecture"].endswith("/lora") and md["sshs_model_hash"] == tensor_data_sha256(out)


def test_extract_sd2_metadata_and_unchanged_models(tmp_path, capsys):
    out = tmp_path / "x.safetensors"
    assert extract_lora_from_models.main(["--model_org", "tiny-sd2", "--model_tuned", "tiny-sd2", "--save_to",
                                          str(out), "--v2", "--dim", "2", "--no_metadata"]) == 0
    assert "lora_te: max |diff| 0 (min_diff 0.01): unchanged, not extracted" in capsys.readouterr().out
    sd, md = read(out)
    assert modules_in(sd) and all(n.startswith("lora_unet_") for n in modules_in(sd))
    assert all(np.abs(ref_delta(sd, n)).max() == 0 for n in modules_in(sd))
    assert md["ss_v2"] == "True" and md["ss_base_model_version"] == "sd_v2"
    assert not any(k.startswith("modelspec.") for k in md)  # --no_metadata: the minimum ss_* only
    assert json.loads(md["ss_network_args"]) == {}


def test_extract_errors_are_one_line(tmp_path, capsys):
    out = str(tmp_path / "x.safetensors")
    assert extract_lora_from_models.main(["--model_org", "tiny-sd15", "--model_tuned", "tiny-sd15",
                                          "--save_to", out, "--sdxl"]) == 2
    one_line_error(capsys, "--sdxl", "--model_org", "SD1")
    assert extract_lora_from_models.main(["--model_org", "tiny-sd15", "--model_tuned", "tiny-sd15",
                                          "--save_to", out, "--v2"]) == 2
    one_line_error(capsys, "--v2", "SD1")
    assert extract_lora_from_models.main(["--model_org", "tiny-sd15", "--model_tuned", "tiny-sdxl",
                                          "--save_to", out]) == 2
    one_line_error(capsys, "SD1", "SDXL")
    assert extract_lora_from_models.main(["--model_org", "tiny-sd15", "--model_tuned", str(tmp_path / "none"),
                                          "--save_to", out]) == 2
    one_line_error(capsys, str(tmp_path / "none"))
    assert extract_lora_from_models.main(["--model_org", "tiny-sd15", "--model_tuned", "tiny-sd15",
                                          "--save_to", out, "--clamp_quantile", "0"]) == 2
    one_line_error(capsys, "--clamp_quantile")
    assert not os.path.exists(out)


# --- svd_merge_lora and merge_lora (LoRA + LoRA) -------------------------------------------------------

def weighted_sum(files_ratios):
    sds = [(read(p)[0], r) for p, r in files_ratios]
    out = {}
    for sd, r in sds:
        for name in modules_in(sd):
            out[name] = out.get(name, 0) + r * ref_delta(sd, name)
    return out


def test_svd_merge_at_sufficient_rank_is_the_weighted_sum(lora_a, lora_b, tmp_path):
    out = tmp_path / "svd.safetensors"
    assert svd_merge_lora.main(["--models", lora_a, lora_b, "--ratios", "1.0", "-0.5", "--save_to", str(out),
                                "--new_rank", "6", "--new_conv_rank", "8"]) == 0
    sd, md = read(out)
    expected = weighted_sum([(lora_a, 1.0), (lora_b, -0.5)])
    assert modules_in(sd) == sorted(expected)
    a, _ = read(lora_a)
    b, _ = read(lora_b)
    conv = 0
    for name, ref in expected.items():
        assert rel(ref_delta(sd, name), ref) < 1e-5, name
        # never above the sum of the input ranks: 6 = 4 + 2 where both have the module, 4 where only
        # a has it; 3x3 convs (only in a, rank 3): 3 although 8 was asked
        ranks = sum(x[name + ".lora_down.weight"].shape[0] for x in (a, b) if name + ".lora_down.weight" in x)
        is_conv = a[name + ".lora_down.weight"].dim() == 4 and a[name + ".lora_down.weight"].shape[-1] == 3
        conv += is_conv
        assert sd[name + ".lora_down.weight"].shape[0] == (3 if is_conv else min(6, ranks)), name
    assert conv > 0
    assert md["ss_network_dim"] == "Dynamic"  # 6 where both files have the module, 4 where only a has it
    assert md["modelspec.merged_from"] == "a, b"
    assert md["sshs_model_hash"] == tensor_data_sha256(out)


def test_merge_concat_is_exactly_the_weighted_sum(lora_a, lora_b, tmp_path, capsys):
    out = tmp_path / "cat.safetensors"
    assert merge_lora.main(["--models", lora_a, lora_b, "--ratios", "0.7", "-1.3", "--save_to", str(out),
                            "--concat", "--shuffle"]) == 0
    assert "warning" not in capsys.readouterr().err
    sd, md = read(out)
    a, _ = read(lora_a)
    b, _ = read(lora_b)
    for name, ref in weighted_sum([(lora_a, 0.7), (lora_b, -1.3)]).items():
        assert rel(ref_delta(sd, name), ref) < 1e-6, name
        ranks = sum(x[name + ".lora_down.weight"].shape[0] for x in (a, b) if name + ".lora_down.weight" in x)
        assert sd[name + ".lora_down.weight"].shape[0] == ranks
    assert "concatenated" in md["ss_training_comment"]


def test_merge_without_concat_keeps_sd_scripts_arithmetic_and_warns(lora_a, tmp_path, capsys):
    other = make_lora_file("sd15", tmp_path / "c.safetensors", seed=5, alpha=1.0, conv_dim=None)
    out = tmp_path / "plain.safetensors"
    assert merge_lora.main(["--models", lora_a, other, "--ratios", "0.5", "-2", "--save_to", str(out)]) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("warning:") and "--concat" in err and "\n" not in err
    sd, _ = read(out)
    a, _ = read(lora_a)
    c, _ = read(other)
    name = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    # by hand: base alpha 2 (file a); s_c = sqrt(1 / 2) * -2
    s_c = np.sqrt(1 / 2) * -2
    up = 0.5 * a[name + ".lora_up.weight"].double() + abs(s_c) * c[name + ".lora_up.weight"].double()
    down = 0.5 * a[name + ".lora_down.weight"].double() + s_c * c[name + ".lora_down.weight"].double()
    assert torch.allclose(sd[name + ".lora_up.weight"].double(), up, atol=1e-6)
    assert torch.allclose(sd[name + ".lora_down.weight"].double(), down, atol=1e-6)
    assert float(sd[name + ".alpha"]) == 2.0
    # a 3x3 conv module only a has: scaled by 0.5 on each factor (sd-scripts)
    conv = next(n for n in modules_in(a) if n not in modules_in(c))
    assert torch.allclose(sd[conv + ".lora_up.weight"], 0.5 * a[conv + ".lora_up.weight"])


def test_lora_merges_reject_mismatched_inputs(lora_a, tmp_path, capsys):
    from safetensors.torch import save_file
    bad = tmp_path / "bad.safetensors"
    name = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    save_file({name + ".lora_down.weight": torch.zeros(4, 7), name + ".lora_up.weight": torch.zeros(9, 4)}, str(bad))
    out = str(tmp_path / "o.safetensors")
    assert svd_merge_lora.main(["--models", lora_a, str(bad), "--save_to", out]) == 2
    one_line_error(capsys, "mismatched modules", name)
    assert merge_lora.main(["--models", lora_a, str(bad), "--save_to", out, "--concat"]) == 2
    one_line_error(capsys, "mismatched modules")
    xl = make_lora_file("sdxl", tmp_path / "xl.safetensors", seed=1, conv_dim=None)
    sd, md = read(xl)
    from safetensors.torch import save_file as save
    save(sd, xl, {"ss_base_model_version": "sdxl_base_v1-0"})
    save(read(lora_a)[0], str(tmp_path / "v1.safetensors"), {"ss_base_model_version": "sd_v1"})
    assert svd_merge_lora.main(["--models", str(tmp_path / "v1.safetensors"), xl, "--save_to", out]) == 2
    one_line_error(capsys, "sdxl_base_v1-0", "sd_v1")
    assert svd_merge_lora.main(["--models", lora_a, "--ratios", "1", "2", "--save_to", out]) == 2
    one_line_error(capsys, "--ratios")
    assert merge_lora.main(["--sd_model", "tiny-sd15", "--models", lora_a, "--save_to", out, "--concat"]) == 2
    one_line_error(capsys, "--concat")
    assert not os.path.exists(out)


# --- show_metadata ---------------------------------------------------------------------------------------

def test_show_metadata_readable_json_and_errors(tmp_path, capsys):
    from safetensors.torch import save_file
    path = tmp_path / "m.safetensors"
    save_file({"x": torch.zeros(1)}, str(path), {"ss_network_dim": "4", "ss_network_args": '{"conv_dim": "2"}',
                                                 "ss_tag_frequency": '{"1_a": {"sks": 3}}', "modelspec.title": "m"})
    assert show_metadata.main(["--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ss_network_dim: 4" in out and "modelspec.title: m" in out
    assert '"conv_dim": "2"' in out and '"sks": 3' in out
    assert out.index("modelspec.title") < out.index("ss_network_args") < out.index("ss_network_dim")  # sorted
    assert show_metadata.main(["--model", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == {"ss_network_dim": "4", "ss_network_args": {"conv_dim": "2"},
                    "ss_tag_frequency": {"1_a": {"sks": 3}}, "modelspec.title": "m"}
    assert show_metadata.main(["--model", str(tmp_path / "missing.safetensors")]) == 2
    one_line_error(capsys, "not found")
    (tmp_path / "notes.txt").write_text("hello, not a model at all\n")
    assert show_metadata.main(["--model", str(tmp_path / "notes.txt")]) == 2
    one_line_error(capsys, "not a safetensors file")


# --- end to end on a trained LoRA -------------------------------------------------------------------------

def check_loads(path, base_sd):
    """Our loader takes every key; diffusers' load_lora_weights consumes the file without a warning and
    its fused weights are base + up @ down * alpha / rank for every module the file names."""
    from diffusers import StableDiffusionPipeline
    c = build_tiny_components("sd15")
    net, sd = lora.create_network_from_weights(1.0, path, None, c["text_encoder"], c["unet"])
    net.load_weights(path)
    assert len(net.text_encoder_loras) + len(net.unet_loras) == len(modules_in(sd))

    pipe = StableDiffusionPipeline(vae=c["vae"], text_encoder=c["text_encoder"], tokenizer=c["tokenizer"],
                                   unet=c["unet"], scheduler=c["scheduler"], safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    problems = diffusers_load_problems(pipe, path)
    assert problems == [], problems
    pipe.fuse_lora(lora_scale=1.0)
    pipe.unload_lora_weights()
    fused = {("unet", k): v for k, v in pipe.unet.state_dict().items()}
    fused.update({("text_encoder", k): v for k, v in pipe.text_encoder.state_dict().items()})
    where = {}
    for root_name, root in (("unet", c["unet"]), ("text_encoder", c["text_encoder"])):
        paths = {id(m): p for p, m in root.named_modules()}
        for m in net.text_encoder_loras + net.unet_loras:
            if id(m.org_module) in paths:
                where[m.lora_name] = (root_name, paths[id(m.org_module)] + ".weight")
    for name in modules_in(sd):
        key = where[name]
        expected = base_sd[key].double().numpy().reshape(base_sd[key].shape[0], -1) + ref_delta(sd, name)
        got = fused[key].double().numpy().reshape(expected.shape)
        assert np.abs(got - expected).max() < 1e-5, name


# At 64 px the tiny U-Net's mid block attends over a single token: the softmax is 1 whatever q and k
# are, so the gradients to its attn1 to_q / to_k LoRA modules are zero in exact arithmetic. One CPU's
# kernels leave them exactly zero (their up weights stay 0), another's leave float noise that AdamW
# then scales to lr-sized steps. The resized file's metadata must not depend on which.
ZERO_GRADIENT_AT_64PX = ("lora_unet_mid_block_attentions_0_transformer_blocks_0_attn1_to_q",
                         "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn1_to_k")


def check_resize_metadata_whatever_the_cpu(t_sd, t_md, tmp_path):
    """A fixed-rank resize gives every module the requested rank and writes it to the metadata,
    whether those modules' up weights are exact zeros, 1e-12 noise (below MIN_SV, sd-scripts' zero
    matrix) or AdamW-sized noise; the exact-zero module's delta stays exactly zero."""
    from safetensors.torch import save_file
    assert all(n + ".lora_up.weight" in t_sd for n in ZERO_GRADIENT_AT_64PX)
    gen = torch.Generator().manual_seed(0)
    for label, scale in (("zero", 0.0), ("noise", 1e-12), ("adamw", 1e-3)):
        sd = dict(t_sd)
        for n in ZERO_GRADIENT_AT_64PX:
            up = sd[n + ".lora_up.weight"]
            sd[n + ".lora_up.weight"] = torch.randn(up.shape, generator=gen, dtype=up.dtype) * scale
        src, dst = tmp_path / f"forced-{label}.safetensors", tmp_path / f"forced-{label}-r2.safetensors"
        save_file(sd, str(src), t_md)
        assert resize_lora.main(["--model", str(src), "--save_to", str(dst), "--new_rank", "2",
                                 "--new_conv_rank", "1"]) == 0
        r_sd, r_md = read(dst)
        ranks = {r_sd[n + ".lora_down.weight"].shape[0] for n in ZERO_GRADIENT_AT_64PX}
        assert ranks == {2}, (label, ranks)
        if label == "zero":
            assert all(not r_sd[n + ".lora_up.weight"].any() for n in ZERO_GRADIENT_AT_64PX)
        assert (r_md["ss_network_dim"], r_md["ss_network_alpha"]) == ("2", "1.0"), label
        assert json.loads(r_md["ss_network_args"]) == {"conv_dim": "1", "conv_alpha": "0.5"}, label


def test_every_tool_on_a_trained_locon(dataset, tmp_path, run_script, capsys):
    out = tmp_path / "train"
    rc, _, err = run_script("train_lora", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset, "--output_dir", out,
        "--resolution", "64", "--max_train_steps", "2", "--learning_rate", "1e-2", "--network_dim", "4",
        "--network_alpha", "2", "--network_args", "conv_dim=2", "conv_alpha=1", "--cache_latents"])
    assert rc == 0, err
    trained = str(out / "last.safetensors")
    t_sd, t_md = read(trained)
    assert any(v.dim() == 4 and v.shape[-1] == 3 for v in t_sd.values())  # LoCon modules

    c = build_tiny_components("sd15")
    base_sd = {("unet", k): v for k, v in c["unet"].state_dict().items()}
    base_sd.update({("text_encoder", k): v for k, v in c["text_encoder"].state_dict().items()})

    outputs = {}
    outputs["resize"] = str(tmp_path / "resized.safetensors")
    # the flags the kohya_ss GUI passes
    assert resize_lora.main(["--model", trained, "--save_to", outputs["resize"], "--new_rank", "2",
                             "--new_conv_rank", "1", "--verbose", "--device", "cpu", "--svd_lowrank_niter", "2",
                             "--save_precision", "float"]) == 0
    outputs["svd_merge"] = str(tmp_path / "svd.safetensors")
    assert svd_merge_lora.main(["--models", trained, outputs["resize"], "--ratios", "0.5", "0.5",
                                "--save_to", outputs["svd_merge"], "--new_rank", "3"]) == 0
    outputs["concat"] = str(tmp_path / "concat.safetensors")
    assert merge_lora.main(["--models", trained, outputs["resize"], "--save_to", outputs["concat"], "--concat"]) == 0
    outputs["plain"] = str(tmp_path / "plain.safetensors")
    assert merge_lora.main(["--models", trained, "--save_to", outputs["plain"]]) == 0
    merged_model = str(tmp_path / "merged_model.safetensors")
    assert merge_lora.main(["--sd_model", "tiny-sd15", "--models", trained, "--save_to", merged_model]) == 0
    outputs["extract"] = str(tmp_path / "extracted.safetensors")
    assert extract_lora_from_models.main(["--model_org", "tiny-sd15", "--model_tuned", merged_model,
                                          "--save_to", outputs["extract"], "--dim", "4", "--conv_dim", "2",
                                          "--clamp_quantile", "1", "--min_diff", "0", "--load_precision", "float",
                                          "--load_original_model_to", "cpu", "--load_tuned_model_to", "cpu"]) == 0
    capsys.readouterr()
    assert show_metadata.main(["--model", trained]) == 0
    shown = capsys.readouterr().out
    for key in ("ss_network_dim: 4", "ss_network_module: networks.lora", "sshs_model_hash:", '"conv_dim": "2"'):
        assert key in shown

    # the extracted LoRA is the trained one (rank 4 / conv rank 2 is enough), up to the float32
    # cancellation in (W + dW) - W: after 2 steps some deltas are ~1e-7 against weights ~1e-2
    x_sd, x_md = read(outputs["extract"])
    assert modules_in(x_sd) == modules_in(t_sd)
    err = total = 0.0
    for name in modules_in(t_sd):
        got, ref = ref_delta(x_sd, name), ref_delta(t_sd, name)
        assert np.abs(got - ref).max() < 1e-7, name
        err, total = err + np.linalg.norm(got - ref) ** 2, total + np.linalg.norm(ref) ** 2
    assert np.sqrt(err / total) < 1e-4
    # metadata carried over from the trained file and updated
    r_md = read(outputs["resize"])[1]
    assert r_md["ss_seed"] == t_md["ss_seed"] and r_md["ss_network_dim"] == "2"
    assert r_md["ss_network_alpha"] == "1.0"  # old scale 2 / 4 times the new rank
    assert json.loads(r_md["ss_network_args"]) == {"conv_dim": "1", "conv_alpha": "0.5"}
    check_resize_metadata_whatever_the_cpu(t_sd, t_md, tmp_path)

    for path in outputs.values():
        check_loads(path, base_sd)


def test_every_script_has_help(capsys):
    import subprocess
    import sys
    for main, flag in ((resize_lora.main, "--dynamic_method"), (extract_lora_from_models.main, "--clamp_quantile"),
                       (svd_merge_lora.main, "--new_conv_rank"), (merge_lora.main, "--concat"),
                       (show_metadata.main, "--json")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--help"])
        assert exit_info.value.code == 0 and flag in capsys.readouterr().out
    # from a plain checkout, as the kohya_ss GUI calls them (merge_lora: tests/networks/test_merge_lora.py)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for script in ("tools/show_metadata.py", "networks/resize_lora.py"):
        proc = subprocess.run([sys.executable, os.path.join(root, script), "--help"], capture_output=True,
                              text=True, cwd=root, timeout=120)
        assert proc.returncode == 0 and "--model" in proc.stdout, proc.stderr
