"""Every optimizer_type takes a step; bad optimizer_args are one clear error before loading;
a missing optional package is named; schedule-free optimizers save their eval iterate.

8-bit bitsandbytes optimizers run on the CPU (bitsandbytes supports it); the parameter has more
than ``min_8bit_size`` (4096) elements so that their state really is 8-bit.
"""
from __future__ import annotations

import math
import re
import sys

import pytest
import torch

from library.training.optim import _OPTIMIZERS, OptimizerError, build_optimizer, check_optimizer
from library.training.stepper import PlainStepper, make_stepper

OPTIONAL = {"lion": "lion_pytorch", "prodigy": "prodigyopt", **{
    n: "schedulefree" for n in _OPTIMIZERS if n.endswith("schedulefree")}, **{
    n: "dadaptation" for n in _OPTIMIZERS if n.startswith("dadapt")}}
STEP_SIZE_FREE = ("prodigy", "dadapt")  # lr is a multiplier of the estimated step size: 1.0


from tests.conftest import FakeAccelerator as _Acc  # noqa: E402
from tests.helpers import make_opts  # noqa: E402


def _opts(name, **kw):
    lr = 1.0 if name.startswith(STEP_SIZE_FREE) else 1e-3
    return make_opts(**{"optimizer_type": name, "learning_rate": lr, **kw})


@pytest.mark.parametrize("name", [*sorted(_OPTIMIZERS), "SGD", "rmsprop", "Adagrad", "NAdam",
                                  "bitsandbytes.optim.AdEMAMix8bit"])
def test_every_optimizer_type_takes_a_step(name):
    """sd-scripts' names (any case) and bare torch.optim class names, as its get_optimizer."""
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
    assert state or name == "SGD", name  # SGD without momentum keeps none
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
    from library.models import loading as models

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
    from library.training.methods import NetworkMethod
    from tests.conftest import read

    seen = []
    real_save = NetworkMethod.save

    def save(self, path, dtype, metadata):
        opt = self_run[0].parts.stepper.optimizer
        opt = getattr(opt, "optimizer", opt)
        seen.append((opt.param_groups[0]["train_mode"],
                     {k: v.detach().clone() for k, v in self.network.state_dict().items()}))
        return real_save(self, path, dtype, metadata)

    self_run = []
    from library.run import stages

    real_setup = stages.Run.setup_method

    def setup(run_self, loaded):
        self_run.append(run_self)
        return real_setup(run_self, loaded)

    monkeypatch.setattr(NetworkMethod, "save", save)
    monkeypatch.setattr(stages.Run, "setup_method", setup)
    rc, out, err, r = train("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15",
                                           "--train_data_dir", dataset, "--output_dir",
                                           str(tmp_path), "--resolution", "64",
                                           "--max_train_steps", "3", "--save_every_n_steps", "2",
                                           "--optimizer_type", "AdamWScheduleFree",
                                           "--learning_rate", "1e-3", "--network_dim", "4"])
    assert rc == 0, err
    assert [mode for mode, _ in seen] == [False, False]  # step 2 and the final save
    opt = getattr(r.parts.stepper.optimizer, "optimizer", r.parts.stepper.optimizer)
    assert opt.param_groups[0]["train_mode"] is True
    saved, _ = read(tmp_path / "last.safetensors")
    final_eval = seen[-1][1]
    now = r.parts.method.network.state_dict()
    ups = [k for k in final_eval if k.endswith("lora_up.weight")]
    assert ups
    differs = 0
    for k in ups:
        skey = next(s for s in saved if s.endswith(k.replace(".", "_", k.count(".") - 2))
                    or s == k)
        assert torch.equal(saved[skey].float(), final_eval[k].float()), k
        differs += not torch.equal(now[k], final_eval[k])
    assert differs  # after the save the train iterate is back


def test_names_resolve_to_sd_scripts_classes():
    from library.training.optim import resolve_optimizer_class

    expect = {"DAdaptation": "DAdaptAdamPreprint", "dadaptadam": "DAdaptAdam",
              "DAdaptAdanIP": "DAdaptAdanIP", "PAGEDADAMW32BIT": "PagedAdamW32bit",
              "SGDScheduleFree": "SGDScheduleFree", "rmsprop": "RMSprop", "RAdam": "RAdam"}
    for name, cls in expect.items():
        if name.lower().startswith("dadapt"):
            pytest.importorskip("dadaptation")
        assert resolve_optimizer_class(name)[0].__name__ == cls, name
    for name, why in (("LBFGS", "needs a closure"), ("SparseAdam", "sparse gradients")):
        with pytest.raises(OptimizerError, match=why):
            check_optimizer(name, {})


def test_step_size_free_optimizers_need_one_learning_rate(caplog):
    """DAdaptAdam (like Prodigy) computes one step size from the first group's lr and raises in
    its first step on another nonzero lr: refused when the optimizer is built, one line."""
    pytest.importorskip("dadaptation")
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(OptimizerError, match=r"learning rates 0.5, 1, and DAdaptAdam estimates one"):
        build_optimizer("DAdaptAdam", {}, [{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.5}],
                        1.0)
    build_optimizer("DAdaptAdam", {}, [{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.0}], 1.0)
    build_optimizer("DAdaptAdan", {}, [{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.5}], 1.0)
    assert "learning rate" not in caplog.text
    build_optimizer("DAdaptSGD", {}, [a], 1e-4)
    assert "DAdaptSGD: learning rate 0.0001 is low" in caplog.text  # sd-scripts' warning


def test_paged_optimizers_on_the_cpu_say_so_and_step(caplog):
    w = torch.nn.Parameter(torch.randn(64, 80))
    opt = build_optimizer("PagedAdamW", {}, [w], 1e-3)
    assert "PagedAdamW on the CPU: nothing to page" in caplog.text
    w.grad = torch.ones_like(w)
    opt.step()
    assert opt.state[w]["state1"].device.type == "cpu"


def test_adafactor_relative_step_as_sd_scripts_decides_it():
    from library.training.optim import adafactor_relative_step

    assert adafactor_relative_step({}) is True                        # sd-scripts' default
    assert adafactor_relative_step({"relative_step": False}) is False
    assert adafactor_relative_step({"warmup_init": True, "relative_step": False}) is True
    assert adafactor_relative_step({"relative_step": True, "scale_parameter": False}) is True
    w = torch.nn.Parameter(torch.zeros(4, 4))
    opt = build_optimizer("Adafactor", {"warmup_init": "True"}, [{"params": [w], "lr": 1e-3}],
                          1e-3)
    g = opt.param_groups[0]
    assert g["relative_step"] and g["warmup_init"] and g["lr"] is None


@pytest.mark.parametrize("name", ["DAdaptAdam", "DAdaptLion", "SGDScheduleFree"])
def test_global_state_optimizers_are_refused_where_they_cannot_work(name):
    """fused steps, full_bf16 and deepspeed need optimizers without global state."""
    pytest.importorskip("dadaptation" if name.startswith("DAdapt") else "schedulefree")
    from library.distributed import deepspeed_zero as zero
    from library.training.fused_optim import FusedOptionError
    from library.training.optim import resolve_optimizer_class
    from library.training.stepper import check_stepper_options

    for extra, message in ((dict(fused_backward_pass=True), "fused_backward_pass cannot be used"),
                           (dict(fused_optimizer_groups=2), "fused_optimizer_groups cannot be used"),
                           (dict(full_bf16=True, mixed_precision="bf16"), "full_bf16 cannot be used")):
        with pytest.raises(FusedOptionError, match=message + f".*optimizer_type {name}"):
            check_stepper_options(_opts(name, **extra))
    assert zero.elementwise_reason(resolve_optimizer_class(name)[0])


E2E = ["--pretrained_model_name_or_path", "tiny-sd15", "--resolution", "64", "--network_dim", "4",
       "--max_train_steps", "2", "--seed", "1"]


@pytest.mark.parametrize("extra", [
    ["--optimizer_type", "DAdaptAdam", "--learning_rate", "1.0", "--lr_scheduler_type",
     "torch.optim.lr_scheduler.StepLR", "--lr_scheduler_args", "step_size=1", "gamma=0.5"],
    ["--optimizer_type", "sgdschedulefree", "--learning_rate", "0.1"],
    ["--optimizer_type", "PagedAdamW32bit", "--learning_rate", "1e-3", "--lr_scheduler",
     "cosine_with_min_lr", "--lr_scheduler_min_lr_ratio", "0.5"],
], ids=["dadaptadam-steplr", "sgdschedulefree", "pagedadamw32bit-cosine-min-lr"])
def test_new_names_train_end_to_end(train, dataset, tmp_path, extra):
    if "DAdaptAdam" in extra:
        pytest.importorskip("dadaptation")
    rc, out, err, r = train("train_lora", [*E2E, "--train_data_dir", dataset, "--output_dir",
                                           str(tmp_path), *extra])
    assert rc == 0, err
    assert r.progress.global_step == 2 and (tmp_path / "last.safetensors").exists()
    ups = [v for k, v in r.parts.method.network.state_dict().items() if k.endswith("lora_up.weight")]
    assert any(float(v.abs().max()) > 0 for v in ups)  # trained (up weights start at zero)
    if "StepLR" in extra:
        assert r.progress.lr_log[:2] == [1.0, 0.5]  # once per optimizer step
    if "cosine_with_min_lr" in extra:
        assert r.progress.lr_log == pytest.approx([1e-3, 0.5e-3 + 0.5e-3 * 0.5 * (1 + math.cos(math.pi / 2))])


def test_scheduler_mistake_fails_before_loading(run_script, dataset, tmp_path, no_weight_loading):
    rc, out, err = run_script("train_lora", [*E2E, "--train_data_dir", dataset, "--output_dir",
                                             str(tmp_path), "--lr_scheduler", "cosine_with_min_lr"])
    assert rc == 2 and err.strip().splitlines()[-1] == (
        "error: lr_scheduler cosine_with_min_lr needs lr_scheduler_min_lr_ratio (the lowest "
        "learning rate as a fraction of the initial one)"), err


def test_adafactor_schedule_survives_resume(train, dataset, tmp_path):
    """Adafactor with relative_step and lr_scheduler adafactor (sd-scripts' Adafactor setup):
    2 steps, a state, 2 more on resume = 4 steps in one go, bit for bit, learning rates too."""
    args = [*E2E[:-4], "--seed", "1", "--train_data_dir", dataset, "--optimizer_type",
            "Adafactor", "--lr_scheduler", "adafactor", "--learning_rate", "1e-3"]
    rc, _, err, whole = train("train_lora", [*args, "--output_dir", str(tmp_path / "a"),
                                             "--max_train_steps", "4"])
    assert rc == 0, err
    parts = ["--output_dir", str(tmp_path / "b"), "--save_state_on_train_end"]
    rc, _, err, _ = train("train_lora", [*args, *parts, "--max_train_steps", "2"])
    assert rc == 0, err
    rc, _, err, r = train("train_lora", [*args, *parts, "--max_train_steps", "4", "--resume",
                                         "latest"])
    assert rc == 0, err
    from transformers.optimization import AdafactorSchedule

    assert isinstance(r.parts.stepper.scheduler, AdafactorSchedule)
    # before the first step the scheduler reports initial_lr (learning_rate), then Adafactor's
    # own step size 1e-2 x RMS of the first weight (transformers' formula, tested in test_optim)
    assert r.progress.lr_log == whole.progress.lr_log and whole.progress.lr_log[0] == 1e-3
    assert all(0 < x != 1e-3 for x in whole.progress.lr_log[1:])
    a, b = whole.parts.method.network.state_dict(), r.parts.method.network.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra", [{"fused_backward_pass": True}, {"fused_optimizer_groups": 2}])
def test_fused_adafactor_relative_step_equals_plain_and_reports_its_step_size(extra):
    """The fused steppers free each gradient after its step: the adafactor scheduler still
    reports Adafactor's step size (from the optimizer state), the same as the plain run."""
    def run(**kw):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
        params = list(net.parameters())
        opts = _opts("Adafactor", optimizer_args={"relative_step": "True"},
                     lr_scheduler="adafactor", **kw)
        stepper = make_stepper(_Acc(), opts, [{"params": params}], params, warmup_steps=0,
                               total_steps=3)
        g = torch.Generator().manual_seed(1)
        lrs = []
        for _ in range(3):
            x = torch.randn(4, 6, generator=g)
            stepper.backward(net(x).square().mean())
            lrs.append(stepper.current_lr())
            stepper.step()
        return net, lrs + [stepper.current_lr()]

    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (plain, plain_lrs), (fused, fused_lrs) = run(), run(**extra)
    # the fused Adafactor step is ours, not optimizer.step(): torch's scheduler must not think
    # the schedule ran ahead of the optimizer
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert plain_lrs[0] == 1e-3 and plain_lrs[1] != 1e-3  # initial_lr, then the relative step
    assert fused_lrs == pytest.approx(plain_lrs, rel=1e-6)
    for a, b in zip(plain.parameters(), fused.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_resume_refuses_an_optimizer_built_with_other_settings():
    """A state's optimizer must have been built with this run's constructor settings: load_state_dict
    would otherwise quietly replace them (an Adafactor state of relative_step=False, from before the
    default became sd-scripts' True, resumed into a relative-step run)."""
    import torch
    from transformers.optimization import Adafactor

    from library.training.stepper import check_same_settings

    def adafactor(**kw):
        p = torch.nn.Parameter(torch.ones(4, 4))
        opt = Adafactor([p], **kw)
        p.grad = torch.full_like(p, 0.1)
        opt.step()
        return opt

    old = adafactor(lr=1e-3, relative_step=False, scale_parameter=False, warmup_init=False).state_dict()
    with pytest.raises(ValueError, match=r"Adafactor relative_step is True in this run but False"):
        check_same_settings(adafactor(lr=None), old)
    check_same_settings(adafactor(lr=1e-3, relative_step=False, scale_parameter=False,
                                  warmup_init=False), old)  # same settings: fine
    # dynamic group entries (Prodigy's d estimate) and the lr move during training: not settings
    from prodigyopt import Prodigy

    p = torch.nn.Parameter(torch.ones(3))
    opt = Prodigy([p], lr=1.0)
    saved = opt.state_dict()
    for _ in range(2):
        p.grad = torch.ones(3)
        opt.step()
    assert opt.param_groups[0]["d"] != saved["param_groups"][0]["d"]
    check_same_settings(opt, saved)
