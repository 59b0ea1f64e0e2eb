"""DoRA by name: ``lycoris.kohya`` with ``dora_wd=True`` trained and resumed bit for bit on tiny-sd15,
its ``dora_scale`` keys in A1111's and ComfyUI's key tables and arithmetic
(tests/client_key_tables.py), merged into a model by merge_lora.py against a float64 hand
computation W + r * (m * (W + s*B*A) / ||W + s*B*A|| - W) along the file's norm axis, and the LoRA
tools that rewrite lora_down / lora_up refusing DoRA (and LyCORIS full) files by operation."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests import client_key_tables as clients
from tests.conftest import read

pytest.importorskip("lycoris")

from library.models import sd_checkpoint  # noqa: E402
from library.models.loading import load_model_bundle  # noqa: E402
from networks import (check_lora_weights, extract_lora_from_dylora, lora_names, merge_lora, resize_lora,  # noqa: E402
                      svd_merge_lora)


def args(data, out, steps, *extra, lr="1e-3", net_args=(), model="tiny-sd15"):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", str(steps), "--learning_rate", lr, "--seed", "5",
            "--network_dim", "4", "--network_alpha", "4", "--network_module", "lycoris.kohya",
            "--network_args", "algo=lora", "dora_wd=True", "conv_dim=4", "conv_alpha=4", *net_args, *extra]


def modules_of(sd: dict) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict] = {}
    for k, v in sd.items():
        name, _, part = k.partition(".")
        out.setdefault(name, {})[part] = v.double()
    return out


def reference(w: torch.Tensor, p: dict, ratio: float, axis: int) -> torch.Tensor:
    """float64 by hand: V = W + (alpha / rank) * up @ down (in W's shape), divided by the root of
    its sum of squares over every axis but ``axis`` and multiplied by dora_scale (in its file shape),
    then W + ratio * (that - W). ``axis`` other than dora_scale's is the transposed norm."""
    up, down = p["lora_up.weight"], p["lora_down.weight"]
    rank = down.shape[0]
    v = w + (float(p["alpha"]) / rank) * (up.reshape(up.shape[0], rank) @ down.reshape(rank, -1)).reshape(w.shape)
    norms = (v * v).sum(dim=[d for d in range(w.dim()) if d != axis], keepdim=True).sqrt()
    return w + ratio * (v * p["dora_scale"] / norms - w)


def test_dora_trains_by_name_and_resumes_exactly(dataset, tmp_path, train):
    rc, _, err, run = train("train_lora", args(dataset, str(tmp_path / "a"), 4))
    assert rc == 0, err[-2000:]
    sd, meta = read(tmp_path / "a" / "last.safetensors")
    assert meta["ss_network_module"] == "lycoris.kohya" and '"dora_wd": "True"' in meta["ss_network_args"]
    modules = modules_of(sd)
    assert all(set(p) == {"lora_down.weight", "lora_up.weight", "alpha", "dora_scale"} for p in modules.values())

    # LyCORIS 3.4's default (wd_on_output): one magnitude per output row, shape (out, 1, ...), set to
    # the row norms of W at the start and trained since; the trained network's own weights
    # (LyCORIS' get_merged_weight) are the file's DoRA weight on the base model
    base = load_model_bundle("tiny-sd15")
    layers = lora_names.kohya_layers(list(base.text_encoders), base.unet)
    renames = lora_names.plain_to_kohya_names(list(base.text_encoders), base.unet)
    net = run.parts.method.network
    trained = {renames.get(m.lora_name, m.lora_name): m for m in net.text_encoder_loras + net.unet_loras}
    assert set(trained) == set(modules)
    moved = 0
    for name, p in modules.items():
        w = layers[name].weight.detach().double()
        assert p["dora_scale"].shape == (w.shape[0], *[1] * (w.dim() - 1)), name
        moved += not torch.allclose(p["dora_scale"].flatten(), w.reshape(w.shape[0], -1).norm(dim=1), rtol=1e-6)
        with torch.no_grad():
            got = trained[name].get_merged_weight(multiplier=1)[0].detach().double().reshape(w.shape)
        want = reference(w, p, 1.0, axis=0)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max())), name
    assert moved > len(modules) // 2

    rc, _, err, _ = train("train_lora", args(dataset, str(tmp_path / "b"), 2, "--save_state"))
    assert rc == 0, err[-2000:]
    rc, _, err, _ = train("train_lora", args(dataset, str(tmp_path / "b"), 4, "--resume",
                                             str(tmp_path / "b" / "last-state")))
    assert rc == 0, err[-2000:]
    again, _ = read(tmp_path / "b" / "last.safetensors")
    assert set(again) == set(sd) and all(torch.equal(again[k], sd[k]) for k in sd)


@pytest.mark.parametrize("model, family, axis", [("tiny-sd15", "sd1", 0), ("tiny-sd15", "sd1", 1), ("tiny-sdxl", "sdxl", 0)],
                         ids=["output-rows", "input-columns", "sdxl-unet"])
def test_dora_file_in_the_clients_and_merged_along_its_norm_axis(model, family, axis, dataset, tmp_path, run_script):
    """SDXL: the U-Net alone (SAI names); its second text encoder is a MultiheadAttention in the
    original layout, whose stacked q/k/v rows this hand computation does not split."""
    extra = ("--network_train_unet_only",) if family == "sdxl" else ()
    net_args = () if axis == 0 else ("wd_on_output=False",)
    rc, _, err = run_script("train_lora", args(dataset, str(tmp_path / "o"), 2, *extra, lr="2e-2", net_args=net_args,
                                               model=model))
    assert rc == 0, err[-2000:]
    path = tmp_path / "o" / "last.safetensors"
    sd, _ = read(path)
    modules = modules_of(sd)
    base = load_model_bundle(model)
    c = base.components()
    original = {k: v.double() for k, v in sd_checkpoint.original_state_dict(c, family).items()}
    keys = clients.a1111_weight_keys(original)
    comfy = clients.comfy_names(c, family)

    # the clients read every tensor of every module, and put it on the layer it was trained on
    for name, p in modules.items():
        assert clients.A1111_TYPES["LoRA"](set(p)) and clients.COMFY_TYPES["LoRA"](set(p))
        assert set(p) <= clients.A1111_READS and set(p) <= clients.COMFY_READS
        assert name in comfy and clients.a1111_target(name, keys) is not None, name
        w = original[keys[clients.a1111_target(name, keys)]]
        ones = [1] * (w.dim() - 1)
        assert p["dora_scale"].shape == ((w.shape[0], *ones) if axis == 0 else (1, w.shape[1], *ones[1:])), name

    # merge_lora.py --sd_model at ratio 0.7 == the float64 hand computation along the file's axis,
    # rounded once to float32; the transposed axis is far from it
    out = tmp_path / "merged.safetensors"
    assert merge_lora.main(["--sd_model", model, "--models", str(path), "--ratios", "0.7",
                            "--save_to", str(out)]) == 0
    merged, _ = read(out)
    far = 0
    for name, p in modules.items():
        key = keys[clients.a1111_target(name, keys)]
        w = original[key]
        want = reference(w, p, 0.7, axis)
        assert torch.allclose(merged[key].double(), want, rtol=2e-7, atol=1e-12), name
        wrong = reference(w, p, 0.7, 1 - axis)
        far += bool((merged[key].double() - wrong).norm() > 1e-3 * want.norm())
    assert far > len(modules) // 2

    # the clients' own DoRA arithmetic on this file: both are the formula on the input axis (alpha
    # == rank here, A1111 applies alpha / rank after the decomposition); on the output axis ComfyUI
    # divides by the base rows' norm and A1111 normalises the input columns whatever the file says
    exact, unmoved = {"A1111": 0, "ComfyUI": 0}, 0
    for name, p in modules.items():
        w = original[keys[clients.a1111_target(name, keys)]]
        up, down = p["lora_up.weight"], p["lora_down.weight"]
        prod = (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)).reshape(w.shape)
        rank, alpha = down.shape[0], float(p["alpha"])
        want = reference(w, p, 0.7, axis)
        unmoved += bool(torch.allclose(w + prod * alpha / rank, w, rtol=1e-9, atol=0))  # ||W + s*B*A|| == ||W||
        for client, got in (("A1111", clients.a1111_dora(w, prod, p["dora_scale"], alpha / rank, 0.7)),
                            ("ComfyUI", clients.comfy_dora(w, prod, p["dora_scale"], alpha / rank, 0.7))):
            exact[client] += torch.allclose(got, want, rtol=1e-9, atol=1e-12)
    assert unmoved < len(modules) // 10
    assert exact == ({"A1111": 0, "ComfyUI": unmoved} if axis == 0 else {"A1111": len(modules), "ComfyUI": len(modules)})


def _file(tmp_path, name: str, parts: dict) -> str:
    path = str(tmp_path / f"{name}.safetensors")
    save_file({f"lora_unet_conv_in.{k}": v.contiguous() for k, v in parts.items()}, path)
    return path


def test_the_lora_tools_refuse_dora_and_full_files_by_operation(tmp_path, capsys):
    torch.manual_seed(0)
    dora = _file(tmp_path, "dora", {"lora_down.weight": torch.randn(2, 4, 3, 3), "lora_up.weight": torch.randn(32, 2, 1, 1),
                                    "alpha": torch.tensor(2.0), "dora_scale": torch.rand(32, 1, 1, 1)})
    full = _file(tmp_path, "full", {"diff": torch.randn(32, 4, 3, 3), "diff_b": torch.randn(32)})
    out = str(tmp_path / "out.safetensors")
    cases = [
        (resize_lora.main, ["--model", dora, "--save_to", out, "--new_rank", "1"], "a DoRA file: resizing is not done"),
        (merge_lora.main, ["--models", dora, full, "--save_to", out], "a DoRA file: merging into one LoRA is not done"),
        (merge_lora.main, ["--models", full, "--save_to", out], "a LyCORIS full file: merging into one LoRA is not"),
        (svd_merge_lora.main, ["--models", dora, "--save_to", out], "a DoRA file: rewriting its lora_down / lora_up"),
        (extract_lora_from_dylora.main, ["--model", dora, "--save_to", out, "--unit", "1"],
         "a DoRA file: cutting its rank is not done"),
    ]
    for main, argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and ("dora_scale sets the norm" in err or "whole weight differences" in err), err
        assert len(err.strip().splitlines()) == 1, err
    # a dora_scale that fits neither axis of the layer: one line naming the module
    bad = _file(tmp_path, "bad", {"lora_down.weight": torch.randn(2, 4, 3, 3), "lora_up.weight": torch.randn(32, 2, 1, 1),
                                  "alpha": torch.tensor(2.0), "dora_scale": torch.rand(4, 1, 1, 1)})
    assert merge_lora.main(["--sd_model", "tiny-sd15", "--models", bad, "--save_to", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith(f"error: {bad}: module lora_unet_conv_in: dora_scale (4, 1, 1, 1) fits "
                                           "neither the output rows"), err
    # check_lora_weights lists DoRA's magnitudes and full's differences as the module's tensors
    assert check_lora_weights.main([dora]) == 0 and check_lora_weights.main([full]) == 0
    listed = capsys.readouterr().out
    assert "adapter kinds: DoRA" in listed and "lora_unet_conv_in.dora_scale,(32-1-1-1)" in listed
    assert "adapter kinds: LyCORIS full" in listed and "lora_unet_conv_in.diff_b,(32,)," in listed
