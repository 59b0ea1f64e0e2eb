"""fused_backward_pass and fused_optimizer_groups train exactly like the plain optimizer.

Equivalence (the contract): on the tiny SD1.5 model, several steps, LoRA (train_lora.py) and
full fine-tune (train_dreambooth.py), ``max_grad_norm 0``, the fused run's weights equal the
plain run's per tensor within ||a-b|| / ||b|| <= 1e-6 (float32) for AdamW and Adafactor;
optimizer groups N = 1, 3, 7 likewise; and with gradient accumulation 2 (whose partial global
batches leave the last micro-step empty, so the stepper's zero-weight backward is exercised in
one process too). One 2-process gloo launch shows that under multi-process the fused step uses
the all-reduced gradient: both ranks end identical and equal to the one-process plain run.
Also: the rejected combinations (each its own message, before any weight loads), per-parameter
clipping announced once, gradients freed inside the backward, state_dict round trip, and
stochastic rounding of bf16 weights (unbiased).

Images are 128 px (two buckets, tests/training/test_equivalence.py) so float32 noise in the tiny U-Net's
middle block does not dominate; fused and plain runs compute the same gradients in the same
order, so the measured difference is 0 here, far below the bound.
"""
from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

from library.training import fused_optim
from library.training.fused_optim import copy_stochastic_
from library.training.stepper import FusedStepper, GroupedStepper, PlainStepper, make_stepper

TOL = 1e-6
# Adafactor stepped by learning_rate (its default, relative_step=True, ignores the lr schedule
# these tests compare; tests/training/test_optimizers.py covers the fused relative step)
LR_ADAFACTOR = {"relative_step": "False", "scale_parameter": "False", "warmup_init": "False"}


# -- the stepper on a small model (no trainer) ----------------------------------------------------
from tests.conftest import FakeAccelerator as _Acc  # noqa: E402
from tests.helpers import make_opts  # noqa: E402


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4 * 6 * 6, 5)
        self.head = torch.nn.Linear(5, 2)
        self.unused = torch.nn.Parameter(torch.ones(3))  # never in the graph: grad stays None

    def forward(self, x):
        return self.head(torch.relu(self.fc(torch.relu(self.conv(x)).flatten(1))))


def _opts(**kw):
    return make_opts(**{"optimizer_args": {"weight_decay": 0.01}, "learning_rate": 1e-2,
                        "lr_scheduler": "cosine", "max_grad_norm": 0.0, **kw})


def _run_small(opts, steps=4, accumulation=1, save_after=None, load=None):
    net = _Net()
    params = [p for p in net.parameters()]
    groups = [{"params": params[:2], "lr": opts.learning_rate * 2},
              {"params": params[2:]}]
    stepper = make_stepper(_Acc(), opts, groups, params, warmup_steps=1, total_steps=steps)
    if load is not None:
        stepper.load_state_dict(load[1])
        net.load_state_dict(load[0])
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 3, 8, 8, generator=g), torch.randn(2, 2, generator=g))
            for _ in range(steps * accumulation)]
    lrs, saved = [], None
    start = 0 if load is None else save_after
    for s in range(start, steps):
        for a in range(accumulation):
            x, y = data[s * accumulation + a]
            loss = torch.nn.functional.mse_loss(net(x), y) / accumulation
            stepper.backward(loss, last_micro_step=a == accumulation - 1)
            if a < accumulation - 1:
                assert net.fc.weight.grad is not None  # accumulating, not stepped yet
        if stepper.steps_in_backward:
            # stepped and freed inside the backward, except the unit of the unused parameter
            # (its hook never fires: that unit is stepped in step())
            late = stepper.unit_of[id(net.unused)]
            assert all(p.grad is None for p in params if stepper.unit_of[id(p)] != late)
            assert any(p.grad is not None for p in stepper.units[late]) == (len(stepper.units[late]) > 1)
        lrs.append(stepper.current_lr())
        stepper.step()
        if save_after is not None and load is None and s + 1 == save_after:
            saved = ({k: v.clone() for k, v in net.state_dict().items()},
                     _deepcopy(stepper.state_dict()))
    return net, stepper, lrs, saved


def _deepcopy(x):
    import copy

    return copy.deepcopy(x)


def _assert_same(a, b, tol=TOL):
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        d, n = float((x - y).norm()), float(y.norm())
        assert (d / n if n else d) <= tol, (k, d)


@pytest.mark.parametrize("optimizer_type,args", [
    ("AdamW", {"weight_decay": 0.01}), ("Adafactor", LR_ADAFACTOR), ("SGDNesterov", {}), ("Lion", {}),
    ("AdamW8bit", {"min_8bit_size": 16})])
@pytest.mark.parametrize("mode", ["fused", "groups2"])
def test_stepper_equals_plain_on_a_small_model(optimizer_type, args, mode):
    if optimizer_type == "Lion":
        pytest.importorskip("lion_pytorch")
    extra = {"fused_backward_pass": True} if mode == "fused" else {"fused_optimizer_groups": 2}
    plain_net, plain, plain_lrs, _ = _run_small(_opts(optimizer_type=optimizer_type,
                                                      optimizer_args=args), accumulation=2)
    net, stepper, lrs, _ = _run_small(_opts(optimizer_type=optimizer_type, optimizer_args=args,
                                            **extra), accumulation=2)
    assert isinstance(plain, PlainStepper)
    assert isinstance(stepper, FusedStepper if mode == "fused" else GroupedStepper)
    assert len(stepper.optimizers) == (7 if mode == "fused" else 2)  # 7 parameters
    assert lrs == plain_lrs and lrs[0] == pytest.approx(2e-2 * 0.5)  # group 0's lr, warmup
    _assert_same(net, plain_net)
    assert float((net.head.weight - _Net().head.weight).abs().max()) > 1e-4  # it trained
    assert torch.equal(net.unused, torch.ones(3))


def test_groups_are_contiguous_in_backward_order():
    from library.training.stepper import _split_contiguous

    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 1, 1, 10, 5, 5, 1)]
    for n in range(1, 8):
        chunks = _split_contiguous(ps, n)
        assert len(chunks) == n and [p for c in chunks for p in c] == ps
    assert len(_split_contiguous(ps, 20)) == len(ps)
    net, stepper, _, _ = _run_small(_opts(fused_optimizer_groups=3))
    order = [p for u in stepper.units for p in u]
    assert order == list(reversed(list(net.parameters())))  # the head (last layer) first


def test_state_dict_round_trip_covers_every_optimizer():
    """Resume: 2 steps, state_dict, a fresh stepper loads it and continues == 4 steps straight."""
    for extra in ({"fused_backward_pass": True}, {"fused_optimizer_groups": 3}):
        opts = _opts(optimizer_type="AdamW", **extra)
        straight, _, lrs_straight, saved = _run_small(opts, steps=4, save_after=2)
        assert len(saved[1]["optimizers"]) == len(saved[1]["schedulers"]) > 1
        resumed, _, lrs_resumed, _ = _run_small(opts, steps=4, save_after=2, load=saved)
        assert lrs_resumed == lrs_straight[2:]
        _assert_same(resumed, straight, tol=0.0)
        # a state of another shape is refused with a message, not half loaded
        _, other, _, _ = _run_small(_opts(fused_optimizer_groups=2), steps=1)
        with pytest.raises(ValueError, match=r"the saved state has (7|3) optimizers, this run 2"):
            other.load_state_dict(saved[1])


def test_per_parameter_clipping():
    """max_grad_norm > 0 clips each parameter's gradient separately (engaged: results differ
    from no clipping; equal to per-parameter clipping done by hand with SGD)."""
    clipped, _, _, _ = _run_small(_opts(optimizer_type="torch.optim.SGD", optimizer_args={},
                                        fused_backward_pass=True, max_grad_norm=0.01), steps=1)
    free, _, _, _ = _run_small(_opts(optimizer_type="torch.optim.SGD", optimizer_args={},
                                     fused_backward_pass=True), steps=1)
    ref = _Net()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 3, 8, 8, generator=g), torch.randn(2, 2, generator=g)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    with torch.no_grad():
        for i, p in enumerate(ref.parameters()):
            if p.grad is not None:
                torch.nn.utils.clip_grad_norm_([p], 0.01)
                p -= (2e-2 if i < 2 else 1e-2) * 0.5 * p.grad
    _assert_same(clipped, ref)
    assert float((clipped.fc.weight - free.fc.weight).abs().max()) > 1e-4


# -- stochastic rounding ------------------------------------------------------------------------
def test_stochastic_rounding_is_unbiased():
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    g = torch.Generator().manual_seed(0)
    for frac in (0.1, 0.25, 0.5, 0.9):
        x = torch.full((200_000,), 1.0 + frac * ulp)
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        copy_stochastic_(out, x, g)
        vals = set(out.float().unique().tolist())
        assert vals == {1.0, 1.0 + ulp}  # only the two neighbours
        assert float(out.float().mean()) == pytest.approx(1.0 + frac * ulp, abs=0.01 * ulp)
    # exact bf16 values are kept exactly; negative numbers round alike
    x = torch.tensor([1.0, -2.5, 3.0, 0.0])
    out = torch.empty(4, dtype=torch.bfloat16)
    copy_stochastic_(out, x, g)
    assert torch.equal(out.float(), x)
    x = torch.full((100_000,), -(1.0 + 0.3 * ulp))
    copy_stochastic_(out := torch.empty(x.shape, dtype=torch.bfloat16), x, g)
    assert float(out.float().mean()) == pytest.approx(-(1.0 + 0.3 * ulp), abs=0.01 * ulp)


def test_adafactor_bf16_updates_are_unbiased_over_many_steps():
    """Updates far below half a bf16 ulp: round-to-nearest (transformers' Adafactor) never moves
    the weights; the fused Adafactor's stochastic rounding follows the float32 trajectory on
    average."""
    from transformers.optimization import Adafactor

    kw = dict(lr=1e-4, relative_step=False, scale_parameter=False, warmup_init=False)
    n, steps = 4096, 200
    ref = torch.nn.Parameter(torch.ones(n))
    sr = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    rtn = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    o_ref, o_sr, o_rtn = Adafactor([ref], **kw), Adafactor([sr], **kw), Adafactor([rtn], **kw)
    gen = fused_optim.stochastic_round_generator("cpu")
    for _ in range(steps):
        for p in (ref, sr, rtn):
            p.grad = torch.ones_like(p)
        o_ref.step()
        o_rtn.step()
        fused_optim.step_optimizer(o_sr, gen)
    moved = 1.0 - float(ref.mean())
    assert moved == pytest.approx(steps * 1e-4, rel=0.05)
    assert torch.equal(rtn.float(), torch.ones(n))  # round-to-nearest lost every update
    assert 1.0 - float(sr.float().mean()) == pytest.approx(moved, rel=0.05)


def test_adafactor_step_param_is_transformers_math_in_float32():
    from transformers.optimization import Adafactor

    torch.manual_seed(0)
    for shape, kw in (((6, 5), {}), ((4, 3, 3, 3), {"beta1": 0.9, "weight_decay": 0.1}),
                      ((7,), {"relative_step": True, "lr": None})):
        a = torch.nn.Parameter(torch.randn(shape))
        b = torch.nn.Parameter(a.detach().clone())
        base = dict(lr=1e-3, relative_step=False, scale_parameter=False, warmup_init=False)
        base.update(kw)
        oa, ob = Adafactor([a], **base), Adafactor([b], **base)
        for _ in range(3):
            grad = torch.randn(shape)
            a.grad, b.grad = grad.clone(), grad.clone()
            oa.step()
            fused_optim.adafactor_step_param(ob, b, ob.param_groups[0])
        assert torch.equal(a, b), shape


# -- rejected combinations ----------------------------------------------------------------------
@pytest.mark.parametrize("extra,message", [
    (["--fused_backward_pass", "--fused_optimizer_groups", "2"],
     "fused_backward_pass and fused_optimizer_groups cannot be combined"),
    (["--fused_backward_pass", "--mixed_precision", "fp16"],
     "fused_backward_pass cannot be used with fp16: loss scaling needs a global overflow check"),
    (["--fused_optimizer_groups", "3", "--mixed_precision", "fp16"],
     "fused_optimizer_groups cannot be used with fp16"),
    (["--fused_backward_pass", "--optimizer_type", "Prodigy"],
     "optimizer_type Prodigy: Prodigy estimates one step size from all parameters"),
    (["--fused_optimizer_groups", "2", "--optimizer_type", "AdamWScheduleFree"],
     "schedule-free optimizers switch all parameters"),
    (["--fused_backward_pass", "--optimizer_type", "dadaptation.DAdaptAdam"],
     "dadaptation"),  # not installed: the missing package is named first
])
def test_rejected_combinations_fail_before_loading(run_script, dataset, tmp_path, extra, message,
                                                   no_weight_loading):
    if "Prodigy" in extra:
        pytest.importorskip("prodigyopt")
    if "AdamWScheduleFree" in extra:
        pytest.importorskip("schedulefree")
    # train_dreambooth for the first two (the check does not depend on the script)
    script = "train_dreambooth" if "--fused_optimizer_groups" in extra[:1] or \
        "fp16" in extra else "train_lora"
    rc, out, err = run_script(script, ["--pretrained_model_name_or_path", "tiny-sd15",
                                       "--train_data_dir", dataset, "--output_dir", str(tmp_path),
                                       "--resolution", "64", "--max_train_steps", "1", *extra])
    assert rc == 2, err
    assert message in err
    assert len([ln for ln in err.strip().splitlines() if "rror" in ln]) == 1


def test_global_state_detection():
    from library.training.optim import resolve_optimizer_class

    assert fused_optim.global_state_reason(torch.optim.AdamW) is None
    assert fused_optim.global_state_reason(resolve_optimizer_class("Adafactor")[0]) is None
    for name in ("Prodigy", "AdamWScheduleFree", "RAdamScheduleFree"):
        cls = resolve_optimizer_class(name)[0]
        assert fused_optim.global_state_reason(cls)
    fake = type("DAdaptAdam", (), {"__module__": "dadaptation.dadapt_adam"})
    assert "D-Adaptation" in fused_optim.global_state_reason(fake)


# -- the trainer: fused == plain on the tiny model ---------------------------------------------
def _train(script, args):
    from library.cli import main
    from tests.conftest import reset_accelerate
    from tests.training.test_equivalence import TrainingCapture

    out, err = io.StringIO(), io.StringIO()
    reset_accelerate()
    try:
        with TrainingCapture() as cap, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            rc = main(script, [str(a) for a in args])
    finally:
        reset_accelerate()
    assert rc == 0, err.getvalue()[-3000:]
    r = cap.run
    if script == "train_lora":
        weights = r.parts.method.network.state_dict()
    else:
        weights = {f"unet.{k}": v for k, v in r.parts.bundle.unet.state_dict().items()}
        for i, te in enumerate(r.parts.bundle.text_encoders):
            weights.update({f"te{i}.{k}": v for k, v in te.state_dict().items()})
    return {"run": r, "err": err.getvalue(), "micro_steps": cap.micro_steps,
            "weights": {k: v.detach().clone() for k, v in weights.items()
                        if v.is_floating_point()}}


OPTIMIZERS = {
    "adamw": ["--optimizer_type", "AdamW", "--optimizer_args", "weight_decay=0.01",
              "--learning_rate", "1e-3"],
    "adafactor": ["--optimizer_type", "Adafactor", "--optimizer_args",
                  *(f"{k}={v}" for k, v in LR_ADAFACTOR.items()), "--learning_rate", "1e-3"],
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tests.training.test_equivalence import BUCKET_ARGS, make_two_bucket_dataset

    data = make_two_bucket_dataset(str(tmp_path_factory.mktemp("twobuckets")))
    done: dict = {}

    def get(script, optimizer, *extra):
        key = (script, optimizer, *extra)
        if key not in done:
            out = str(tmp_path_factory.mktemp("run"))
            args = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", data,
                    "--output_dir", out, *BUCKET_ARGS, "--cache_latents", "--seed", "7",
                    "--lr_scheduler", "cosine", "--lr_warmup_steps", "1",
                    "--max_train_steps", "4", "--max_grad_norm", "0", *OPTIMIZERS[optimizer]]
            if script == "train_lora":
                args += ["--network_dim", "4", "--network_alpha", "2"]
            else:
                args += ["--train_text_encoder"]
            done[key] = _train(script, args + list(extra))
        return done[key]

    return get


def _assert_equivalent(a, b, same_micro_steps=True):
    assert a["weights"].keys() == b["weights"].keys()
    worst = (0.0, "")
    for k, y in b["weights"].items():
        x = a["weights"][k]
        d, n = float((x.double() - y.double()).norm()), float(y.double().norm())
        worst = max(worst, (d / n if n > 0 else d, k))
    assert worst[0] <= TOL, f"{worst[1]}: {worst[0]:.2e}"
    assert a["run"].progress.lr_log == b["run"].progress.lr_log and len(a["run"].progress.lr_log) == 4
    assert a["run"].progress.loss_log == pytest.approx(b["run"].progress.loss_log, rel=1e-6)
    if same_micro_steps:
        assert a["micro_steps"] == b["micro_steps"]
    return worst[0]


def _moved(trained, script):
    """Guard: training changed the weights (the comparison is not of untouched tensors): the
    LoRA up weights start at zero, and AdamW and Adafactor runs end apart."""
    a, b = trained(script, "adamw")["weights"], trained(script, "adafactor")["weights"]
    if script == "train_lora":
        ups = [t for k, t in a.items() if k.endswith("lora_up.weight")]
        assert ups and all(float(t.abs().max()) > 0 for t in ups)
    keys = [k for k in a if ("lora_unet" in k or k.startswith("unet.")) and k.endswith(".weight")
            and ("lora_up" in k or "to_q" in k)]
    return keys and all(not torch.equal(a[k], b[k]) for k in keys)


@pytest.mark.parametrize("script", ["train_lora", "train_dreambooth"])
@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_fused_backward_pass_equals_plain(trained, script, optimizer):
    plain = trained(script, optimizer)
    fused = trained(script, optimizer, "--fused_backward_pass")
    assert isinstance(fused["run"].parts.stepper, FusedStepper)
    assert isinstance(plain["run"].parts.stepper, PlainStepper)
    _assert_equivalent(fused, plain)
    assert _moved(trained, script)
    assert "fused_backward_pass" in fused["err"] and "clips" not in fused["err"]


@pytest.mark.parametrize("script,n", [("train_lora", 1), ("train_lora", 3), ("train_lora", 7),
                                      ("train_dreambooth", 3)])
def test_optimizer_groups_equal_plain(trained, script, n):
    plain = trained(script, "adamw")
    groups = trained(script, "adamw", "--fused_optimizer_groups", str(n))
    stepper = groups["run"].parts.stepper
    assert isinstance(stepper, GroupedStepper) and len(stepper.optimizers) == n
    _assert_equivalent(groups, plain)


def test_fused_with_accumulation_equals_plain_with_accumulation(trained):
    plain = trained("train_lora", "adamw", "--gradient_accumulation_steps", "2")
    fused = trained("train_lora", "adamw", "--gradient_accumulation_steps", "2",
                    "--fused_backward_pass")
    _assert_equivalent(fused, plain, same_micro_steps=False)
    # partial global batches left the last micro-step empty: the fused run added a zero-weight
    # backward of the step's first sample there (its hooks step only in the last micro-step)
    assert len(plain["micro_steps"]) < len(fused["micro_steps"]) == 2 * 4
    extra = list(fused["micro_steps"])
    for m in plain["micro_steps"]:
        extra.remove(m)
    assert extra and all(m in plain["micro_steps"] for m in extra)  # repeats of a real sample
    assert "saved only in that micro-step" in fused["err"]
    assert fused["weights"].keys() == trained("train_lora", "adamw")["weights"].keys()


def test_fused_clipping_is_per_parameter_and_announced_once(trained):
    fused = trained("train_lora", "adamw", "--fused_backward_pass", "--max_grad_norm", "1e-4")
    assert fused["err"].count("clips each parameter's gradient separately") == 1
    plain = trained("train_lora", "adamw", "--fused_backward_pass")
    worst = max(float((fused["weights"][k] - v).norm() / max(float(v.norm()), 1e-12))
                for k, v in plain["weights"].items())
    assert worst > 1e-3  # engaged


# -- two processes ------------------------------------------------------------------------------
def test_fused_two_processes_use_the_summed_gradient(tmp_path):
    """2 gloo processes x batch 1, fused (rank 1 has empty shares: zero-weight backward) ==
    1 process x batch 2 plain; both ranks identical. Without the all-reduce in the hook each rank
    would step on its own half of the batch and the ranks would differ."""
    from tests.training.test_equivalence import (TOL as SPLIT_TOL, make_two_bucket_dataset,
                                        max_rel_diff, read_file, train_args, train_in_process)
    from tests.distributed.test_multiprocess import launch_two_processes

    data = make_two_bucket_dataset(str(tmp_path / "data"))
    common = ["--max_train_steps", "3", "--max_grad_norm", "0"]
    out, report = tmp_path / "two", tmp_path / "report"
    report.mkdir()
    proc = launch_two_processes(str(report), train_args(data, str(out), "--train_batch_size", "1",
                                                        "--fused_backward_pass", *common))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    import json

    ranks = [json.load(open(report / f"rank{r}.json")) for r in (0, 1)]
    ref = train_in_process(train_args(data, str(tmp_path / "one"), "--train_batch_size", "2",
                                      *common))
    assert ranks[0]["world_size"] == 2
    assert ranks[0]["lr_log"] == ranks[1]["lr_log"] == ref["run"].progress.lr_log
    assert len(ref["run"].progress.lr_log) == 3
    # rank 1's share of a partial batch was empty: it ran the zero-weight backward of rank 0's
    # sample (recorded as a micro-step of that sample), so its hooks fired in step with rank 0
    by_rank = [{s: tuple(i) for s, _, i in r["micro_steps"]} for r in ranks]
    assert by_rank[0].keys() == by_rank[1].keys() == set(range(3))
    assert any(by_rank[0][s] == by_rank[1][s] for s in range(3))
    w0, w1 = (read_file(os.path.join(report, f"rank{r}.safetensors"))[0] for r in (0, 1))
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
    worst, key = max_rel_diff(read_file(os.path.join(out, "last.safetensors"))[0], ref["tensors"])
    assert worst <= SPLIT_TOL, f"{key}: {worst:.2e}"


@pytest.mark.parametrize("extra,most_alive", [({}, 6), ({"fused_backward_pass": True}, 0),
                                              ({"fused_optimizer_groups": 3}, 3)])
def test_gradients_are_freed_during_the_backward(extra, most_alive):
    """The memory contract: an observer hook (registered after the stepper's, so it runs after
    it for the same parameter) counts the gradients alive while the backward runs. Plain: all 6
    used parameters' gradients accumulate; fused: none outlives its own hook; groups of 3: at
    most the gradients of the group being filled (the first group, in backward order, is the
    head and fc layers: 4 parameters, so 3 gradients wait for the 4th)."""
    net = _Net()
    params = list(net.parameters())
    stepper = make_stepper(_Acc(), _opts(**extra), [{"params": params}], params, warmup_steps=0,
                           total_steps=2)
    alive = []
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda _p: alive.append(sum(q.grad is not None for q in params)))
    x, y = torch.randn(2, 3, 8, 8), torch.randn(2, 2)
    stepper.backward(torch.nn.functional.mse_loss(net(x), y))
    assert len(alive) == 6  # every used parameter's hook fired
    assert max(alive) == most_alive
    stepper.step()


def test_fused_resume_continues_exactly(trained, tmp_path):
    """The training state holds every per-parameter optimizer and scheduler: 2 steps, saved,
    resumed to 4 == 4 straight (fused AdamW, cosine with warmup)."""
    straight = trained("train_lora", "adamw", "--fused_backward_pass")
    data = straight["run"].opts.train_data_dir
    from tests.training.test_equivalence import BUCKET_ARGS

    base = ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", data,
            "--output_dir", str(tmp_path), *BUCKET_ARGS, "--cache_latents", "--seed", "7",
            "--lr_scheduler", "cosine", "--lr_warmup_steps", "1", "--max_grad_norm", "0",
            *OPTIMIZERS["adamw"], "--network_dim", "4", "--network_alpha", "2",
            "--fused_backward_pass", "--save_state_on_train_end"]
    _train("train_lora", [*base, "--max_train_steps", "2"])
    resumed = _train("train_lora", [*base, "--max_train_steps", "4", "--resume", "latest"])
    assert resumed["run"].progress.global_step == 4
    assert isinstance(resumed["run"].parts.stepper, FusedStepper)
    assert resumed["run"].progress.lr_log == straight["run"].progress.lr_log
    for k, v in straight["weights"].items():
        assert torch.equal(resumed["weights"][k], v), k
