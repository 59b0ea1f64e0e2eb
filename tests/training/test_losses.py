"""Noise, timestep and loss variants (library/training/losses.py): each against an independent computation
of its published formula, the option checks, end-to-end LoRA runs, and the per-sample contract
(a sample's noise and loss are the same at batch 2 and at batch 1 x accumulation 2).

The references below recompute each formula from its definition on small tensors, in float64
where that helps, drawing the random numbers from a fresh generator in the documented order
(losses.py: noise, timestep, noise-offset strength and offset, multires factors and levels,
ip-noise strength and perturbation).
"""
from __future__ import annotations

import math

import pytest
import torch

from library.training import losses
from library.config.parse import parse_args

N = 1000
SHAPE = (4, 8, 6)  # C, H, W of a latent


def make_opts(*extra, script="train_lora"):
    return parse_args(script, ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir",
                               "data", "--resolution", "64", "--output_dir", "out",
                               "--max_train_steps", "1", *[str(x) for x in extra]])


def make_scheduler(**kw):
    from diffusers import DDPMScheduler

    return DDPMScheduler(num_train_timesteps=N, beta_start=0.00085, beta_end=0.012,
                         beta_schedule="scaled_linear", clip_sample=False, **kw)


def make_losses(*extra, v=False, sched=None):
    return losses.Losses(make_opts(*extra), sched or make_scheduler(), v)


def gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def latents_for(seeds):
    g = torch.Generator().manual_seed(12345)
    return torch.randn((len(seeds), *SHAPE), generator=g) * 0.8 + 0.3


SEEDS = [3, 17, 99]


def ref_snr(sched, t):
    """SNR(t) = alphabar / (1 - alphabar), in float64 from the scheduler's alphabar."""
    ac = sched.alphas_cumprod.double()[t]
    return ac / (1 - ac)


def ref_noisy(sched, x, n, t):
    ac = sched.alphas_cumprod.double()[t].view(-1, 1, 1, 1)
    return ac.sqrt() * x.double() + (1 - ac).sqrt() * n.double()


# -- noise and timesteps --------------------------------------------------------------------------

def test_defaults_are_the_plain_trainer():
    """All variants off: noise and timestep are the first two draws of the sample's generator,
    noisy latents the DDPM forward process, the loss the per-sample MSE."""
    L = make_losses()
    x = latents_for(SEEDS)
    d = L.draw(x, gens(SEEDS))
    for k, s in enumerate(SEEDS):
        g = torch.Generator().manual_seed(s)
        assert torch.equal(d.noise[k], torch.randn(SHAPE, generator=g))
        assert int(d.timesteps[k]) == int(torch.randint(0, N, (1,), generator=g))
    assert torch.equal(d.input_noise, d.noise)
    torch.testing.assert_close(L.noisy_latents(x, d).double(),
                               ref_noisy(L.scheduler, x, d.noise, d.timesteps))
    pred = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    want = ((pred.double() - d.noise.double()) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(L.per_sample_loss(pred, x, d).double(), want)


@pytest.mark.parametrize("random_strength", [False, True])
@pytest.mark.parametrize("adaptive", [None, 0.5, -3.0])
def test_noise_offset(random_strength, adaptive):
    extra = ["--noise_offset", "0.1"]
    if random_strength:
        extra.append("--noise_offset_random_strength")
    if adaptive is not None:
        extra += ["--adaptive_noise_scale", adaptive]
    L = make_losses(*extra)
    x = latents_for(SEEDS)
    d = L.draw(x, gens(SEEDS))
    for k, s in enumerate(SEEDS):
        g = torch.Generator().manual_seed(s)
        base = torch.randn(SHAPE, generator=g).double()
        torch.randint(0, N, (1,), generator=g)
        strength = 0.1 * (float(torch.rand(1, generator=g)) if random_strength else 1.0)
        off = torch.randn((SHAPE[0], 1, 1), generator=g).double()
        if adaptive is not None:
            channel_mean = x[k].double().mean(dim=(1, 2), keepdim=True).abs()
            strength = torch.clamp(strength + adaptive * channel_mean, min=0.0)
        want = base + strength * off
        torch.testing.assert_close(d.noise[k].double(), want, rtol=1e-6, atol=1e-6)


def test_noise_offset_adaptive_clamp_removes_the_offset():
    """A strongly negative adaptive scale clamps the per-channel offset to 0: noise unchanged."""
    L = make_losses("--noise_offset", "0.1", "--adaptive_noise_scale", "-100")
    x = latents_for(SEEDS) + 1.0  # every channel mean well away from 0
    d = L.draw(x, gens(SEEDS))
    plain = make_losses().draw(x, gens(SEEDS))
    assert torch.equal(d.noise, plain.noise)


def ref_pyramid(noise, g, iterations, discount):
    c, h, w = noise.shape
    out = noise.double().clone()
    for i in range(iterations):
        r = float(torch.rand(1, generator=g)) * 2 + 2
        hn, wn = max(1, int(h / r ** i)), max(1, int(w / r ** i))
        level = torch.randn((1, c, hn, wn), generator=g)
        up = torch.nn.functional.interpolate(level, size=(h, w), mode="bilinear", align_corners=False)
        out = out + up[0].double() * discount ** i
        if hn == 1 or wn == 1:
            break
    mean = out.mean()
    std = math.sqrt(float(((out - mean) ** 2).sum()) / (out.numel() - 1))  # unbiased, as torch.std
    return out / std


@pytest.mark.parametrize("iterations,discount", [(1, 0.3), (3, 0.3), (10, 0.8)])
def test_multires_noise(iterations, discount):
    L = make_losses("--multires_noise_iterations", iterations, "--multires_noise_discount", discount)
    x = latents_for(SEEDS)
    d = L.draw(x, gens(SEEDS))
    for k, s in enumerate(SEEDS):
        g = torch.Generator().manual_seed(s)
        base = torch.randn(SHAPE, generator=g)
        torch.randint(0, N, (1,), generator=g)
        torch.testing.assert_close(d.noise[k].double(), ref_pyramid(base, g, iterations, discount),
                                   rtol=1e-5, atol=1e-5)
        assert float(d.noise[k].std()) == pytest.approx(1.0, abs=1e-5)  # per sample, not per batch


def test_noise_offset_then_multires():
    """Both on: the offset noise is what the pyramid builds on (sd-scripts' order)."""
    L = make_losses("--noise_offset", "0.2", "--multires_noise_iterations", "2")
    x = latents_for(SEEDS)
    d = L.draw(x, gens(SEEDS))
    g = torch.Generator().manual_seed(SEEDS[1])
    base = torch.randn(SHAPE, generator=g).double()
    torch.randint(0, N, (1,), generator=g)
    base = base + 0.2 * torch.randn((SHAPE[0], 1, 1), generator=g).double()
    torch.testing.assert_close(d.noise[1].double(), ref_pyramid(base, g, 2, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("random_strength", [False, True])
@pytest.mark.parametrize("v", [False, True])
def test_ip_noise_gamma(random_strength, v):
    extra = ["--ip_noise_gamma", "0.3"] + (["--ip_noise_gamma_random_strength"] if random_strength else [])
    L = make_losses(*extra, v=v)
    x = latents_for(SEEDS)
    d = L.draw(x, gens(SEEDS))
    noisy = L.noisy_latents(x, d).double()
    target = L.target(x, d).double()
    for k, s in enumerate(SEEDS):
        g = torch.Generator().manual_seed(s)
        n = torch.randn(SHAPE, generator=g)
        t = int(torch.randint(0, N, (1,), generator=g))
        gamma = 0.3 * (float(torch.rand(1, generator=g)) if random_strength else 1.0)
        perturbed = n.double() + gamma * torch.randn(SHAPE, generator=g).double()
        assert int(d.timesteps[k]) == t and torch.equal(d.noise[k], n)
        torch.testing.assert_close(noisy[k], ref_noisy(L.scheduler, x[k:k + 1], perturbed[None], [t])[0],
                                   rtol=1e-5, atol=1e-5)
        # the target is the unperturbed noise (or its velocity)
        ac = float(L.scheduler.alphas_cumprod.double()[t])
        want = math.sqrt(ac) * n.double() - math.sqrt(1 - ac) * x[k].double() if v else n.double()
        torch.testing.assert_close(target[k], want, rtol=1e-5, atol=1e-5)


def test_timestep_range():
    seeds = list(range(400))
    x = torch.zeros((len(seeds), 1, 2, 2))
    t = make_losses("--min_timestep", "200", "--max_timestep", "210").draw(x, gens(seeds)).timesteps
    assert set(t.tolist()) == set(range(200, 210))  # [min, max), every value reached
    t = make_losses("--min_timestep", "500", "--max_timestep", "500").draw(x, gens(seeds[:5])).timesteps
    assert t.tolist() == [500] * 5
    t = make_losses("--max_timestep", "3").draw(x, gens(seeds)).timesteps
    assert set(t.tolist()) == {0, 1, 2}
    t = make_losses("--min_timestep", "997").draw(x, gens(seeds)).timesteps
    assert set(t.tolist()) == {997, 998, 999}


# -- loss types ------------------------------------------------------------------------------------

def _pred_target_t():
    g = torch.Generator().manual_seed(8)
    pred, target = torch.randn((3, *SHAPE), generator=g), torch.randn((3, *SHAPE), generator=g)
    return pred, target, torch.tensor([0, 437, 999])


def ref_threshold(sched, schedule, c, scale, t):
    t = torch.as_tensor(t)
    if schedule == "constant":
        return torch.full((len(t),), c * scale, dtype=torch.float64)
    if schedule == "exponential":
        return torch.tensor([c ** (int(s) / N) * scale for s in t], dtype=torch.float64)
    ac = sched.alphas_cumprod.double()[t]
    sigma = ((1 - ac) / ac).sqrt()
    return (1 - c) / (1 + sigma) ** 2 + c


@pytest.mark.parametrize("loss_type,schedule", [
    ("l2", "snr"), ("l1", "snr"),  # the schedule only matters for huber / smooth_l1
    *[(lt, s) for lt in ("huber", "smooth_l1") for s in ("constant", "exponential", "snr")]])
def test_loss_types(loss_type, schedule):
    c, scale = 0.3, 1.7
    L = make_losses("--loss_type", loss_type, "--huber_schedule", schedule, "--huber_c", c,
                    "--huber_scale", scale)
    pred, target, t = _pred_target_t()
    d = losses.Draw(noise=target, input_noise=target, timesteps=t)
    got = L.per_sample_loss(pred, torch.zeros_like(pred), d).double()
    diff = pred.double() - target.double()
    if loss_type == "l2":
        want = diff ** 2
    elif loss_type == "l1":
        want = diff.abs()
    else:
        hc = ref_threshold(L.scheduler, schedule, c, scale, t).view(-1, 1, 1, 1)
        want = 2 * (torch.sqrt(diff ** 2 + hc ** 2) - hc) * (hc if loss_type == "huber" else 1)
    torch.testing.assert_close(got, want.mean(dim=(1, 2, 3)), rtol=1e-5, atol=1e-7)


def test_huber_schedules_end_points():
    """exponential: huber_scale at t=0 falling to huber_c x huber_scale at t=T; snr: near 1 at
    t=0, near huber_c at t=T."""
    L = make_losses("--loss_type", "huber", "--huber_schedule", "exponential", "--huber_c", "0.1",
                    "--huber_scale", "2")
    assert L.huber_threshold(torch.tensor([0, N])).tolist() == pytest.approx([2.0, 0.2])
    L = make_losses("--loss_type", "huber", "--huber_schedule", "snr", "--huber_c", "0.1")
    lo, hi = L.huber_threshold(torch.tensor([0, N - 1])).tolist()
    assert lo > 0.9 and hi == pytest.approx(0.1, abs=0.01)
    assert make_losses().huber_threshold(torch.tensor([5])) is None  # l2


# -- SNR weights -----------------------------------------------------------------------------------

def ref_weight(snr, v, *, min_snr=None, scale_v=False, v_like=None, debiased=False):
    w = torch.ones_like(snr)
    if min_snr:
        w = w * torch.minimum(snr, torch.full_like(snr, min_snr)) / (snr + 1 if v else snr)
    capped = torch.minimum(snr, torch.full_like(snr, 1000.0))
    if scale_v:
        w = w * capped / (capped + 1)
    if v_like:
        w = w + w * (capped + 1) / capped * v_like
    if debiased:
        w = w / (capped + 1) if v else w / capped.sqrt()
    return w


WEIGHT_CASES = [
    ("min_snr eps", False, ["--min_snr_gamma", "5"], dict(min_snr=5)),
    ("min_snr v", True, ["--min_snr_gamma", "5"], dict(min_snr=5)),
    ("scale_v", True, ["--scale_v_pred_loss_like_noise_pred"], dict(scale_v=True)),
    ("v_pred_like", False, ["--v_pred_like_loss", "0.4"], dict(v_like=0.4)),
    ("debiased eps", False, ["--debiased_estimation_loss"], dict(debiased=True)),
    ("debiased v", True, ["--debiased_estimation_loss"], dict(debiased=True)),
    ("min_snr+debiased eps", False, ["--min_snr_gamma", "3", "--debiased_estimation_loss"],
     dict(min_snr=3, debiased=True)),
    ("min_snr+scale_v+debiased v", True, ["--min_snr_gamma", "3", "--scale_v_pred_loss_like_noise_pred",
                                          "--debiased_estimation_loss"],
     dict(min_snr=3, scale_v=True, debiased=True)),
]


@pytest.mark.parametrize("name,v,extra,kw", WEIGHT_CASES, ids=[c[0] for c in WEIGHT_CASES])
def test_snr_weights(name, v, extra, kw):
    L = make_losses(*extra, v=v)
    t = torch.tensor([0, 1, 30, 250, 500, 750, 999])
    loss = torch.linspace(0.5, 2.0, len(t))
    got = L.weight(loss, t).double()
    want = loss.double() * ref_weight(ref_snr(L.scheduler, t), v, **kw)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    # SNR at t=0 is ~1176 (above the 1000 cap) and falls below gamma later: both branches are hit
    snr = ref_snr(L.scheduler, t)
    assert snr[0] > 1000 and snr[-1] < 1


def test_zero_terminal_snr_schedule():
    """The rescaled schedule equals diffusers' rescale_betas_zero_snr (Lin et al. 2023, Alg. 1);
    the model's own scheduler is left as loaded; SNR weights use the rescaled SNR."""
    sched = make_scheduler()
    before = sched.alphas_cumprod.clone()
    L = losses.Losses(make_opts("--zero_terminal_snr", "--min_snr_gamma", "5"), sched, True)
    ref = make_scheduler(rescale_betas_zero_snr=True)
    torch.testing.assert_close(L.scheduler.alphas_cumprod, ref.alphas_cumprod, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(L.scheduler.betas, ref.betas, rtol=1e-5, atol=1e-6)
    assert float(L.scheduler.alphas_cumprod[-1]) == 0.0
    assert float(L.scheduler.alphas_cumprod[0]) == pytest.approx(float(before[0]), rel=1e-6)
    assert torch.equal(sched.alphas_cumprod, before)
    assert float(L.all_snr[-1]) == 0.0
    # v-prediction min-SNR weight at SNR 0 is 0 (not NaN); at t=0 it is gamma/(SNR+1)
    w = L.weight(torch.ones(2), torch.tensor([0, N - 1]))
    snr0 = ref_snr(L.scheduler, [0])[0]
    assert w.tolist() == pytest.approx([5 / (float(snr0) + 1), 0.0])
    # the noisy latent at the last timestep is pure noise
    x, n = latents_for([1]), torch.randn((1, *SHAPE))
    d = losses.Draw(noise=n, input_noise=n, timesteps=torch.tensor([N - 1]))
    torch.testing.assert_close(L.noisy_latents(x, d), n)
    # epsilon model: the min-SNR weight min(SNR, gamma)/SNR is 1 at SNR 0 (its limit), not NaN
    Le = losses.Losses(make_opts("--zero_terminal_snr", "--min_snr_gamma", "5"), make_scheduler(), False)
    assert Le.weight(torch.ones(1), torch.tensor([N - 1])).tolist() == [1.0]


# -- option checks ---------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,message", [
    (["--adaptive_noise_scale", "0.1"], "adaptive_noise_scale requires noise_offset"),
    (["--min_timestep", "600", "--max_timestep", "500"], "min_timestep (600) is larger than max_timestep"),
    (["--v_pred_like_loss", "0.1", "--v_parameterization"], "v_pred_like_loss cannot be used with v_param"),
])
def test_option_combinations_rejected_before_loading(run_script, dataset, tmp_path, monkeypatch,
                                                      extra, message):
    from library.models import loading as models

    def no_loading(*a, **k):
        raise AssertionError("weights loaded before the option check")

    monkeypatch.setattr(models, "load_model_bundle", no_loading)
    rc, out, err = run_script("train_lora", ["--pretrained_model_name_or_path", "tiny-sd15",
                                             "--train_data_dir", dataset, "--resolution", "64",
                                             "--output_dir", tmp_path / "out", "--max_train_steps", "1",
                                             *extra])
    assert rc == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("extra,v,message", [
    (["--scale_v_pred_loss_like_noise_pred"], False, "scale_v_pred_loss_like_noise_pred needs a v-pred"),
    (["--v_pred_like_loss", "0.1"], True, "v_pred_like_loss cannot be used with a v-prediction model"),
    (["--zero_terminal_snr", "--debiased_estimation_loss"], False,
     "debiased_estimation_loss with zero_terminal_snr"),
    (["--zero_terminal_snr", "--v_pred_like_loss", "0.1"], False, "v_pred_like_loss with zero_terminal_snr"),
    (["--max_timestep", "1001"], False, "max_timestep (1001) is above the model's 1000"),
    (["--min_timestep", "1000"], False, "min_timestep (1000) must be below the model's 1000"),
])
def test_model_dependent_combinations_rejected(extra, v, message):
    with pytest.raises(losses.LossOptionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_losses(*extra, v=v)


def test_model_dependent_combinations_accepted():
    make_losses("--scale_v_pred_loss_like_noise_pred", v=True)
    make_losses("--v_pred_like_loss", "0.1", v=False)
    # the terminal timestep is never drawn: finite weights
    L = make_losses("--zero_terminal_snr", "--debiased_estimation_loss", "--max_timestep", "999")
    t = L.draw(torch.zeros((50, 1, 1, 1)), gens(range(50))).timesteps
    assert torch.isfinite(L.weight(torch.ones(50), t)).all()


@pytest.mark.parametrize("args,message", [
    (["--loss_type", "mse"], "is not one of: l2, l1, huber, smooth_l1"),
    (["--huber_schedule", "linear"], "is not one of: constant, exponential, snr"),
    (["--noise_offset", "-0.1"], "out of range"),
    (["--huber_c", "0"], "out of range"),
    (["--max_timestep", "0"], "out of range"),
])
def test_option_values_validated(args, message):
    from library.config.parse import ConfigError

    with pytest.raises(ConfigError, match=message):
        make_opts(*args)


def test_unused_dependent_options_warn(caplog):
    opts = make_opts("--huber_c", "0.2", "--multires_noise_discount", "0.5",
                     "--noise_offset_random_strength", "--ip_noise_gamma_random_strength")
    with caplog.at_level("WARNING", logger="sdtk"):
        losses.check_options(opts)
    text = caplog.text
    for name in ("huber_c", "multires_noise_discount", "noise_offset_random_strength",
                 "ip_noise_gamma_random_strength"):
        assert f"option {name} has no effect here" in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="sdtk"):
        losses.check_options(make_opts("--loss_type", "huber", "--huber_c", "0.2",
                                       "--noise_offset", "0.1", "--noise_offset_random_strength"))
    assert "no effect" not in caplog.text


def test_sd_scripts_config_names_load(tmp_path):
    """An sd-scripts run config with these keys (in its usual tables) loads with their values."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('[model_arguments]\npretrained_model_name_or_path = "tiny-sd15"\n'
                   '[training_arguments]\nnoise_offset = 0.05\nmultires_noise_iterations = 6\n'
                   'multires_noise_discount = 0.3\nmin_snr_gamma = 5\nloss_type = "smooth_l1"\n'
                   'huber_schedule = "exponential"\nhuber_c = 0.1\nzero_terminal_snr = false\n'
                   'ip_noise_gamma = 0.1\ndebiased_estimation_loss = true\n'
                   '[dataset_arguments]\ntrain_data_dir = "data"\nresolution = 64\n'
                   'output_dir = "out"\nmax_train_steps = 1\n')
    o = parse_args("finetune", ["--config", str(cfg)])
    assert (o.noise_offset, o.multires_noise_iterations, o.min_snr_gamma, o.loss_type,
            o.huber_schedule, o.ip_noise_gamma, o.debiased_estimation_loss) == \
        (0.05, 6, 5.0, "smooth_l1", "exponential", 0.1, True)


# -- end to end ------------------------------------------------------------------------------------

VARIANTS_EPS = ["--noise_offset", "0.1", "--noise_offset_random_strength", "--adaptive_noise_scale",
                "0.01", "--multires_noise_iterations", "4", "--ip_noise_gamma", "0.1",
                "--ip_noise_gamma_random_strength", "--min_snr_gamma", "5", "--loss_type", "huber",
                "--huber_schedule", "snr", "--min_timestep", "50", "--max_timestep", "950"]


def test_lora_trains_and_saves_with_variants(train, dataset, tmp_path):
    from tests.conftest import read

    def lora(out, *extra):
        rc, _, err, run = train("train_lora", [
            "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset,
            "--resolution", "64", "--output_dir", out, "--max_train_steps", "2", "--cache_latents",
            "--learning_rate", "1e-3", "--network_dim", "4", *extra])
        assert rc == 0, err[-2000:]
        return run, read(out / "last.safetensors")[0]

    run, tensors = lora(tmp_path / "variants", *VARIANTS_EPS)
    assert run.progress.global_step == 2 and all(math.isfinite(x) for x in run.progress.loss_log)
    assert run.parts.losses.opts.loss_type == "huber"
    base_run, base = lora(tmp_path / "plain")
    assert run.progress.loss_log != base_run.progress.loss_log
    assert any(not torch.equal(tensors[k], base[k]) for k in base if k.endswith("lora_up.weight"))
    # v-prediction model with the v-only options and a zero-terminal-SNR schedule
    vrun, _ = lora(tmp_path / "v", "--pretrained_model_name_or_path", "tiny-sd2", "--zero_terminal_snr",
                   "--min_snr_gamma", "5", "--scale_v_pred_loss_like_noise_pred",
                   "--debiased_estimation_loss", "--loss_type", "smooth_l1", "--huber_schedule",
                   "exponential")
    assert vrun.parts.losses.v_prediction and float(vrun.parts.losses.all_snr[-1]) == 0.0
    assert vrun.progress.global_step == 2 and all(math.isfinite(x) for x in vrun.progress.loss_log)


SPLIT_VARIANTS = ["--noise_offset", "0.1", "--noise_offset_random_strength", "--adaptive_noise_scale",
                  "0.05", "--multires_noise_iterations", "3", "--ip_noise_gamma", "0.2",
                  "--ip_noise_gamma_random_strength", "--loss_type", "huber", "--min_snr_gamma", "5",
                  "--debiased_estimation_loss", "--min_timestep", "100", "--max_timestep", "900",
                  "--max_grad_norm", "0", "--max_train_epochs", "1"]


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    """The two-bucket dataset of tests/training/test_equivalence.py trained with every noise variant as
    batch 2 and as batch 1 x accumulation 2, recording each sample's draws and loss."""
    from library.run.run_state import HOOKS
    from tests.training.test_equivalence import make_two_bucket_dataset, train_args, train_in_process

    data = make_two_bucket_dataset(str(tmp_path_factory.mktemp("twobuckets")))

    def run(name, split):
        records, current = {}, {}
        real_draw, real_psl = losses.Losses.draw, losses.Losses.per_sample_loss

        def before_micro_step(run, epoch, idx):
            current["key"] = [(epoch, i) for i in idx]

        def draw(self, latents, generators):
            d = real_draw(self, latents, generators)
            for k, key in enumerate(current["key"]):
                records[key] = {"noise": d.noise[k].clone(), "input": d.input_noise[k].clone(),
                                "t": int(d.timesteps[k])}
            return d

        def per_sample_loss(self, pred, latents, d, *mask, **target):
            out = real_psl(self, pred, latents, d, *mask, **target)
            for k, key in enumerate(current["key"]):
                records[key]["loss"] = float(out[k])
            return out

        mp = pytest.MonkeyPatch()
        mp.setattr(losses.Losses, "draw", draw)
        mp.setattr(losses.Losses, "per_sample_loss", per_sample_loss)
        try:
            out = str(tmp_path_factory.mktemp(name))
            with HOOKS.add(before_micro_step=before_micro_step):
                res = train_in_process(train_args(data, out, *split, *SPLIT_VARIANTS))
        finally:
            mp.undo()
        return records, res

    return {"bs2": run("bs2", ["--train_batch_size", "2"]),
        "acc2": run("acc2", ["--train_batch_size", "1", "--gradient_accumulation_steps", "2"])}


def test_variants_keep_randomness_per_sample(split_runs):
    """Batch 2 vs batch 1 x accumulation 2 with every noise variant on: each sample gets bit-equal
    noise, perturbation and timestep, the same loss, and the weights agree to float32 noise."""
    from tests.training.test_equivalence import TOL, max_rel_diff

    (a, ra), (b, rb) = split_runs["bs2"], split_runs["acc2"]
    assert sorted(a) == sorted(b) == [(1, i) for i in range(4)]
    for key in a:
        assert torch.equal(a[key]["noise"], b[key]["noise"]), key
        assert torch.equal(a[key]["input"], b[key]["input"]), key
        assert a[key]["t"] == b[key]["t"], key
        assert a[key]["loss"] == pytest.approx(b[key]["loss"], rel=1e-4), key
    # the variants acted: the input noise differs from the target noise, timesteps in range
    assert all(not torch.equal(r["noise"], r["input"]) and 100 <= r["t"] < 900 for r in a.values())
    worst, key = max_rel_diff(ra["tensors"], rb["tensors"])
    assert worst <= TOL, f"{key}: {worst:.2e}"

