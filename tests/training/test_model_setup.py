"""One set-up path (issue 38 item 3): the memory estimate sets the model up with the trainer's
own function (library/training/model_setup.py ``set_up_method``), on fake tensors, and what it
gets is what the trainer gets on the real model.

The estimate of a fp8_base LoRA run in bf16 (fp8 weights where eligible, the other frozen
tensors bf16, the network float32) is made while ``set_up_method`` is watched; the fake model it
set up is compared, parameter by parameter (name, dtype, shape, trained or not) and group by group
(parameter names and learning rates), with the real tiny model set up by the trainer's placer
(library/run/stages.py ``_DevicePlacer``) on the CPU.
"""
from __future__ import annotations

import torch

from library.config.parse import parse_args
from library.models import loading
from library.run import stages
from library.training import memory_estimate, model_setup
from library.training.methods import make_method


def _described(bundle, method, groups) -> tuple[dict, list]:
    named = {}
    roots = [("unet", bundle.unet), *((f"te{i}", te) for i, te in enumerate(bundle.text_encoders))]
    if method.network is not None:
        roots.append(("network", method.network))
    name_of = {}
    for root, module in roots:
        for n, p in module.named_parameters():
            named[f"{root}.{n}"] = (p.dtype, tuple(p.shape), p.requires_grad)
            name_of[id(p)] = f"{root}.{n}"
    described = [(sorted(name_of[id(p)] for p in g["params"]), g.get("lr")) for g in groups]
    return named, described


def test_the_estimate_sets_the_model_up_as_the_trainer_does(tmp_path, monkeypatch):
    opts = parse_args("train_lora", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", str(tmp_path),
        "--output_dir", str(tmp_path / "out"), "--resolution", "64", "--max_train_steps", "1",
        "--network_dim", "4", "--mixed_precision", "bf16", "--fp8_base", "--unet_lr", "1e-3",
        "--text_encoder_lr", "5e-4", "--dry_run"])
    seen = []
    real = model_setup.set_up_method

    def watched(opts_, method_name, method, bundle, placer):
        made = real(opts_, method_name, method, bundle, placer)
        seen.append((bundle, method, made, placer))
        return made

    monkeypatch.setattr(model_setup, "set_up_method", watched)
    memory_estimate.estimate(opts, "lora")
    (fake_bundle, fake_method, fake_made, placer), = seen
    assert isinstance(placer, memory_estimate._FakePlacer)
    fake = _described(fake_bundle, fake_method, fake_made.groups)

    b = loading.load_from_options(opts)
    torch.manual_seed(opts.seed)
    method = make_method("lora", opts, b)
    made = real(opts, "lora", method, b, stages._DevicePlacer(opts, torch.device("cpu")))
    ours = _described(b, method, made.groups)
    assert fake == ours
    dtypes = {d for d, _, _ in ours[0].values()}
    assert {torch.float8_e4m3fn, torch.bfloat16, torch.float32} <= dtypes  # the three kinds placed
    assert fake_made.placement == made.placement
