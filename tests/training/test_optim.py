"""Optimizer and scheduler construction: names, argument checking, one LR value per step.

Every lr_scheduler's curve is compared at every step with an independent reference: after the
warmup with the schedule functions of transformers / diffusers, called with the arguments
sd-scripts' get_scheduler_fix passes them (num_cycles / 2 for the min-lr cosines); during the
warmup with the hand formula (step + 1) / (warmup + 1) (the toolkit's warmup: never a step at
lr 0, where transformers starts at 0).
"""
import math

import pytest
import torch

from library.training.optim import (OptimizerError, ScheduleSpec, build_optimizer, build_scheduler,
                           check_scheduler, schedule_spec)
from tests.helpers import make_opts


def params():
    return [torch.nn.Parameter(torch.zeros(3))]


def curve(sch, opt, steps):
    out = []
    for _ in range(steps):
        out.append(sch.get_last_lr()[0])
        opt.step()
        sch.step()
    return out


def lrs(name, total=10, warmup=0, **kw):
    opt = torch.optim.SGD(params(), lr=1.0)
    return curve(build_scheduler(ScheduleSpec(name, warmup, total, **kw), opt), opt, total)


def reference(make, total):
    opt = torch.optim.SGD(params(), lr=1.0)
    return curve(make(opt), opt, total)


def warm(total, w):
    return [(s + 1) / (w + 1) for s in range(w)]


def test_constant_and_warmup():
    assert lrs("constant") == [1.0] * 10
    w = lrs("constant_with_warmup", warmup=4)
    assert w[:4] == [0.2, 0.4, 0.6, 0.8] and w[4:] == [1.0] * 6


def test_linear_and_cosine_decay_to_zero_over_the_run():
    lin = lrs("linear", total=10, warmup=0)
    assert lin[0] == 1.0 and lin[5] == pytest.approx(0.5) and lin[-1] == pytest.approx(0.1)
    cos = lrs("cosine", total=10)
    assert cos[5] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    poly = lrs("polynomial", total=10, power=2.0)
    assert poly[5] == pytest.approx(0.25)


def test_cosine_with_restarts_restarts():
    r = lrs("cosine_with_restarts", total=10, num_cycles=2)
    assert r[0] == 1.0 and r[5] == pytest.approx(1.0)


T, W, D = 20, 3, 6  # total, warmup, decay steps


@pytest.mark.parametrize("name,kw,ref", [
    ("linear", {}, lambda f, o: f(o, W, T)),
    ("cosine", {}, lambda f, o: f(o, W, T)),
    ("cosine_with_restarts", {"num_cycles": 3}, lambda f, o: f(o, W, T, num_cycles=3)),
    ("polynomial", {"power": 2.0}, lambda f, o: f(o, W, T, lr_end=0.0, power=2.0)),
    ("constant_with_warmup", {}, lambda f, o: f(o, W)),
    ("cosine_with_min_lr", {"min_lr_ratio": 0.1}, lambda f, o: f(o, W, T, num_cycles=0.5,
                                                                 min_lr_rate=0.1)),
    ("cosine_with_min_lr", {"min_lr_ratio": 0.2, "num_cycles": 3},
     lambda f, o: f(o, W, T, num_cycles=1.5, min_lr_rate=0.2)),
    ("inverse_sqrt", {}, lambda f, o: f(o, W)),
    ("inverse_sqrt", {"timescale": 7}, lambda f, o: f(o, W, timescale=7)),
    ("warmup_stable_decay", {"decay_steps": D, "min_lr_ratio": 0.1},
     lambda f, o: f(o, num_warmup_steps=W, num_stable_steps=T - W - D, num_decay_steps=D,
                    num_cycles=0.5, min_lr_ratio=0.1)),
    ("warmup_stable_decay", {"decay_steps": D, "num_cycles": 2},
     lambda f, o: f(o, num_warmup_steps=W, num_stable_steps=T - W - D, num_decay_steps=D,
                    num_cycles=1.0, min_lr_ratio=0.0)),
])
def test_curves_equal_transformers_after_warmup_and_the_hand_warmup(name, kw, ref):
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, SchedulerType

    fn = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]
    ours = lrs(name, total=T, warmup=W, **kw)
    theirs = reference(lambda o: ref(fn, o), T)
    assert ours[:W] == pytest.approx(warm(T, W), rel=1e-12)
    assert ours[W:] == pytest.approx(theirs[W:], rel=1e-12, abs=1e-15)
    assert len(set(ours)) > 2  # a real curve, not a constant


def test_inverse_sqrt_without_warmup_uses_timescale_10000():
    from transformers.optimization import get_inverse_sqrt_schedule

    assert lrs("inverse_sqrt", total=T) == pytest.approx(
        reference(lambda o: get_inverse_sqrt_schedule(o, 0), T), rel=1e-12)


def test_piecewise_constant_equals_diffusers():
    from diffusers.optimization import get_piecewise_constant_schedule

    rules = "1:4,0.5:9,0.25:15,0.1"
    ours = lrs("piecewise_constant", total=T, scheduler_args={"step_rules": rules})
    assert ours == reference(lambda o: get_piecewise_constant_schedule(o, rules), T)
    assert ours[3:5] == [1.0, 0.5] and ours[-1] == 0.1


def _opts(**kw):
    return make_opts(**{"learning_rate": 1.0, **kw})


def test_lr_decay_steps_as_a_fraction_of_all_steps():
    spec = schedule_spec(_opts(lr_scheduler="warmup_stable_decay", lr_decay_steps=0.3),
                         warmup_steps=2, total_steps=T)
    assert spec.decay_steps == 6
    assert schedule_spec(_opts(lr_decay_steps=4), warmup_steps=0, total_steps=T).decay_steps == 4
    out = lrs("warmup_stable_decay", total=T, warmup=2, decay_steps=6)
    assert out[2:14] == [1.0] * 12 and out[14] == 1.0 and out[15] < 1.0 and out[-1] > 0


def test_lr_scheduler_type_by_dotted_path_and_by_torch_name():
    args = {"step_size": "3", "gamma": "0.5"}
    for path in ("torch.optim.lr_scheduler.StepLR", "StepLR"):
        spec = schedule_spec(_opts(lr_scheduler_type=path, lr_scheduler_args=args),
                             warmup_steps=0, total_steps=8)
        opt = torch.optim.SGD(params(), lr=1.0)
        sch = build_scheduler(spec, opt)
        assert isinstance(sch, torch.optim.lr_scheduler.StepLR)
        assert curve(sch, opt, 8) == [1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25]


def test_adafactor_schedule_reports_adafactors_relative_step():
    """Adafactor's default relative_step=True; the reported lr is transformers'
    formula min(1e-2, 1/sqrt(t)) x max(eps2, RMS(weights before step t)) (scale_parameter)."""
    from transformers.optimization import Adafactor, AdafactorSchedule

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 6))
    opt = build_optimizer("Adafactor", {}, [{"params": [w], "lr": 1e-3}], 1e-3)
    assert isinstance(opt, Adafactor) and opt.param_groups[0]["relative_step"] is True
    assert opt.param_groups[0]["lr"] is None
    sch = build_scheduler(ScheduleSpec("adafactor", 0, 5, initial_lr=1e-3), opt)
    assert isinstance(sch, AdafactorSchedule)
    assert sch.get_last_lr() == [1e-3]  # sd-scripts' initial_lr = learning_rate
    for t in range(1, 5):
        rms = float(w.detach().double().pow(2).mean().sqrt())
        w.grad = torch.randn_like(w)
        opt.step()
        sch.step()
        assert sch.get_last_lr()[0] == pytest.approx(min(1e-2, 1 / math.sqrt(t)) * max(1e-3, rms),
                                                     rel=1e-5)


def test_adafactor_relative_step_replaces_another_scheduler():
    from transformers.optimization import AdafactorSchedule

    opt = build_optimizer("Adafactor", {"relative_step": "True"}, params(), 1e-3)
    assert isinstance(build_scheduler(ScheduleSpec("cosine", 0, 5), opt), AdafactorSchedule)


@pytest.mark.parametrize("kw,message", [
    (dict(lr_scheduler="cosine_with_min_lr"), "cosine_with_min_lr needs lr_scheduler_min_lr_ratio"),
    (dict(lr_scheduler="constant", warmup=2), "lr_scheduler constant has no warmup"),
    (dict(lr_scheduler="adafactor"), "lr_scheduler adafactor needs optimizer_type Adafactor, not AdamW"),
    (dict(lr_scheduler="adafactor", optimizer_type="Adafactor",
          optimizer_args={"relative_step": "False"}), "needs Adafactor with relative_step=True"),
    (dict(lr_scheduler="cosine", optimizer_type="Adafactor", warmup=2,
          optimizer_args={"relative_step": "True"}), "relative_step=True (the adafactor scheduler) "
     "has no lr_warmup_steps"),
    (dict(lr_scheduler_type="StepLR", lr_scheduler_args={"step_size": "2"},
          optimizer_type="Adafactor", optimizer_args={"relative_step": "True"}),
     "lr_scheduler_type StepLR cannot schedule Adafactor with relative_step=True"),
    (dict(lr_scheduler="warmup_stable_decay", lr_decay_steps=9, warmup=2),
     "lr_warmup_steps (2) + lr_decay_steps (9) exceed the run's 10 steps"),
    (dict(lr_scheduler="piecewise_constant"), "piecewise_constant needs lr_scheduler_args step_rules"),
    (dict(lr_scheduler="piecewise_constant", lr_scheduler_args={"step_rules": "'1:x,0.1'"}),
     "step_rules '1:x,0.1': expected"),
    (dict(lr_scheduler="cosine", lr_scheduler_args={"T_max": "3"}),
     "lr_scheduler_args T_max: lr_scheduler cosine takes none"),
    (dict(lr_scheduler_type="torch.optim.lr_scheduler.StepLR", lr_scheduler_args={"stp": "1"}),
     "lr_scheduler_args: StepLR has no argument 'stp'; valid:"),
    (dict(lr_scheduler_type="LinearLR", lr_scheduler_args={"start_factor": "5"}),
     "lr_scheduler_args for LinearLR (given: start_factor=5): ValueError"),
    (dict(lr_scheduler_type="StepLR", lr_scheduler_args={"step_size": "2"}, warmup=1),
     "lr_warmup_steps cannot be used with a scheduler class"),
    (dict(lr_scheduler_type="ReduceLROnPlateau"), "its step() needs metrics (a metric)"),
    (dict(lr_scheduler_type="torch.optim.lr_scheduler.Nope"), "torch.optim.lr_scheduler has no Nope"),
    (dict(lr_scheduler_type="no_such_module_xyz.Sched"), "module no_such_module_xyz is not installed"),
])
def test_scheduler_mistakes_are_one_line_errors_before_loading(kw, message):
    warmup = kw.pop("warmup", 0)
    with pytest.raises(OptimizerError) as e:
        check_scheduler(_opts(**kw), warmup_steps=warmup, total_steps=10)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_options_without_effect_are_announced(caplog):
    check_scheduler(_opts(lr_scheduler="cosine", lr_scheduler_timescale=5, lr_decay_steps=3),
                    warmup_steps=0, total_steps=10)
    assert "lr_scheduler_timescale has no effect with lr_scheduler cosine" in caplog.text
    assert "lr_decay_steps has no effect" in caplog.text


def test_schedule_free_keeps_a_constant_learning_rate(caplog):
    """sd-scripts gives schedule-free optimizers a dummy (constant) scheduler."""
    pytest.importorskip("schedulefree")
    opts = _opts(lr_scheduler="cosine", optimizer_type="SGDScheduleFree", learning_rate=0.1)
    check_scheduler(opts, warmup_steps=2, total_steps=10)
    assert "SGDScheduleFree is schedule-free: lr_scheduler cosine, lr_warmup_steps have no effect" \
        in caplog.text
    opt = build_optimizer("SGDScheduleFree", {}, params(), 0.1)
    opt.train()
    sch = build_scheduler(schedule_spec(opts, warmup_steps=2, total_steps=10), opt)
    assert curve(sch, opt, 10) == [0.1] * 10


def test_unknown_scheduler_and_optimizer_are_one_line_errors():
    opt = torch.optim.SGD(params(), lr=1.0)
    with pytest.raises(OptimizerError, match="lr_scheduler"):
        build_scheduler(ScheduleSpec("cosnie", 0, 3), opt)
    with pytest.raises(OptimizerError, match="optimizer_type"):
        build_optimizer("AdamQ", {}, params(), 1e-3)


def test_optimizer_args_are_literals_checked_against_the_signature():
    opt = build_optimizer("AdamW", {"weight_decay": "0.1", "betas": "(0.9, 0.99)"}, params(), 1e-3)
    g = opt.param_groups[0]
    assert g["weight_decay"] == 0.1 and g["betas"] == (0.9, 0.99) and g["lr"] == 1e-3
    with pytest.raises(OptimizerError, match="weight_decy"):
        build_optimizer("AdamW", {"weight_decy": "0.1"}, params(), 1e-3)


def test_dotted_path_and_nesterov():
    assert isinstance(build_optimizer("torch.optim.Adam", {}, params(), 1e-3), torch.optim.Adam)
    sgd = build_optimizer("SGDNesterov", {"momentum": "0.9"}, params(), 1e-2)
    assert sgd.param_groups[0]["nesterov"] is True


def test_missing_package_names_the_package():
    with pytest.raises(OptimizerError, match="pip install"):
        build_optimizer("not_a_module_xyz.Opt", {}, params(), 1e-3)
