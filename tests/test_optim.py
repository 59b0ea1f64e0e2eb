"""Optimizer and scheduler construction: names, argument checking, one LR value per step."""
import math

import pytest
import torch

from library.optim import OptimizerError, build_optimizer, build_scheduler


def params():
    return [torch.nn.Parameter(torch.zeros(3))]


def lrs(name, total=10, warmup=0, **kw):
    opt = torch.optim.SGD(params(), lr=1.0)
    sch = build_scheduler(name, opt, warmup_steps=warmup, total_steps=total, **kw)
    out = []
    for _ in range(total):
        out.append(sch.get_last_lr()[0])
        opt.step()
        sch.step()
    return out


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


def test_unknown_scheduler_and_optimizer_are_one_line_errors():
    opt = torch.optim.SGD(params(), lr=1.0)
    with pytest.raises(OptimizerError, match="lr_scheduler"):
        build_scheduler("cosnie", opt, warmup_steps=0, total_steps=3)
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
