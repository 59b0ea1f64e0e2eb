"""benchmarks/step_overhead.py: the interleaving plan, the medians and ratio it prints, and its bare
step (a plain SGD step on the run's U-Net that leaves ours' gradients as they were), on known
answers. The timed runs themselves take minutes (docs/PERFORMANCE.md)."""
from __future__ import annotations

import copy

import torch

from benchmarks import step_overhead
from library.models.families.sd_common import tiny_models


def test_schedule_by_hand():
    # warmup 2, 2 rounds of 1 timed step: bare after step 2; 3 dropped, 4 timed, bare; 5, 6
    plan = step_overhead.schedule(2, 2, 1)
    assert plan == {1: ("warmup", False), 2: ("warmup", True), 3: ("first", False),
                    4: ("timed", True), 5: ("first", False), 6: ("timed", False)}
    assert step_overhead.total_steps(2, 2, 1) == 6
    plan = step_overhead.schedule(1, 3, 2)
    assert [s for s, (_, bare) in plan.items() if bare] == [1, 4, 7]  # one bare block per round
    assert sum(kind == "timed" for kind, _ in plan.values()) == 6


def test_summary_medians_and_ratio():
    # (wall, cpu) per step, in blocks
    r = step_overhead.summary("full1", {"ours": [[[1.0, 1.0], [3.0, 2.0]], [[2.0, 1.0], [10.0, 3.0]]],
                                        "bare": [[[2.0, 1.0]], [[2.0, 2.0], [1.0, 1.0]]],
                                        "params": 7, "model": "m"})
    assert (r["ours_wall"], r["bare_wall"], r["ratio_wall"]) == (2.5, 2.0, 1.25)
    assert (r["ours_cpu"], r["bare_cpu"], r["ratio_cpu"]) == (1.5, 1.0, 1.5)
    assert r["trained"] == 7
    lines = step_overhead.format_rows([r], type("A", (), {"rounds": 2, "block": 2})())
    assert any("1.250" in line and "full1" in line for line in lines)


def test_bare_block_is_plain_sgd_and_keeps_ours_gradients():
    torch.manual_seed(0)
    unet = tiny_models.build_tiny_components("sd15")["unet"].train()
    ref_unet = copy.deepcopy(unet)
    params, ref_params = list(unet.parameters()), list(ref_unet.parameters())
    ours = [torch.full_like(p, 3.0) for p in params]
    for p, g in zip(params, ours):
        p.grad = g
    bare = step_overhead.Bare(unet, params, world=1)
    times = bare.block(1)  # one untimed step, one timed
    assert len(times) == 1 and times[0][0] > 0 and times[0][1] > 0  # wall, cpu
    # the reference: two SGD steps by hand (plain autograd on a copy, not the class)
    for _ in range(2):
        loss = torch.nn.functional.mse_loss(ref_unet(bare.x, bare.t, bare.cond).sample, bare.x)
        grads = torch.autograd.grad(loss, ref_params, allow_unused=True)
        with torch.no_grad():
            for q, g in zip(ref_params, grads):
                if g is not None:
                    q -= 1e-4 * g
    for p, q, mine in zip(params, ref_params, ours):
        assert p.grad is mine  # ours' gradients back in place
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)


def test_sd_scripts_refused_with_quick(tmp_path, capsys):
    (tmp_path / "train_network.py").write_text("")  # looks like a checkout
    assert step_overhead.main(["--quick", "--sd-scripts", str(tmp_path)]) == 2
    assert "not with --quick" in capsys.readouterr().err
    assert step_overhead.main(["--modes", "full1", "--sd-scripts", str(tmp_path)]) == 2
