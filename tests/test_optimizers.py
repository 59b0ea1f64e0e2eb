"""Every optimizer_type takes a step; bad optimizer_args are one clear error before loading;
a missing optional package is named; schedule-free optimizers save their eval iterate.

8-bit bitsandbytes optimizers run on the CPU (bitsandbytes supports it); the parameter has more
than ``min_8bit_size`` (4096) elements so that their state really is 8-bit.
"""
from __future__ import annotations

import re
import sys
import types

import pytest
import torch

from library.optim import _OPTIMIZERS, OptimizerError, build_optimizer, check_optimizer
from library.stepper import PlainStepper, make_stepper

OPTIONAL = {"lion": "lion_pytorch", "prodigy": "prodigyopt", "adamwschedulefree": "schedulefree",
            "radamschedulefree": "schedulefree"}


from tests.conftest import FakeAccelerator as _Acc  # noqa: E402


def _opts(name, **kw):
    base = dict(optimizer_type=name, optimizer_args={}, learning_rate=1.0 if name == "prodigy"
                else 1e-3, lr_scheduler="constant", lr_scheduler_num_cycles=1,
                lr_scheduler_power=1.0, max_grad_norm=1.0, fused_backward_pass=False,
                fused_optimizer_groups=None, gradient_accumulation_steps=1, mixed_precision="no")
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_every_optimizer_type_takes_a_step(name):
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name])
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 80))   # 5120 elements: 8-bit state for bitsandbytes
    x = torch.randn(16, 64)
    stepper = make_stepper(_Acc(), _opts(name), [{"params": [w]}], [w], warmup_steps=0,
                           total_steps=10)
    assert isinstance(stepper, PlainStepper)
    before = w.detach().clone()
    # RAdam's rectification makes its first steps zero: a few steps for every optimizer
    for _ in range(6):
        stepper.backward((x @ w).square().mean())
        stepper.step()
        assert w.grad is None
    assert float((w - before).abs().max()) > 0, name
    state = stepper.optimizer.state[w]
    assert state, name
    if name.endswith("8bit"):
        assert any(torch.is_tensor(v) and v.dtype == torch.uint8 for v in state.values())
    if "schedulefree" in name:
        assert stepper.optimizer.param_groups[0]["train_mode"] is True
        with stepper.eval_mode():
            assert stepper.optimizer.param_groups[0]["train_mode"] is False
            evaluated = w.detach().clone()
        assert stepper.optimizer.param_groups[0]["train_mode"] is True
        assert not torch.equal(evaluated, w)  # the eval iterate is another point


def test_sgdnesterov_defaults_to_momentum_0_9_and_accepts_another():
    w = [torch.nn.Parameter(torch.zeros(3))]
    assert build_optimizer("SGDNesterov", {}, w, 1e-2).param_groups[0]["momentum"] == 0.9
    assert build_optimizer("SGDNesterov", {"momentum": "0.5"}, w, 1e-2).param_groups[0]["momentum"] == 0.5


@pytest.mark.parametrize("name,args,message", [
    ("AdamW", {"weight_decy": "0.1"}, "optimizer_args: AdamW has no argument 'weight_decy'; valid:"),
    ("AdamW", {"betas": "oops"}, "optimizer_args for AdamW (given: betas='oops'): TypeError"),
    ("Adafactor", {"clip_treshold": "1.0"}, "has no argument 'clip_treshold'"),
    ("AdamW", {"lr": "-1.0"}, "Invalid learning rate"),
])
def test_bad_optimizer_args_are_clear_errors(name, args, message):
    with pytest.raises(OptimizerError, match=re.escape(message)):
        check_optimizer(name, args, probe=True)


def test_bad_optimizer_args_fail_before_loading(run_script, dataset, tmp_path, monkeypatch):
    from library import models

    monkeypatch.setattr(models, "load_model_bundle",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("weights loaded")))
    rc, out, err = run_script("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15",
                                             "--train_data_dir", dataset, "--output_dir",
                                             str(tmp_path), "--resolution", "64",
                                             "--max_train_steps", "1", "--optimizer_args",
                                             "betas=(0.9,)"])
    assert rc == 2 and "optimizer_args for AdamW" in err, err
    assert "weights loaded" not in err


def test_missing_optional_package_names_it_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lion_pytorch", None)  # import fails
    with pytest.raises(OptimizerError, match=r"pip install lion-pytorch or the optimizers extra"):
        check_optimizer("Lion", {})


def test_schedule_free_saves_its_eval_iterate(train, dataset, tmp_path, monkeypatch):
    """AdamWScheduleFree through train_lora: during the save the optimizer is in eval mode and
    the file holds the eval iterate; training continues in train mode."""
    pytest.importorskip("schedulefree")
    from library.methods import NetworkMethod
    from tests.conftest import read

    seen = []
    real_save = NetworkMethod.save

    def save(self, path, dtype, metadata):
        opt = self_run[0].stepper.optimizer
        opt = getattr(opt, "optimizer", opt)
        seen.append((opt.param_groups[0]["train_mode"],
                     {k: v.detach().clone() for k, v in self.network.state_dict().items()}))
        return real_save(self, path, dtype, metadata)

    self_run = []
    from library import trainer

    real_setup = trainer.Run.setup_method

    def setup(run_self):
        self_run.append(run_self)
        return real_setup(run_self)

    monkeypatch.setattr(NetworkMethod, "save", save)
    monkeypatch.setattr(trainer.Run, "setup_method", setup)
    rc, out, err, r = train("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15",
                                           "--train_data_dir", dataset, "--output_dir",
                                           str(tmp_path), "--resolution", "64",
                                           "--max_train_steps", "3", "--save_every_n_steps", "2",
                                           "--optimizer_type", "AdamWScheduleFree",
                                           "--learning_rate", "1e-3", "--network_dim", "4"])
    assert rc == 0, err
    assert [mode for mode, _ in seen] == [False, False]  # step 2 and the final save
    opt = getattr(r.stepper.optimizer, "optimizer", r.stepper.optimizer)
    assert opt.param_groups[0]["train_mode"] is True
    saved, _ = read(tmp_path / "last.safetensors")
    final_eval = seen[-1][1]
    now = r.method.network.state_dict()
    ups = [k for k in final_eval if k.endswith("lora_up.weight")]
    assert ups
    differs = 0
    for k in ups:
        skey = next(s for s in saved if s.endswith(k.replace(".", "_", k.count(".") - 2))
                    or s == k)
        assert torch.equal(saved[skey].float(), final_eval[k].float()), k
        differs += not torch.equal(now[k], final_eval[k])
    assert differs  # after the save the train iterate is back
