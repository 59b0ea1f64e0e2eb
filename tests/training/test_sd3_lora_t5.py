"""train_lora on SD3 with T5-XXL (sd-scripts' lora_sd3 network_args train_t5xxl): a lora_te3_ module
on every Linear of T5's attention and gated MLP beside CLIP-L's (lora_te1_) and CLIP-G's
(lora_te2_), text_encoder_lr read as sd-scripts' lora_sd3 reads it ([CLIP-L, CLIP-G], T5 at
CLIP-G's rate), every name in ComfyUI's key map, and T5 patched from the file as the clients patch
it (W + up @ down * alpha / rank, float64) computing what the trained run's T5 computes."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from library.models.families.sd3 import sd3_builtins
from networks import lora_sd3
from networks.lora import LoRAError
from tests.client_key_tables import comfy_dit_shapes
from tests.training.test_flow_lora import _assert_saved_is_trained, lora_args

T5_LINEARS = ("q.weight", "k.weight", "v.weight", "o.weight", "wi_0.weight", "wi_1.weight", "wo.weight")


def test_sd3_t5_lora_trains_at_clip_gs_rate_and_the_clients_patch_is_the_trained_t5(dataset, tmp_path, train):
    out = tmp_path / "out"
    rc, _, err, run = train("train_lora", lora_args("tiny-sd3", "networks.lora_sd3", dataset, str(out),
                                                    "--text_encoder_lr", "1e-2", "5e-3",
                                                    "--network_args", "train_t5xxl=True"))
    assert rc == 0, err
    path = str(out / "last.safetensors")
    _assert_saved_is_trained(path, run.parts.method.network)
    groups = dict(zip(run.parts.method.group_names, (g["lr"] for g in run.parts.method.param_groups)))
    assert groups == {"textencoder 1": 1e-2, "textencoder 2": 5e-3, "textencoder 3": 5e-3, "unet": 1e-2}

    sd = load_file(path)
    base = sd3_builtins.build_builtin("tiny-sd3")
    t5_model = base["t5xxl"]
    te3 = {k.split(".")[0] for k in sd if k.startswith("lora_te3_")}
    assert te3 == {"lora_te3_" + k[:-len(".weight")].replace(".", "_") for k in t5_model.state_dict()
                   if ".layer." in k and k.endswith(T5_LINEARS)}
    table = comfy_dit_shapes(base["mmdit"], clip_l=base["clip_l"], clip_g=base["clip_g"], t5=t5_model)
    for name in {k.split(".")[0] for k in sd}:
        assert table[name] == (sd[name + ".lora_up.weight"].shape[0], sd[name + ".lora_down.weight"].shape[1]), name

    patched = t5_model.double()
    modules = {"lora_te3_" + n.replace(".", "_"): m for n, m in patched.named_modules() if n}
    with torch.no_grad():
        for name in te3:
            d, u, a = (sd[f"{name}.{p}"].double() for p in ("lora_down.weight", "lora_up.weight", "alpha"))
            modules[name].weight += u @ d * (float(a) / d.shape[0])
    ids = torch.randint(1, t5_model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    trained = run.parts.bundle.text_encoders[2].eval()
    with torch.no_grad():
        got = trained(ids).last_hidden_state.double()
        want = patched(ids).last_hidden_state
        before = sd3_builtins.build_builtin("tiny-sd3")["t5xxl"].double()(ids).last_hidden_state
    change = float((want - before).norm())
    assert change > 1e-4 * float(want.norm())  # the T5 LoRA changed the output
    assert float((got - want).norm()) < 1e-3 * change  # float32 against float64: the same model


@pytest.mark.parametrize("text_encoder_lr, expected", [
    (None, [1.0, 1.0, 1.0]), (0.5, [0.5, 0.5, 0.5]), ([0.5], [0.5, 0.5, 0.5]),
    ([0.5, 0.25], [0.5, 0.25, 0.25]), ([0.5, 0.25, 0.125], [0.5, 0.25, 0.125]),
])
def test_text_encoder_lr_as_sd_scripts_lora_sd3_reads_it(text_encoder_lr, expected):
    """sd-scripts' prepare_optimizer_params_with_multiple_te_lrs: one value for all three, two
    values [CLIP-L, CLIP-G] with T5 at the second, or three."""
    parts = sd3_builtins.build_builtin("tiny-sd3")
    net = lora_sd3.create_network(1.0, 2, 2, None, [parts["clip_l"], parts["clip_g"], parts["t5xxl"]],
                                  parts["mmdit"], train_t5xxl="True")
    groups, names = net.prepare_optimizer_params_with_multiple_te_lrs(text_encoder_lr, 2.0, 1.0)
    lrs = dict(zip(names, (g["lr"] for g in groups)))
    assert lrs == {"textencoder 1": expected[0], "textencoder 2": expected[1], "textencoder 3": expected[2],
                   "unet": 2.0}


def test_train_t5xxl_without_a_t5_is_one_line():
    parts = sd3_builtins.build_builtin("tiny-sd3")
    with pytest.raises(LoRAError, match="train_t5xxl for networks.lora_sd3: this SD3 model has no T5-XXL"):
        lora_sd3.create_network(1.0, 2, 2, None, [parts["clip_l"], parts["clip_g"]], parts["mmdit"],
                                train_t5xxl="True")
