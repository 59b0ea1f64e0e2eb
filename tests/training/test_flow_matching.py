"""Flow-matching math of FLUX.1 and SD3.x (library/training/flow_matching.py), each formula against
an independent float64 reference written here from the published formulas (sd-scripts'
flux_train_utils / sd3_train_utils, the SD3 paper, BFL's FLUX sampling), diffusers'
FlowMatchEulerDiscreteScheduler tables as a client reference, the sampler on an analytically
solvable flow, and the laws of the random noise levels by a Kolmogorov-Smirnov bound.

The references recompute each noise level from the variate the module documents (one torch.rand(1)
or torch.randn(1) per sample generator), in Python floats (float64), with the formulas written
out again here rather than imported.
"""
from __future__ import annotations

import math

import pytest
import torch

from library.training import flow_matching as fm
from library.training.flow_matching import FlowOptions

SEEDS = [3, 17, 99, 1234, 5, 2024]
SHAPE = (16, 8, 12)  # C, H, W of a latent: packed sequence length (8/2) * (12/2) = 24


def gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def variates(kind, seeds):
    """The one documented draw of each sample, as Python floats."""
    draw = torch.randn if kind == "normal" else torch.rand
    return [float(draw(1, generator=torch.Generator().manual_seed(s))) for s in seeds]


def sig(x):
    return 1 / (1 + math.exp(-x))


def ref_shift(s, x):
    return s * x / (1 + (s - 1) * x)


def ref_mu(seq_len):
    # the line through (256, 0.5) and (4096, 1.15)
    return 0.5 + (1.15 - 0.5) * (seq_len - 256) / (4096 - 256)


def ref_time_shift(mu, t):
    # e^mu / (e^mu + (1/t - 1)^1), with its limit 0 at t = 0
    return 0.0 if t == 0 else math.exp(mu) / (math.exp(mu) + (1 / t - 1))


def ref_density(scheme, v, mean=0.0, std=1.0, mode_scale=1.29):
    if scheme == "logit_normal":
        return sig(mean + std * v)
    if scheme == "mode":
        return 1 - v - mode_scale * (math.cos(math.pi * v / 2) ** 2 - 1 + v)
    return v


def ref_flux(o, v, seq_len):
    """(sigma, model timestep input) of one FLUX sample, float64."""
    if o.timestep_sampling == "uniform":
        s = v
    elif o.timestep_sampling == "sigmoid":
        s = sig(o.sigmoid_scale * v)
    elif o.timestep_sampling == "shift":
        s = ref_shift(o.discrete_flow_shift, sig(o.sigmoid_scale * v))
    elif o.timestep_sampling == "flux_shift":
        s = ref_time_shift(ref_mu(seq_len), sig(o.sigmoid_scale * v))
    else:  # "sigma": index into the scheduler's table of shifted (1000 - i) / 1000
        u = ref_density(o.weighting_scheme, v, o.logit_mean, o.logit_std, o.mode_scale)
        i = min(int(math.floor(u * 1000)), 999)
        s = ref_shift(o.discrete_flow_shift, (1000 - i) / 1000)
    return s, s


def ref_sd3(o, v):
    u = ref_density(o.weighting_scheme, v, o.logit_mean, o.logit_std, o.mode_scale)
    u = ref_shift(o.training_shift, u)
    lo = o.min_timestep or 0
    hi = 1000 if o.max_timestep is None else o.max_timestep
    t = math.floor(u * (hi - lo) + lo)
    return t / 1000, float(t)


FLUX_CASES = [
    dict(timestep_sampling="uniform"),
    dict(timestep_sampling="sigmoid"),
    dict(timestep_sampling="sigmoid", sigmoid_scale=2.5),
    dict(timestep_sampling="shift", discrete_flow_shift=3.1582),
    dict(timestep_sampling="shift", sigmoid_scale=0.7, discrete_flow_shift=0.5),
    dict(timestep_sampling="flux_shift"),
    dict(timestep_sampling="flux_shift", sigmoid_scale=1.8),
    dict(timestep_sampling="sigma"),
    dict(timestep_sampling="sigma", discrete_flow_shift=1.0),
    dict(timestep_sampling="sigma", weighting_scheme="logit_normal", logit_mean=0.4, logit_std=1.3),
    dict(timestep_sampling="sigma", weighting_scheme="mode", mode_scale=1.29),
    dict(timestep_sampling="sigma", weighting_scheme="mode", mode_scale=-0.8),
]
SD3_CASES = [
    dict(),
    dict(weighting_scheme="logit_normal"),
    dict(weighting_scheme="logit_normal", logit_mean=-0.5, logit_std=0.6, training_shift=3.0),
    dict(weighting_scheme="mode", mode_scale=1.29),
    dict(weighting_scheme="cosmap", training_shift=0.5),
    dict(weighting_scheme="sigma_sqrt", min_timestep=1),
    dict(min_timestep=200, max_timestep=700, training_shift=2.0),
    dict(min_timestep=500, max_timestep=500),
]


@pytest.mark.parametrize("kw", FLUX_CASES)
def test_flux_sigmas_match_the_formulas(kw):
    o = FlowOptions("flux", **kw)
    fm.check_flow_options(o)
    h, w = SHAPE[1:]
    t = fm.sample_timesteps(o, gens(SEEDS), (h, w))
    ref = [ref_flux(o, v, (h // 2) * (w // 2)) for v in variates(fm.variate_kind(o), SEEDS)]
    assert t.sigmas.dtype == torch.float32 and t.sigmas.shape == (len(SEEDS),)
    # float32 of a float64 value: half an ulp
    torch.testing.assert_close(t.sigmas.double(), torch.tensor([r[0] for r in ref], dtype=torch.float64),
                               rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(t.model_timesteps, t.sigmas, rtol=0, atol=0)  # FLUX takes sigma
    assert ((t.sigmas >= 0) & (t.sigmas <= 1)).all()


@pytest.mark.parametrize("kw", SD3_CASES)
def test_sd3_sigmas_match_the_formulas(kw):
    o = FlowOptions("sd3", **kw)
    fm.check_flow_options(o)
    t = fm.sample_timesteps(o, gens(SEEDS), SHAPE[1:])
    ref = [ref_sd3(o, v) for v in variates(fm.variate_kind(o), SEEDS)]
    torch.testing.assert_close(t.sigmas.double(), torch.tensor([r[0] for r in ref], dtype=torch.float64),
                               rtol=1e-7, atol=1e-9)
    # SD3's MMDiT takes the integer timestep 1000 * sigma
    assert t.model_timesteps.tolist() == [r[1] for r in ref]
    lo = o.min_timestep or 0
    hi = 1000 if o.max_timestep is None else o.max_timestep
    assert all(lo <= x <= max(lo, hi - 1) for x in t.model_timesteps.tolist())


def test_variate_kinds():
    assert fm.variate_kind(FlowOptions("flux", timestep_sampling="uniform")) == "uniform"
    for ts in ("sigmoid", "shift", "flux_shift"):
        assert fm.variate_kind(FlowOptions("flux", timestep_sampling=ts)) == "normal"
    for fam in ("flux", "sd3"):
        assert fm.variate_kind(FlowOptions(fam, weighting_scheme="logit_normal")) == "normal"
        for ws in ("uniform", "none", "mode", "cosmap", "sigma_sqrt"):
            assert fm.variate_kind(FlowOptions(fam, weighting_scheme=ws)) == "uniform"


def test_flux_sigma_table_is_diffusers_training_table():
    """timestep_sampling "sigma": the noise levels are the entries of the shifted training table
    of diffusers' FlowMatchEulerDiscreteScheduler(1000, shift) (sd-scripts keeps a copy of it)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    for shift in (1.0, 3.0, 3.1582):
        table = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift).sigmas[:1000]
        o = FlowOptions("flux", timestep_sampling="sigma", discrete_flow_shift=shift)
        u = torch.tensor([0.0, 0.0005, 0.37, 0.5, 0.9999, 0.999999], dtype=torch.float64)
        s, _ = fm.sigmas_from_variates(o, u, 24)
        idx = [0, 0, 370, 500, 999, 999]
        torch.testing.assert_close(s.float(), table[idx], rtol=2e-7, atol=0)


def test_flux_mu_and_time_shift():
    assert fm.flux_mu(256) == pytest.approx(0.5, abs=1e-15)
    assert fm.flux_mu(4096) == pytest.approx(1.15, abs=1e-15)
    for n in (24, 1024, 2304, 8192):
        assert fm.flux_mu(n) == pytest.approx(ref_mu(n), rel=1e-14)
    assert fm.flux_image_seq_len(128, 128) == 4096 and fm.flux_image_seq_len(9, 13) == 24
    t = torch.tensor([0.0, 1e-6, 0.1, 0.5, 0.77, 1.0], dtype=torch.float64)
    for mu in (0.5, 1.15, -0.3):
        got = fm.time_shift(mu, t)
        assert got.tolist() == pytest.approx([ref_time_shift(mu, x) for x in t.tolist()],
                                             rel=1e-13, abs=1e-300)


def test_micro_batch_split_gives_the_same_sigmas():
    """Sample k's noise level depends only on generators[k]: batch 6 = 2 + 4 = 1 x 6."""
    cases = [FlowOptions("flux", **kw) for kw in FLUX_CASES] + [FlowOptions("sd3", **kw) for kw in SD3_CASES]
    for o in cases:
        whole = fm.sample_timesteps(o, gens(SEEDS), SHAPE[1:])
        parts = [fm.sample_timesteps(o, gens(SEEDS[:2]), SHAPE[1:]),
                 fm.sample_timesteps(o, gens(SEEDS[2:]), SHAPE[1:])]
        singles = [fm.sample_timesteps(o, gens([s]), SHAPE[1:]) for s in SEEDS]
        for split in (parts, singles):
            assert torch.equal(whole.sigmas, torch.cat([p.sigmas for p in split]))
            assert torch.equal(whole.model_timesteps, torch.cat([p.model_timesteps for p in split]))


def test_one_draw_per_sample():
    """Each generator advances by exactly one draw, so the trainer's later draws are fixed."""
    for o in (FlowOptions("flux", timestep_sampling="flux_shift"), FlowOptions("sd3")):
        g = gens(SEEDS)
        fm.sample_timesteps(o, g, SHAPE[1:])
        draw = torch.randn if fm.variate_kind(o) == "normal" else torch.rand
        for s, gk in zip(SEEDS, g):
            fresh = torch.Generator().manual_seed(s)
            draw(1, generator=fresh)
            assert torch.equal(torch.rand(3, generator=gk), torch.rand(3, generator=fresh))


def test_noisy_input_and_target():
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn((3, *SHAPE), generator=g)
    noise = torch.randn((3, *SHAPE), generator=g)
    sigmas = torch.tensor([0.0, 0.3, 1.0])
    xt = fm.noisy_input(x0, noise, sigmas)
    for k, s in enumerate(sigmas.tolist()):
        ref = (1 - s) * x0[k].double() + s * noise[k].double()
        torch.testing.assert_close(xt[k].double(), ref, rtol=0, atol=1e-6)
    assert torch.equal(xt[0], x0[0]) and torch.equal(xt[2], noise[2])
    assert torch.equal(fm.flow_target(x0, noise), noise - x0)


def _pred_case():
    g = torch.Generator().manual_seed(11)
    x0, noise, out = (torch.randn((4, *SHAPE), generator=g, dtype=torch.float64) for _ in range(3))
    sigmas = torch.tensor([0.05, 0.3, 0.6, 0.95], dtype=torch.float64)
    return x0, noise, out, sigmas, fm.noisy_input(x0, noise, sigmas)


def ref_weight(scheme, s):
    if scheme == "sigma_sqrt":
        return 1 / (s * s)
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * s + 2 * s * s))
    return 1.0


@pytest.mark.parametrize("scheme", ["uniform", "none", "logit_normal", "mode", "sigma_sqrt", "cosmap"])
def test_prediction_target_and_weight(scheme):
    x0, noise, out, sigmas, xt = _pred_case()
    s4 = sigmas.view(-1, 1, 1, 1)
    # FLUX raw and additive: against noise - x0, unweighted (sd-scripts' formulas)
    p, t, w = fm.prediction_and_target(FlowOptions("flux", model_prediction_type="raw", weighting_scheme=scheme),
                                       out, xt, x0, noise, sigmas)
    assert torch.equal(p, out) and torch.equal(t, noise - x0) and w is None
    p, t, w = fm.prediction_and_target(FlowOptions("flux", model_prediction_type="additive",
                                                   weighting_scheme=scheme), out, xt, x0, noise, sigmas)
    torch.testing.assert_close(p, out + xt, rtol=0, atol=0)
    assert torch.equal(t, noise - x0) and w is None
    # sigma_scaled (FLUX) and SD3: the clean latent the velocity implies, against x0, weighted
    for o in (FlowOptions("flux", model_prediction_type="sigma_scaled", weighting_scheme=scheme),
              FlowOptions("sd3", weighting_scheme=scheme)):
        p, t, w = fm.prediction_and_target(o, out, xt, x0, noise, sigmas)
        torch.testing.assert_close(p, xt - s4 * out, rtol=1e-15, atol=1e-15)
        assert torch.equal(t, x0)
        assert w.tolist() == pytest.approx([ref_weight(scheme, s) for s in sigmas.tolist()], rel=1e-14)
        # l2 of the sigma-scaled prediction = sigma^2 times the velocity loss
        lhs = ((p - t) ** 2).mean(dim=(1, 2, 3))
        rhs = sigmas ** 2 * ((out - (noise - x0)) ** 2).mean(dim=(1, 2, 3))
        torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=0)


def test_the_exact_velocity_has_zero_loss_in_every_parametrisation():
    x0, noise, _, sigmas, xt = _pred_case()
    v = noise - x0
    for o in (FlowOptions("flux", model_prediction_type="raw"),
              FlowOptions("flux", model_prediction_type="sigma_scaled"), FlowOptions("sd3")):
        p, t, _ = fm.prediction_and_target(o, v, xt, x0, noise, sigmas)
        torch.testing.assert_close(p, t, rtol=0, atol=1e-12)


def test_loss_weighting_formulas():
    s = torch.tensor([0.01, 0.25, 0.5, 0.99], dtype=torch.float64)
    for scheme in fm.WEIGHTING_SCHEMES:
        w = fm.loss_weighting(scheme, s)
        assert w.tolist() == pytest.approx([ref_weight(scheme, x) for x in s.tolist()], rel=1e-14)
    # cosmap's weight is the density of the cosine map's sigma: it integrates to 1 over [0, 1]
    n = 20000
    mid = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    assert float(fm.loss_weighting("cosmap", mid).mean()) == pytest.approx(1.0, abs=1e-6)


def test_model_timesteps_per_family():
    s = torch.tensor([0.25, 1.0])
    assert torch.equal(fm.model_timesteps("flux", s), s)
    assert fm.model_timesteps("sd3", s).tolist() == [250.0, 1000.0]
    with pytest.raises(ValueError):
        fm.model_timesteps("sdxl", s)


# -- schedules ------------------------------------------------------------------------------------

def ref_flux_schedule(steps, seq_len, shift=True):
    ts = [1 - k / steps for k in range(steps + 1)]
    return [ref_time_shift(ref_mu(seq_len), t) for t in ts] if shift else ts


def ref_sd3_schedule(steps, s):
    lowest = ref_shift(s, 0.001)
    ts = [1 + (lowest - 1) * k / (steps - 1) for k in range(steps)] if steps > 1 else [1.0]
    return [ref_shift(s, t) for t in ts] + [0.0]


@pytest.mark.parametrize("steps,seq_len", [(1, 256), (4, 1024), (20, 4096), (28, 4096), (8, 24), (30, 9216)])
def test_flux_schedule(steps, seq_len):
    got = fm.flux_schedule(steps, seq_len)
    ref = ref_flux_schedule(steps, seq_len)
    assert len(got) == steps + 1 and got[0] == 1.0 and got[-1] == 0.0
    assert got == pytest.approx(ref, rel=1e-12, abs=1e-15)
    assert all(a > b for a, b in zip(got, got[1:]))
    assert fm.flux_schedule(steps, seq_len, shift=False) == pytest.approx(ref_flux_schedule(steps, seq_len, False),
                                                                         rel=1e-12, abs=1e-15)


def test_flux_schedule_hand_values():
    # 4 steps at 1024 tokens: mu = 0.5 + 0.65 * 768 / 3840 = 0.63; sigma(0.5) = e^0.63 / (e^0.63 + 1)
    got = fm.flux_schedule(4, 1024)
    e = math.exp(0.63)
    assert got[2] == pytest.approx(e / (e + 1), rel=1e-12)
    assert got[1] == pytest.approx(e / (e + 1 / 0.75 - 1), rel=1e-12)
    assert got[3] == pytest.approx(e / (e + 3), rel=1e-12)


@pytest.mark.parametrize("steps,shift", [(1, 3.0), (2, 3.0), (4, 3.0), (28, 3.0), (10, 1.0), (15, 6.0)])
def test_sd3_schedule(steps, shift):
    got = fm.sd3_schedule(steps, shift)
    assert len(got) == steps + 1 and got[0] == pytest.approx(1.0, abs=1e-15) and got[-1] == 0.0
    assert got == pytest.approx(ref_sd3_schedule(steps, shift), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("steps,shift", [(2, 3.0), (4, 3.0), (28, 3.0), (10, 1.0)])
def test_sd3_schedule_is_diffusers_inference_schedule(steps, shift):
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    sched.set_timesteps(steps)
    # diffusers works in float32
    torch.testing.assert_close(torch.tensor(fm.sd3_schedule(steps, shift), dtype=torch.float32),
                               sched.sigmas.float(), rtol=1e-6, atol=1e-7)


# -- the sampler ----------------------------------------------------------------------------------

def exact_velocity(x0, family):
    """The velocity of the straight path through x0 that passes x at sigma: (x - x0) / sigma."""
    def fn(x, t, guidance):
        s = t if family == "flux" else t / 1000
        return (x - x0) / s.view(-1, 1, 1, 1)
    return fn


SCHEDULES = [("flux", fm.flux_schedule(1, 256)), ("flux", fm.flux_schedule(7, 1024)),
             ("flux", fm.flux_schedule(28, 4096)), ("flux", fm.flux_schedule(5, 24, shift=False)),
             ("sd3", fm.sd3_schedule(1)), ("sd3", fm.sd3_schedule(9)), ("sd3", fm.sd3_schedule(28, 1.0)),
             ("flux", [1.0, 0.9, 0.2, 0.0]), ("sd3", [0.7, 0.69, 0.1, 0.0])]


@pytest.mark.parametrize("family,sigmas", SCHEDULES)
def test_euler_reaches_x0_on_a_straight_path(family, sigmas):
    g = torch.Generator().manual_seed(5)
    x0, noise = torch.randn((2, *SHAPE), generator=g), torch.randn((2, *SHAPE), generator=g)
    x_t = fm.noisy_input(x0, noise, torch.full((2,), sigmas[0]))
    out = fm.euler_sample(exact_velocity(x0, family), x_t, sigmas, family=family)
    # each Euler step is exact on a straight path; float32 rounding grows with the steps
    torch.testing.assert_close(out, x0, rtol=0, atol=2e-6 * len(sigmas))
    x0d, noised = x0.double(), noise.double()
    x_td = fm.noisy_input(x0d, noised, torch.full((2,), sigmas[0], dtype=torch.float64))
    out64 = fm.euler_sample(exact_velocity(x0d, family), x_td, sigmas, family=family)
    torch.testing.assert_close(out64, x0.double(), rtol=0, atol=1e-12)
    # stopping early lands on the path at that level
    k = len(sigmas) // 2
    mid = fm.euler_sample(exact_velocity(x0d, family), x_td, sigmas[:k + 1], family=family)
    torch.testing.assert_close(mid, fm.noisy_input(x0d, noised, torch.full((2,), sigmas[k], dtype=torch.float64)),
                               rtol=0, atol=1e-12)


def test_euler_in_bf16_carries_float32():
    g = torch.Generator().manual_seed(9)
    x0, noise = torch.randn((1, *SHAPE), generator=g), torch.randn((1, *SHAPE), generator=g)
    out = fm.euler_sample(exact_velocity(x0, "flux"), noise.bfloat16(), fm.flux_schedule(20, 24), family="flux")
    assert out.dtype == torch.bfloat16
    # the model sees bf16 inputs (relative error 2^-8 per call), the sum stays float32
    assert float((out.float() - x0).abs().max()) < 0.05


def test_cfg_reaches_the_guided_endpoint_and_calls_the_model_as_the_family_does():
    g = torch.Generator().manual_seed(13)
    x0_c, x0_u, noise = (torch.randn((2, *SHAPE), generator=g, dtype=torch.float64) for _ in range(3))
    for family, sigmas in (("sd3", fm.sd3_schedule(6)), ("flux", fm.flux_schedule(6, 24))):
        calls = []

        def cond(x, t, guidance, fn=exact_velocity(x0_c, family)):
            calls.append(("c", t.clone(), guidance))
            return fn(x, t, guidance)

        def uncond(x, t, guidance, fn=exact_velocity(x0_u, family)):
            calls.append(("u", t.clone(), guidance))
            return fn(x, t, guidance)

        scale = 4.5
        out = fm.euler_sample(cond, noise, sigmas, family=family, uncond_fn=uncond, cfg_scale=scale)
        # v_u + s (v_c - v_u) = (x - (x0_u + s (x0_c - x0_u))) / sigma: the straight path to that point
        torch.testing.assert_close(out, x0_u + scale * (x0_c - x0_u), rtol=0, atol=1e-11)
        assert [c[0] for c in calls] == ["c", "u"] * (len(sigmas) - 1)
        unit = 1.0 if family == "flux" else 1000.0
        for k, (_, t, guidance) in enumerate(calls):
            assert t.tolist() == pytest.approx([sigmas[k // 2] * unit] * 2, rel=1e-15)
            assert guidance is None


def test_flux_distilled_guidance_is_an_input_not_a_second_pass():
    seen = []

    def model(x, t, guidance):
        seen.append((t.clone(), guidance.clone()))
        return torch.zeros_like(x)

    x = torch.randn((3, *SHAPE))
    sigmas = fm.flux_schedule(4, 24)
    out = fm.euler_sample(model, x, sigmas, family="flux", guidance=3.5)
    assert torch.equal(out, x) and len(seen) == 4
    for k, (t, guidance) in enumerate(seen):
        assert guidance.tolist() == [3.5] * 3
        assert t.tolist() == pytest.approx([sigmas[k]] * 3, rel=1e-7)
    with pytest.raises(ValueError):
        fm.euler_sample(model, x, sigmas, family="flux", cfg_scale=2.0)


# -- the laws of the draws ------------------------------------------------------------------------

N_DRAWS = 20000
# Dvoretzky-Kiefer-Wolfowitz: P(sup |F_n - F| > eps) <= 2 exp(-2 n eps^2); at 1e-6 false alarms
KS_EPS = math.sqrt(math.log(2 / 1e-6) / (2 * N_DRAWS))


def phi(x):
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def logit(p):
    return math.log(p / (1 - p))


def ks_distance(sample, cdf, cdf_left=None):
    """sup_x |F_n(x) - F(x)|, the supremum taken at each distinct sample value and just below it
    (F(x-) = cdf_left(x); the same as cdf for a continuous law), so ties of a discrete law count
    right."""
    cdf_left = cdf_left or cdf
    xs = sorted(sample)
    n, d, i = len(xs), 0.0, 0
    while i < n:
        j = i
        while j < n and xs[j] == xs[i]:
            j += 1
        d = max(d, abs(j / n - cdf(xs[i])), abs(i / n - cdf_left(xs[i])))
        i = j
    return d


def draws(o):
    t = fm.sample_timesteps(o, gens(range(100000, 100000 + N_DRAWS)), SHAPE[1:])
    return t.sigmas.double().tolist()


def test_sigmoid_sampling_has_the_law_of_sigmoid_of_a_scaled_normal():
    scale = 1.5
    s = draws(FlowOptions("flux", timestep_sampling="sigmoid", sigmoid_scale=scale))
    # P(sigmoid(scale Z) <= x) = Phi(logit(x) / scale)
    assert ks_distance(s, lambda x: phi(logit(x) / scale)) < KS_EPS
    # the bound separates a neighbouring law (scale 1): the test can fail
    assert ks_distance(s, lambda x: phi(logit(x))) > 2 * KS_EPS


def test_logit_normal_has_its_law():
    mean, std = 0.3, 0.8

    def u_below(k):  # P(u < k / 1000), u = sigmoid(mean + std Z)
        return 0.0 if k <= 0 else 1.0 if k >= 1000 else phi((logit(k / 1000) - mean) / std)

    # SD3: sigma = floor(1000 u) / 1000, so P(sigma <= k / 1000) = P(u < (k + 1) / 1000)
    s = draws(FlowOptions("sd3", weighting_scheme="logit_normal", logit_mean=mean, logit_std=std))
    assert ks_distance(s, lambda x: u_below(round(1000 * x) + 1), lambda x: u_below(round(1000 * x))) < KS_EPS
    # the continuous law shifted by 0.25 in logit space is rejected: the test can fail
    assert ks_distance(s, lambda x: phi((logit(min(max(x, 1e-9), 1 - 1e-9)) - mean - 0.25) / std)) > 2 * KS_EPS
    # FLUX "sigma" (no shift): sigma = (1000 - floor(1000 u)) / 1000, so
    # P(sigma <= k / 1000) = P(u >= 1 - k / 1000)
    s = draws(FlowOptions("flux", timestep_sampling="sigma", weighting_scheme="logit_normal",
                          logit_mean=mean, logit_std=std, discrete_flow_shift=1.0))
    assert ks_distance(s, lambda x: 1 - u_below(1000 - round(1000 * x)),
                       lambda x: 1 - u_below(1001 - round(1000 * x))) < KS_EPS
    assert ks_distance(s, lambda x: 1 - u_below(round(1000 * x)),
                       lambda x: 1 - u_below(round(1000 * x) + 1)) > 2 * KS_EPS  # not mirrored


# -- option checks --------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,words", [
    (dict(family="flux", timestep_sampling="logit"), "timestep_sampling"),
    (dict(family="flux", model_prediction_type="v"), "model_prediction_type"),
    (dict(family="sd3", weighting_scheme="snr"), "weighting_scheme"),
    (dict(family="flux", discrete_flow_shift=0.0), "discrete_flow_shift"),
    (dict(family="sd3", training_shift=-1.0), "training_shift"),
    (dict(family="sd3", logit_std=-0.1), "logit_std"),
    (dict(family="flux", weighting_scheme="mode", mode_scale=1.8), "mode_scale"),
    (dict(family="sd3", weighting_scheme="mode", mode_scale=-1.1), "mode_scale"),
    (dict(family="sd3", min_timestep=600, max_timestep=400), "min_timestep"),
    (dict(family="sd3", max_timestep=1001), "max_timestep"),
    (dict(family="sd3", weighting_scheme="sigma_sqrt"), "min_timestep"),
])
def test_bad_options_are_one_line_errors(kw, words):
    with pytest.raises(fm.FlowOptionError) as e:
        fm.check_flow_options(FlowOptions(**kw))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_mode_scale_range_is_where_the_map_stays_in_the_unit_interval():
    u = torch.linspace(0, 1, 10001, dtype=torch.float64)
    lo, hi = fm.MODE_SCALE_RANGE
    for s in (lo, 0.0, 1.29, hi):
        f = fm.mode_density(u, s)
        assert float(f.min()) >= -1e-12 and float(f.max()) <= 1 + 1e-12
        assert bool((f[1:] <= f[:-1] + 1e-12).all())  # monotone: a density
    assert float(fm.mode_density(u, lo - 0.1).max()) > 1  # beyond: indices out of the table
    assert not bool((fm.mode_density(u, hi + 0.2)[1:] <= fm.mode_density(u, hi + 0.2)[:-1]).all())


def test_ignored_options_are_the_ones_the_formulas_do_not_read():
    """An option is reported ignored exactly when changing it changes no sigma, timestep input,
    prediction, target or weight."""
    changed = dict(timestep_sampling=None, sigmoid_scale=2.0, discrete_flow_shift=1.7,
                   model_prediction_type=None, weighting_scheme=None, logit_mean=0.5, logit_std=0.4,
                   mode_scale=0.5, training_shift=2.5, min_timestep=100, max_timestep=900)
    x0, noise, out, sigmas, xt = _pred_case()

    def outputs(o):
        t = fm.sample_timesteps(o, gens(SEEDS), SHAPE[1:])
        p, tg, w = fm.prediction_and_target(o, out, xt, x0, noise, sigmas)
        return [t.sigmas, t.model_timesteps, p, tg, torch.zeros(1) if w is None else w]

    bases = [FlowOptions("flux", timestep_sampling=ts, model_prediction_type=mp, weighting_scheme=ws)
             for ts in fm.TIMESTEP_SAMPLINGS for mp in fm.MODEL_PREDICTION_TYPES
             for ws in ("uniform", "logit_normal", "mode", "cosmap")]
    bases += [FlowOptions("sd3", weighting_scheme=ws) for ws in ("uniform", "logit_normal", "mode", "cosmap")]
    for base in bases:
        ignored = {name for name, _ in fm.ignored_options(base)}
        ref = outputs(base)
        for name, value in changed.items():
            if value is None:
                continue  # a choice: its effect is what sets the others' relevance
            other = outputs(FlowOptions(**{**base.__dict__, name: value}))
            same = all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(ref, other))
            assert same == (name in ignored), (base, name)
    # the choices themselves, where one has no effect
    sd3 = {name for name, _ in fm.ignored_options(FlowOptions("sd3"))}
    assert {"timestep_sampling", "model_prediction_type"} <= sd3
    flux = {name for name, _ in fm.ignored_options(FlowOptions("flux", timestep_sampling="uniform",
                                                                model_prediction_type="raw"))}
    assert "weighting_scheme" in flux


N_LAW = 20000


def test_flux_shift_has_the_law_of_the_shifted_sigmoid():
    """sigma = time_shift(mu, sigmoid(c z)) is increasing in z: P(sigma <= x) = Phi(logit(t(x)) / c)
    with t(x) = x / (e^mu (1 - x) + x) its inverse."""
    c, (h, w) = 1.3, (64, 96)  # L = 32 * 48 = 1536, mu = 0.7167
    e = math.exp(ref_mu((h // 2) * (w // 2)))
    t = fm.sample_timesteps(FlowOptions("flux", timestep_sampling="flux_shift", sigmoid_scale=c),
                            gens(range(300000, 300000 + N_LAW)), (h, w))
    s = t.sigmas.double().tolist()
    assert ks_distance(s, lambda x: phi(logit(x / (e * (1 - x) + x)) / c)) < KS_EPS
    assert ks_distance(s, lambda x: phi(logit(x) / c)) > 2 * KS_EPS  # unshifted: rejected


def test_mode_density_has_its_law():
    """SD3 with the mode density: sigma = floor(1000 f(u)) / 1000 with f decreasing, so
    P(sigma <= k / 1000) = P(f(u) < (k + 1) / 1000) = 1 - f^-1((k + 1) / 1000)."""
    k_s = 1.29

    def f(u):
        return 1 - u - k_s * (math.cos(math.pi * u / 2) ** 2 - 1 + u)

    def f_inv(y):  # bisection on the decreasing f
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) > y else (lo, mid)
        return (lo + hi) / 2

    def below(k):  # P(f(u) < k / 1000)
        return 0.0 if k <= 0 else 1.0 if k >= 1000 else 1 - f_inv(k / 1000)

    t = fm.sample_timesteps(FlowOptions("sd3", weighting_scheme="mode", mode_scale=k_s),
                            gens(range(200000, 200000 + N_LAW)), SHAPE[1:])
    s = t.sigmas.double().tolist()
    assert ks_distance(s, lambda x: below(round(1000 * x) + 1), lambda x: below(round(1000 * x))) < KS_EPS
    assert ks_distance(s, lambda x: x) > 2 * KS_EPS  # uniform: rejected


def test_a_bf16_output_is_scaled_by_float32_sigmas():
    x0, noise, out, sigmas, xt = (a.float() for a in _pred_case())
    p, _, w = fm.prediction_and_target(FlowOptions("sd3"), out.bfloat16(), xt, x0, noise, sigmas)
    assert p.dtype == torch.float32 and w.dtype == torch.float32
    ref = xt.double() - sigmas.double().view(-1, 1, 1, 1) * out.bfloat16().double()
    torch.testing.assert_close(p.double(), ref, rtol=0, atol=1e-5)
