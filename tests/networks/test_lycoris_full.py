"""LyCORIS Native Fine-Tuning (``lycoris.kohya`` with ``algo=full``, networks/lycoris_full.py):
trained on the tiny models, resumed bit for bit, its ``.diff`` / ``.diff_b`` file against the
trained layers and against the base model + diff in float64, in A1111's and ComfyUI's key tables
(tests/client_key_tables.py), merged by merge_lora.py."""
from __future__ import annotations

import math

import pytest
import torch

from tests import client_key_tables as clients
from tests.conftest import read

pytest.importorskip("lycoris")

from library.models import sd_checkpoint  # noqa: E402
from library.models.loading import load_model_bundle  # noqa: E402
from networks import lora_names, merge_lora  # noqa: E402

MODEL = {"sd15": "tiny-sd15", "sd2": "tiny-sd2", "sdxl": "tiny-sdxl"}
FAMILY = {"sd15": "sd1", "sd2": "sd2", "sdxl": "sdxl"}


def args(arch, data, out, steps, *extra):
    return ["--pretrained_model_name_or_path", MODEL[arch], "--train_data_dir", data, "--output_dir", out,
            "--resolution", "64", "--max_train_steps", str(steps), "--learning_rate", "1e-3", "--seed", "3",
            "--network_module", "lycoris.kohya", "--network_args", "algo=full", "preset=full", *extra]


def _modules(sd: dict) -> dict[str, set[str]]:
    return clients.modules_of_file(sd)


def test_full_module_forward_is_the_layer_with_its_trained_weight_at_the_multiplier():
    """networks/lycoris_full.py FullModule on a Linear and a 3x3 Conv2d, in float64: the layer's
    output with W0 + m * (W - W0) and b0 + m * (b - b0) (m = 1: the trained weight itself; m = 0,
    and a module dropped by module_dropout: the layer as it was); its state dict is the change."""
    import torch.nn.functional as F

    from networks.lycoris_full import FullModule

    torch.manual_seed(0)
    for layer, x, op in ((torch.nn.Linear(6, 5), torch.randn(3, 6, dtype=torch.float64), F.linear),
                         (torch.nn.Conv2d(3, 4, 3, padding=1), torch.randn(2, 3, 5, 5, dtype=torch.float64),
                          lambda x, w, b: F.conv2d(x, w, b, padding=1))):
        layer = layer.double()
        w0, b0 = layer.weight.detach().clone(), layer.bias.detach().clone()
        m = FullModule("lora_unet_x", layer, multiplier=1.0, module_dropout=0.0)
        m.apply_to()
        with torch.no_grad():
            m.weight.add_(torch.randn_like(w0))
            m.bias.add_(torch.randn_like(b0))
        w, b = m.weight.detach(), m.bias.detach()
        for mult in (1.0, 0.5, 0.0):
            m.multiplier = mult
            assert torch.allclose(layer(x), op(x, w0 + mult * (w - w0), b0 + mult * (b - b0)), rtol=1e-12, atol=1e-12)
        m.multiplier, m.module_dropout = 1.0, 1.0 - 1e-9  # dropped: the base layer
        m.train()
        assert torch.allclose(layer(x), op(x, w0, b0), rtol=1e-12, atol=1e-12)
        sd = m.state_dict()
        assert torch.allclose(sd["diff"].double(), w - w0) and torch.allclose(sd["diff_b"].double(), b - b0)


def test_full_trains_resumes_exactly_and_its_file_is_the_trained_layers(dataset, tmp_path, train):
    rc, _, err, run = train("train_lora", args("sd15", dataset, str(tmp_path / "a"), 4))
    assert rc == 0, err[-2000:]
    sd, meta = read(tmp_path / "a" / "last.safetensors")
    assert meta["ss_network_module"] == "lycoris.kohya" and '"algo": "full"' in meta["ss_network_args"]
    assert {k.partition(".")[2] for k in sd} == {"diff", "diff_b"}

    # the layers: those lycoris.kohya's own walk picks with the same preset (its LoCon with convs)
    from lycoris import kohya as lycoris_kohya

    base = load_model_bundle("tiny-sd15")
    tes = list(base.text_encoders)
    walk = lycoris_kohya.create_network(1.0, 4, 1, None, tes[0], base.unet, algo="lora", conv_dim=4, preset="full")
    renames = lora_names.plain_to_kohya_names(tes, base.unet)
    assert set(_modules(sd)) == {renames.get(m.lora_name, m.lora_name) for m in walk.text_encoder_loras + walk.unet_loras}

    # every trained layer == its base weight + the file's diff (float64; the diff is a float32
    # subtraction, so within half a float32 ulp of the diff)
    layers = lora_names.kohya_layers(tes, base.unet)
    net = run.parts.method.network
    trained = {renames.get(m.lora_name, m.lora_name): m for m in net.text_encoder_loras + net.unet_loras}
    assert set(trained) == set(_modules(sd))
    moved = 0
    for name, m in trained.items():
        for part, got, w0 in (("diff", m.weight, layers[name].weight), ("diff_b", m.bias, layers[name].bias)):
            if f"{name}.{part}" not in sd:  # a layer without a bias
                assert got is None and w0 is None
                continue
            diff = sd[f"{name}.{part}"].double()
            want = w0.double() + diff
            assert torch.allclose(got.double(), want, rtol=0, atol=float(diff.abs().max()) * 2 ** -23 + 1e-12), name
            moved += bool(diff.abs().max() > 0)
    assert moved > len(trained)  # most weights and biases moved in 4 AdamW steps

    # 2 steps, a state, resumed to 4: the same file bit for bit
    rc, _, err, _ = train("train_lora", args("sd15", dataset, str(tmp_path / "b"), 2, "--save_state"))
    assert rc == 0, err[-2000:]
    rc, _, err, _ = train("train_lora", args("sd15", dataset, str(tmp_path / "b"), 4, "--resume",
                                             str(tmp_path / "b" / "last-state")))
    assert rc == 0, err[-2000:]
    again, _ = read(tmp_path / "b" / "last.safetensors")
    assert set(again) == set(sd) and all(torch.equal(again[k], sd[k]) for k in sd)

    # merge_lora.py --sd_model at ratio 0.5: the single file == base + 0.5 * diff, applied by A1111's
    # names to the original-layout weights (float64 sum, rounded once to float32)
    out = tmp_path / "merged.safetensors"
    assert merge_lora.main(["--sd_model", "tiny-sd15", "--models", str(tmp_path / "a" / "last.safetensors"),
                            "--ratios", "0.5", "--save_to", str(out)]) == 0
    merged, _ = read(out)
    original = sd_checkpoint.original_state_dict(base.components(), "sd1")
    keys = clients.a1111_weight_keys(original)
    want = {k: v.double() for k, v in original.items()}
    for name in _modules(sd):
        wkey = keys[clients.a1111_target(name, keys)]
        want[wkey] = want[wkey] + 0.5 * sd[f"{name}.diff"].double().reshape(want[wkey].shape)
        if f"{name}.diff_b" in sd:
            bkey = wkey[:-len("weight")] + "bias"
            want[bkey] = want[bkey] + 0.5 * sd[f"{name}.diff_b"].double()
    assert set(merged) >= set(want)
    for k, w in want.items():
        assert torch.allclose(merged[k].double(), w, rtol=2 ** -24, atol=0), k


@pytest.mark.parametrize("arch", ["sd15", "sd2", "sdxl"])
def test_full_file_resolves_in_a1111_and_comfyui(arch, dataset, tmp_path, train):
    rc, _, err, _ = train("train_lora", args(arch, dataset, str(tmp_path / "o"), 1))
    assert rc == 0, err[-2000:]
    sd, _ = read(tmp_path / "o" / "last.safetensors")
    modules = _modules(sd)
    c = load_model_bundle(MODEL[arch]).components()
    shapes = clients.a1111_module_shapes(c, FAMILY[arch])
    comfy = clients.comfy_names(c, FAMILY[arch])
    for name, parts in modules.items():
        assert clients.A1111_TYPES["Full"](parts) and clients.COMFY_TYPES["Full"](parts)
        assert parts <= clients.A1111_READS and parts <= clients.COMFY_READS
        target = clients.a1111_target(name, shapes)
        assert target is not None, name
        shape = shapes[target]
        if target.endswith("_attn") and len(shape) == 2 and shape[0] == 3 * shape[1]:  # SD2's MHA: q, k or v
            shape = (shape[1], shape[1])
        rows, numel = clients.client_delta({p: sd[f"{name}.{p}"] for p in parts})
        assert (rows, numel) == (shape[0], math.prod(shape)), (name, target)
        assert "diff_b" not in parts or tuple(sd[f"{name}.diff_b"].shape) == (shape[0],)
        assert name in comfy, name
    assert any(n.startswith("lora_te") for n in modules) and any(n.startswith("lora_unet") for n in modules)


def test_full_refusals_are_one_line(dataset, tmp_path, run_script):
    for extra, message in ((["rank_dropout=0.1"], "network_args rank_dropout with algo=full"),
                           (["--network_dropout", "0.1"], "network_dropout with algo=full"),
                           (["--dim_from_weights", "--network_weights", __file__], "dim_from_weights with algo=full")):
        rc, _, err = run_script("train_lora", args("sd15", dataset, str(tmp_path / "o"), 1) + extra)
        assert rc == 2 and message in err, err[-1500:]
        assert len([ln for ln in err.splitlines() if ln.startswith("error")]) == 1


def test_full_on_flux_resolves_in_comfyuis_table(dataset, tmp_path, train):
    """lycoris.kohya algo=full on FLUX.1 (the GUI's Native Fine-Tuning with its Flux1 checkbox): the
    names LyCORIS makes there, each diff of the shape of the weight ComfyUI's key map patches."""
    from library.models.families.flux import tiny_flux

    rc, _, err, _ = train("train_lora", ["--pretrained_model_name_or_path", "tiny-flux", "--train_data_dir", dataset,
                                         "--output_dir", str(tmp_path / "o"), "--resolution", "64",
                                         "--max_train_steps", "1", "--network_module", "lycoris.kohya",
                                         "--network_args", "algo=full"])
    assert rc == 0, err[-2000:]
    sd, _ = read(tmp_path / "o" / "last.safetensors")
    parts = tiny_flux.build_tiny_flux("dev")
    table = clients.comfy_dit_shapes(parts["transformer"], clip_l=parts["clip_l"])
    modules = _modules(sd)
    assert any(n.startswith("lora_unet_double_blocks_") for n in modules)
    for name, p in modules.items():
        assert p <= clients.COMFY_READS and tuple(sd[f"{name}.diff"].shape) == table[name], name
