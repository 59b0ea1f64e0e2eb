"""full_bf16 / full_fp16: the trained weights themselves in bf16 / fp16.

Each update is computed in float32 from a float32 copy of one parameter (float32 optimizer
state) and written back: bf16 with stochastic rounding (unbiased), fp16 rounded to nearest with
dynamic loss scaling that skips a step whose gradients overflow.
"""
import math

import pytest
import torch

from library.training import fused_optim
from library.training.stepper import LossScaler, PlainStepper
from tests.conftest import FakeAccelerator, read


def run_args(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data,
            "--output_dir", out, "--resolution", "64", "--max_train_steps", "2",
            "--learning_rate", "1e-3", "--cache_latents", *extra]


# -- the per-parameter float32 step --------------------------------------------------------------
def test_low_precision_step_is_the_float32_update_rounded_to_a_neighbour():
    """AdamW over bf16 weights: every stored value is one of the two bf16 neighbours of the
    float32 optimizer's result from the same stored weights, and the state is float32."""
    torch.manual_seed(0)
    w = torch.randn(64, 32).to(torch.bfloat16)
    p = torch.nn.Parameter(w.clone())
    ref = torch.nn.Parameter(w.float())
    opt, ref_opt = torch.optim.AdamW([p], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2)
    gen = fused_optim.stochastic_round_generator("cpu")
    for _ in range(3):
        grad = torch.randn(64, 32)
        p.grad, ref.grad = grad.to(torch.bfloat16), grad.to(torch.bfloat16).float()
        with torch.no_grad():
            ref.copy_(p.float())  # the same starting point as the bf16 weights
        ref_opt.state[ref] = {k: v.clone() for k, v in opt.state[p].items()} if opt.state[p] else {}
        ref_opt.step()
        fused_optim.step_optimizer(opt, gen)
        # the two bf16 neighbours: truncation toward zero, and one bf16 ulp further out
        bits = ref.detach().contiguous().view(torch.int32)
        down = bits.bitwise_and(-65536)
        lo, up = (down.view(torch.float32), (down + 65536).view(torch.float32))
        got = p.detach().float()
        assert bool(((got == lo) | (got == up)).all())
        assert not torch.equal(got, ref.detach().to(torch.bfloat16).float())  # not rounded to nearest
        assert p.dtype == torch.bfloat16
        assert all(v.dtype == torch.float32 for k, v in opt.state[p].items() if k != "step")
        assert torch.equal(opt.state[p]["exp_avg"], ref_opt.state[ref]["exp_avg"])


@pytest.mark.parametrize("optimizer_type", ["AdamW", "AdamW8bit", "Lion"])
def test_bf16_updates_are_unbiased_over_many_steps(optimizer_type):
    """Updates far below half a bf16 ulp: the optimizer's own step on bf16 weights (round to
    nearest) never moves them; the float32 step with stochastic rounding follows the float32
    trajectory on average."""
    from library.training.optim import build_optimizer

    if optimizer_type == "Lion":
        pytest.importorskip("lion_pytorch")
    n, steps, lr = 8192, 100, 1e-4
    ref = torch.nn.Parameter(torch.ones(n))
    sr = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    rtn = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    args = {"weight_decay": 0.0}
    o_ref, o_sr, o_rtn = (build_optimizer(optimizer_type, args, [{"params": [q]}], lr, warn=False)
                          for q in (ref, sr, rtn))
    gen = fused_optim.stochastic_round_generator("cpu")
    for _ in range(steps):
        for q in (ref, sr, rtn):
            q.grad = torch.ones_like(q)
        o_ref.step()
        o_rtn.step()
        fused_optim.step_optimizer(o_sr, gen)
    moved = 1.0 - float(ref.mean())
    assert moved == pytest.approx(steps * lr, rel=0.05)
    assert torch.equal(rtn.float(), torch.ones(n))  # round-to-nearest lost every update
    assert 1.0 - float(sr.float().mean()) == pytest.approx(moved, rel=0.05)


def test_float32_state_survives_a_state_dict_round_trip():
    """torch casts loaded state to the parameter's dtype; restore_float_state keeps it float32."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 8).to(torch.bfloat16))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn(8, 8).to(torch.bfloat16)
    fused_optim.step_optimizer(opt)
    saved = opt.state_dict()
    exp_avg = opt.state[p]["exp_avg"].clone()
    opt2 = torch.optim.AdamW([p], lr=1e-3)
    opt2.load_state_dict(saved)
    assert opt2.state[p]["exp_avg"].dtype == torch.bfloat16  # what torch alone does
    fused_optim.restore_float_state(opt2, saved)
    assert opt2.state[p]["exp_avg"].dtype == torch.float32
    assert torch.equal(opt2.state[p]["exp_avg"], exp_avg)


# -- loss scaling ----------------------------------------------------------------------------------
def test_loss_scaler_skips_an_overflowing_step_halves_then_grows():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.float16)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = LossScaler(init_scale=1024.0, growth_interval=2)
    stepper = PlainStepper(FakeAccelerator(), opt, sched, params, 0.0, precision="float16",
                           loss_scaler=scaler)
    x = torch.randn(2, 4, dtype=torch.float16)

    def step(loss_factor):
        before = [p.detach().clone() for p in params]
        loss = model(x).float().pow(2).mean() * loss_factor
        stepper.backward(loss)
        grads = [p.grad.float() / scaler.scale for p in params]
        stepper.step()
        return before, grads

    # a normal step: SGD on the unscaled gradient (the scale is removed in float32)
    before, grads = step(1.0)
    for p, b, g in zip(params, before, grads):
        assert torch.equal(p.detach(), (b.float() - 0.1 * g).to(torch.float16))
    assert (scaler.scale, scaler.good_steps, scaler.skipped) == (1024.0, 1, 0)
    # an overflowing step (the scaled fp16 gradient is inf): skipped, the scale halves
    before, _ = step(1e6)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(p.grad is None for p in params)
    assert (scaler.scale, scaler.good_steps, scaler.skipped) == (512.0, 0, 1)
    assert sched.last_epoch == 2  # the schedule counts the skipped step (one per global batch)
    # two good steps in a row: the scale grows back
    step(1.0)
    assert scaler.scale == 512.0
    before, _ = step(1.0)
    assert scaler.scale == 1024.0
    assert not all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    state = stepper.state_dict()
    assert state["loss_scaler"] == {"scale": 1024.0, "good_steps": 0}


# -- end to end on tiny-sd15 -----------------------------------------------------------------------
@pytest.mark.parametrize("extra", [[], ["--fused_backward_pass"],
                                   ["--fused_optimizer_groups", "3", "--optimizer_type", "Adafactor",
                                    "--optimizer_args", "relative_step=False",
                                    "scale_parameter=False", "warmup_init=False"]],
                         ids=["plain", "fused-adamw", "groups-adafactor"])
def test_full_bf16_lora_trains_and_saves(extra, dataset, tmp_path, train):
    rc, _, err, run = train("train_lora", run_args("tiny-sd15", dataset, tmp_path / "out",
                                                   "--mixed_precision", "bf16", "--full_bf16",
                                                   "--network_dim", "4", *extra))
    assert rc == 0, err
    assert "full_bf16" in err and "bf16 weights and gradients" in err
    net = list(run.parts.method.network.parameters())
    assert net and all(p.dtype == torch.bfloat16 for p in net)
    optimizers = getattr(run.parts.stepper, "optimizers", None) or [run.parts.stepper.optimizer.optimizer]
    state = {k: v for o in optimizers for k, v in o.state.items()}
    assert state and all(v.dtype == torch.float32 for st in state.values()
                         for k, v in st.items() if torch.is_tensor(v) and k != "step")
    sd, md = read(str(tmp_path / "out" / "last.safetensors"))
    ups = [v for k, v in sd.items() if k.endswith("lora_up.weight")]
    assert ups and all(v.dtype == torch.bfloat16 for v in ups)
    assert any(float(v.abs().max()) > 0 for v in ups)  # trained (lora_up starts at zero)
    assert all(bool(torch.isfinite(v.float()).all()) for v in sd.values())


def test_full_bf16_dreambooth_trains_and_saves(dataset, tmp_path, train):
    from library.models import loading as models

    base = models.load_model_bundle("tiny-sd15").unet.state_dict()
    rc, _, err, run = train("train_dreambooth", run_args("tiny-sd15", dataset, tmp_path / "out",
                                                         "--mixed_precision", "bf16",
                                                         "--full_bf16"))
    assert rc == 0, err
    unet = run.parts.bundle.unet
    assert all(p.dtype == torch.bfloat16 for p in unet.parameters())
    changed = sum(not torch.equal(p.detach().float(), base[n].to(torch.bfloat16).float())
                  for n, p in unet.named_parameters())
    assert changed > len(base) // 2
    sd, _ = read(str(tmp_path / "out" / "last.safetensors"))
    saved = {k: v for k, v in sd.items() if k.startswith("model.diffusion_model.")}
    assert saved and all(v.dtype == torch.bfloat16 for v in saved.values())
    assert all(bool(torch.isfinite(v.float()).all()) for v in saved.values())


def test_full_fp16_dreambooth_trains_and_saves_on_cpu(dataset, tmp_path, train):
    rc, _, err, run = train("train_dreambooth", run_args("tiny-sd15", dataset, tmp_path / "out",
                                                         "--mixed_precision", "fp16",
                                                         "--full_fp16"))
    assert rc == 0, err
    assert "full_fp16: fp16 weights" in err
    assert all(p.dtype == torch.float16 for p in run.parts.bundle.unet.parameters())
    assert run.parts.stepper.loss_scaler is not None and run.parts.stepper.loss_scaler.skipped == 0
    assert all(math.isfinite(v) for v in run.progress.loss_log)
    sd, _ = read(str(tmp_path / "out" / "last.safetensors"))
    saved = {k: v for k, v in sd.items() if k.startswith("model.diffusion_model.")}
    assert saved and all(v.dtype == torch.float16 for v in saved.values())
    assert all(bool(torch.isfinite(v.float()).all()) for v in saved.values())


@pytest.mark.parametrize("extra,message", [
    (["--full_bf16"], "full_bf16 needs mixed_precision bf16"),
    (["--full_fp16", "--mixed_precision", "bf16"], "full_fp16 needs mixed_precision fp16"),
    (["--full_bf16", "--full_fp16", "--mixed_precision", "bf16"],
     "full_bf16 and full_fp16 cannot be combined"),
    (["--full_bf16", "--mixed_precision", "bf16", "--optimizer_type", "Prodigy"],
     "full_bf16 cannot be used with optimizer_type Prodigy"),
    (["--full_fp16", "--mixed_precision", "fp16", "--fused_backward_pass"],
     "fused_backward_pass cannot be used with fp16"),
])
def test_rejected_combinations_fail_before_loading(run_script, dataset, tmp_path, extra, message,
                                                   no_weight_loading):
    if "Prodigy" in extra:
        pytest.importorskip("prodigyopt")
    rc, _, err = run_script("train_dreambooth", run_args("tiny-sd15", dataset, tmp_path, *extra))
    assert rc == 2, err
    assert message in err
    assert len([ln for ln in err.strip().splitlines() if "rror" in ln]) == 1


def test_full_bf16_resume_continues_exactly(dataset, tmp_path, train):
    """The float32 optimizer state and the rounding generator are part of the state: a resume
    from step 2 ends bit-identical to the run that went on."""
    args = ["--mixed_precision", "bf16", "--full_bf16", "--network_dim", "4",
            "--max_train_steps", "4", "--seed", "5"]
    rc, _, err, whole = train("train_lora", run_args("tiny-sd15", dataset, tmp_path / "a", *args,
                                                     "--save_every_n_steps", "2", "--save_state"))
    assert rc == 0, err
    state = tmp_path / "a" / "last-step00000002-state"
    assert state.is_dir()
    rc, _, err, resumed = train("train_lora", run_args("tiny-sd15", dataset, tmp_path / "b", *args,
                                                       "--resume", str(state)))
    assert rc == 0, err
    assert resumed.progress.loss_log == whole.progress.loss_log
    a, _ = read(str(tmp_path / "a" / "last.safetensors"))
    b, _ = read(str(tmp_path / "b" / "last.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_low_precision_clipping_is_torch_clipping_of_the_unscaled_gradient():
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 4).to(torch.float16)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    stepper = PlainStepper(FakeAccelerator(), opt, sched, params, 0.01, precision="float16",
                           loss_scaler=LossScaler(init_scale=256.0))
    before = [p.detach().float() for p in params]
    stepper.backward(model(torch.randn(3, 8, dtype=torch.float16)).float().pow(2).mean())
    grads = [p.grad.float() / 256.0 for p in params]
    ref = [torch.nn.Parameter(b.clone()) for b in before]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    norm = float(torch.nn.utils.clip_grad_norm_(ref, 0.01))
    assert norm > 0.1  # clipping is active: the update is scaled down by more than 10x
    expected = [(b - 0.1 * r.grad).to(torch.float16) for b, r in zip(before, ref)]
    stepper.step()
    for p, e in zip(params, expected):
        ulp = torch.finfo(torch.float16).eps * e.float().abs().clamp(min=2.0 ** -14)
        assert bool(((p.detach().float() - e.float()).abs() <= ulp).all())
