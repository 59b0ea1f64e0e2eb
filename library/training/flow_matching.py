"""Rectified-flow (flow-matching) math of FLUX.1 and SD3.x: training noise levels, inputs, targets,
loss weights, and the Euler sampler. Pure functions on tensors, no model; sd-scripts' option names
and formulas (library/flux_train_utils.py, library/sd3_train_utils.py), docs/FLOW_MATCHING.md.

    check_flow_options(o)                             before any weight is loaded
    t = sample_timesteps(o, generators, latent_hw)    FlowTimesteps: (B,) sigmas and the (B,)
                                                      timestep input of the family's model
    x_t = noisy_input(latents, noise, t.sigmas)       (1 - sigma) * x0 + sigma * noise
    pred, target, weight = prediction_and_target(o, model_output, x_t, latents, noise, t.sigmas)
                                                      per-sample loss = mean(loss(pred, target)) * weight
    sigmas = flux_schedule(steps, image_seq_len) or sd3_schedule(steps, shift)
    x0 = euler_sample(model_fn, x_T, sigmas, family=..., guidance=..., uncond_fn=..., cfg_scale=...)

Sigma is the noise level: x_t = (1 - sigma) * x0 + sigma * noise, sigma = 1 pure noise, 0 clean.
The model predicts the velocity dx_t/dsigma = noise - x0. What the model is given as its timestep
differs by family and is kept explicit (model_timesteps): FLUX takes sigma itself (sd-scripts
passes (1000 * sigma) / 1000), SD3's MMDiT takes 1000 * sigma.

Randomness: a sample's noise level comes from that sample's own generator (seeded by seed, epoch
and the sample's position, as in library/training/losses.py), one draw per sample: torch.rand(1)
or torch.randn(1) (which one: variate_kind). Nothing draws from the global RNG, so a sample's
sigma does not depend on the batch split, the process count or the resume point. The trainer
draws the sample's noise first and then calls this, as losses.py orders noise before timestep.

torch is imported inside the functions, as in losses.py: entry scripts import the training
package before parsing options, and --help should not wait for torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from library.errors import UserError
from library.models.families import registry
from library.models.families.base import SHIFTED_BOUNDED, TIMESTEP_SAMPLING, FlowSpec

FAMILIES = registry.FLOW_FAMILIES
TIMESTEP_SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "flux_shift", "nextdit_shift")
NEXTDIT_MIN_SIGMA = 1e-7  # nextdit_shift's clamp of its uniform draw (sd-scripts' lumina_train_util)
MODEL_PREDICTION_TYPES = ("raw", "additive", "sigma_scaled")
# "uniform" (sd-scripts' default) and "none" are the same: uniform density, weight 1
WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none", "uniform")
NUM_TRAIN_TIMESTEPS = 1000
# FLUX's resolution-dependent shift: mu is linear in the packed image sequence length
FLUX_BASE_SEQ_LEN, FLUX_MAX_SEQ_LEN = 256, 4096
FLUX_BASE_SHIFT, FLUX_MAX_SHIFT = 0.5, 1.15
# the SD3 paper's range of the mode density's scale (f_mode is a monotone map of [0, 1] on it)
MODE_SCALE_RANGE = (-1.0, 2.0 / (math.pi - 2.0))
SD3_SAMPLE_SHIFT = 3.0  # sd-scripts' SD3 sample images (ModelSamplingDiscreteFlow(shift=3.0))


class FlowOptionError(UserError):
    """A flow-matching option value or combination that cannot work; one line naming it."""


@dataclass(frozen=True)
class FlowOptions:
    """The flow-matching options of a run, sd-scripts' names and defaults.

    FLUX reads timestep_sampling, sigmoid_scale, discrete_flow_shift, model_prediction_type, and
    weighting_scheme with logit_mean / logit_std / mode_scale (the density with
    timestep_sampling "sigma"; the loss weight with model_prediction_type "sigma_scaled").
    SD3 reads weighting_scheme, logit_mean, logit_std, mode_scale, training_shift, min_timestep,
    max_timestep (sd-scripts' SD3 trainer has no timestep_sampling or model_prediction_type: its
    prediction is always sigma-scaled against the latents)."""

    family: str
    timestep_sampling: str = "sigma"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 3.0
    model_prediction_type: str = "sigma_scaled"
    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    training_shift: float = 1.0
    min_timestep: int | None = None
    max_timestep: int | None = None


@dataclass
class FlowTimesteps:
    """(B,) float32 noise levels in [0, 1] and the (B,) float32 timestep input of the model."""

    sigmas: torch.Tensor
    model_timesteps: torch.Tensor


def flow_spec(family: str) -> FlowSpec:
    """The family's flow-matching rules (library/models/families/); a family without any is a
    programming error."""
    spec = registry.get(family).flow if family in registry.FAMILIES else None
    if spec is None:
        raise ValueError(f"unknown flow-matching family {family!r}")
    return spec


def _bounded(o: FlowOptions) -> bool:
    """The SD3 rule (training_shift, the timestep bounds, always sigma-scaled), else FLUX.1's
    timestep_sampling rule (FlowSpec.training_draw)."""
    draw = flow_spec(o.family).training_draw
    if draw not in (SHIFTED_BOUNDED, TIMESTEP_SAMPLING):
        raise ValueError(f"{o.family}: unknown training_draw {draw!r}")
    return draw == SHIFTED_BOUNDED


def check_flow_options(o: FlowOptions) -> None:
    """Values that cannot work, as errors before any weight is loaded."""
    bounded = _bounded(o)
    for name, value, allowed in (("timestep_sampling", o.timestep_sampling, TIMESTEP_SAMPLINGS),
                                 ("model_prediction_type", o.model_prediction_type,
                                  MODEL_PREDICTION_TYPES),
                                 ("weighting_scheme", o.weighting_scheme, WEIGHTING_SCHEMES)):
        if value not in allowed:
            raise FlowOptionError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    for name in ("discrete_flow_shift", "training_shift"):
        if not getattr(o, name) > 0:
            raise FlowOptionError(f"{name} must be above 0 (sigma' = s*sigma / (1 + (s-1)*sigma) "
                                  f"leaves [0, 1] otherwise), not {getattr(o, name)}")
    if not o.logit_std >= 0:
        raise FlowOptionError(f"logit_std must be 0 or more, not {o.logit_std}")
    lo, hi = MODE_SCALE_RANGE
    if o.weighting_scheme == "mode" and not lo <= o.mode_scale <= hi:
        raise FlowOptionError(f"mode_scale must be in [{lo:g}, {hi:.4f}] (the SD3 paper's range, "
                              f"where the mode density maps [0, 1] onto itself), not {o.mode_scale}")
    if bounded:
        t_min, t_max = sd3_timestep_range(o)
        if not 0 <= t_min <= t_max <= NUM_TRAIN_TIMESTEPS:
            raise FlowOptionError(f"min_timestep ({t_min}) and max_timestep ({t_max}) must satisfy "
                                  f"0 <= min_timestep <= max_timestep <= {NUM_TRAIN_TIMESTEPS}")
        if o.weighting_scheme == "sigma_sqrt" and t_min == 0:
            raise FlowOptionError("weighting_scheme sigma_sqrt weights the loss by sigma^-2, "
                                  f"infinite at {registry.get(o.family).title}'s timestep 0 (drawn once in 1000 "
                                  "samples): "
                                  "set min_timestep to 1 or more")


def ignored_options(o: FlowOptions) -> list[tuple[str, str]]:
    """(option, why) for each flow-matching option these settings do not read (sd-scripts reads
    them no more): the trainer warns for those the user set."""
    out = []
    flux = not _bounded(o)  # FLUX.1's timestep_sampling rule
    title = registry.get(o.family).title
    density = not flux or o.timestep_sampling == "sigma"  # weighting_scheme's density is drawn
    if not flux:
        for name in ("timestep_sampling", "sigmoid_scale", "discrete_flow_shift", "model_prediction_type"):
            out.append((name, f"{title} training does not use it (sd-scripts' SD3 trainer has no such "
                              "option; its timestep shift is training_shift)"))
    else:
        for name in ("training_shift", "min_timestep", "max_timestep"):
            out.append((name, f"{title} training does not use it (sd-scripts' FLUX trainer neither)"))
        if o.timestep_sampling not in ("sigmoid", "shift", "flux_shift"):
            out.append(("sigmoid_scale", f"timestep_sampling is {o.timestep_sampling}, not sigmoid, "
                                         "shift or flux_shift"))
        if o.timestep_sampling not in ("shift", "sigma"):
            out.append(("discrete_flow_shift", f"timestep_sampling is {o.timestep_sampling}, not "
                                               "shift or sigma"))
        if not density and o.model_prediction_type != "sigma_scaled" and not flow_spec(o.family).weights_raw_loss:
            out.append(("weighting_scheme", f"timestep_sampling is {o.timestep_sampling} and "
                                            f"model_prediction_type {o.model_prediction_type}"))
    if not (density and o.weighting_scheme == "logit_normal"):
        out += [(name, "no logit_normal density is drawn") for name in ("logit_mean", "logit_std")]
    if not (density and o.weighting_scheme == "mode"):
        out.append(("mode_scale", "no mode density is drawn"))
    return out


def sd3_timestep_range(o: FlowOptions) -> tuple[int, int]:
    t_min = 0 if o.min_timestep is None else int(o.min_timestep)
    t_max = NUM_TRAIN_TIMESTEPS if o.max_timestep is None else int(o.max_timestep)
    return t_min, t_max


# -- the formulas ---------------------------------------------------------------------------------

def shift_sigmas(sigmas, shift: float):
    """The discrete-flow shift: s * sigma / (1 + (s - 1) * sigma) (s > 1: noisier)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flux_mu(image_seq_len: int, base_shift: float = FLUX_BASE_SHIFT,
            max_shift: float = FLUX_MAX_SHIFT) -> float:
    """FLUX's shift mu: linear in the packed sequence length through (256, base_shift) and
    (4096, max_shift) (sd-scripts' get_lin_function), extrapolated beyond."""
    m = (max_shift - base_shift) / (FLUX_MAX_SEQ_LEN - FLUX_BASE_SEQ_LEN)
    return base_shift + m * (image_seq_len - FLUX_BASE_SEQ_LEN)


def flux_image_seq_len(latent_h: int, latent_w: int) -> int:
    """Tokens of a FLUX latent packed into 2x2 patches."""
    return (latent_h // 2) * (latent_w // 2)


def time_shift(mu: float, t):
    """FLUX's time_shift(mu, 1, t) = e^mu / (e^mu + 1/t - 1), written as e^mu t / (e^mu t + 1 - t),
    equal for t in (0, 1] and 0 at t = 0 (where 1/t is infinite)."""
    e = math.exp(mu)
    return e * t / (e * t + (1 - t))


def mode_density(u, mode_scale: float):
    """The SD3 paper's mode sampling: 1 - u - s * (cos^2(pi u / 2) - 1 + u), u ~ U[0, 1)."""
    return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)


def loss_weighting(weighting_scheme: str, sigmas):
    """Per-sample loss weight: sigma_sqrt sigma^-2, cosmap 2 / (pi (1 - 2 sigma + 2 sigma^2)),
    any other scheme 1."""
    if weighting_scheme == "sigma_sqrt":
        return sigmas ** -2.0
    if weighting_scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))
    return torch.ones_like(sigmas)


def model_timesteps(family: str, sigmas):
    """The timestep input of the family's model for noise levels sigma (FlowSpec.timestep_scale):
    FLUX sigma itself (in [0, 1]), SD3 1000 * sigma."""
    scale = flow_spec(family).timestep_scale
    return sigmas if scale == 1 else sigmas * scale


# -- training draws -------------------------------------------------------------------------------

def variate_kind(o: FlowOptions) -> str:
    """Which one draw a sample's noise level takes from its generator: "normal" (torch.randn(1))
    or "uniform" (torch.rand(1))."""
    flux = not _bounded(o)
    if flux and o.timestep_sampling in ("sigmoid", "shift", "flux_shift"):
        return "normal"
    if flux and o.timestep_sampling in ("uniform", "nextdit_shift"):
        return "uniform"
    return "normal" if o.weighting_scheme == "logit_normal" else "uniform"


def sigmas_from_variates(o: FlowOptions, v, image_seq_len: int):
    """(sigmas, model timesteps), float64 (B,), from the (B,) float64 variates v of variate_kind;
    image_seq_len: the packed sequence length (flux_shift's mu)."""
    v = v.double()
    flux = not _bounded(o)
    if flux and o.timestep_sampling != "sigma":
        ts = o.timestep_sampling
        if ts == "uniform":
            sigmas = v
        elif ts == "nextdit_shift":  # Lumina 2's: the uniform draw, time-shifted by the sequence's mu
            sigmas = time_shift(flux_mu(image_seq_len), torch.clamp(v, min=NEXTDIT_MIN_SIGMA))
        else:
            sigmas = torch.sigmoid(o.sigmoid_scale * v)
            if ts == "shift":
                sigmas = shift_sigmas(sigmas, o.discrete_flow_shift)
            elif ts == "flux_shift":
                sigmas = time_shift(flux_mu(image_seq_len), sigmas)
        return sigmas, sigmas
    # the density of weighting_scheme (SD3's sampling; FLUX's timestep_sampling "sigma")
    if o.weighting_scheme == "logit_normal":
        u = torch.sigmoid(o.logit_mean + o.logit_std * v)
    elif o.weighting_scheme == "mode":
        u = mode_density(v, o.mode_scale)
    else:
        u = v
    n = NUM_TRAIN_TIMESTEPS
    if flux:
        # an index into the shifted training table of FlowMatchEulerDiscreteScheduler(1000,
        # discrete_flow_shift): entry i is the shifted (1000 - i) / 1000; u = 1 (the mode
        # density's image of u = 0) would index past its end in sd-scripts
        index = torch.clamp(torch.floor(u * n), 0, n - 1)
        sigmas = shift_sigmas((n - index) / n, o.discrete_flow_shift)
        return sigmas, sigmas
    # SD3: training_shift on u, then an integer timestep in [min_timestep, max_timestep)
    t_min, t_max = sd3_timestep_range(o)
    u = shift_sigmas(u, o.training_shift)
    index = torch.floor(u * (t_max - t_min) + t_min)
    if t_max > t_min:
        index = torch.clamp(index, t_min, t_max - 1)
    return index / n, index


def draw_variates(o: FlowOptions, generators):
    """(B,) float32: one draw from each sample's own generator."""
    draw = torch.randn if variate_kind(o) == "normal" else torch.rand
    return torch.cat([draw(1, generator=g) for g in generators])


def sample_timesteps(o: FlowOptions, generators, latent_hw: tuple[int, int], device=None) -> FlowTimesteps:
    """The noise levels of a micro-batch, sample k drawn only from generators[k]; latent_hw: the
    (unpacked) latent height and width, for flux_shift. Computed in float64, returned float32."""
    sigmas, t = sigmas_from_variates(o, draw_variates(o, generators), flux_image_seq_len(*latent_hw))
    return FlowTimesteps(sigmas.to(device=device, dtype=torch.float32),
                         t.to(device=device, dtype=torch.float32))


def _per_sample(sigmas, like):
    """sigmas (B,) shaped to broadcast over ``like``; never rounded to a lower precision than
    their own (a bf16 model output times float32 sigmas is float32, as in sd-scripts)."""
    dtype = torch.promote_types(sigmas.dtype, like.dtype)
    return sigmas.to(device=like.device, dtype=dtype).view(-1, *([1] * (like.dim() - 1)))


def noisy_input(latents, noise, sigmas):
    """x_t = (1 - sigma) * x0 + sigma * noise, sigma per sample. (sd-scripts' ip_noise_gamma for
    FLUX: pass noise + gamma * xi here and the plain noise to the target.)"""
    s = _per_sample(sigmas, latents)
    return (1 - s) * latents + s * noise


def flow_target(latents, noise):
    """The velocity dx_t/dsigma = noise - x0."""
    return noise - latents


def prediction_and_target(o: FlowOptions, model_output, noisy, latents, noise, sigmas):
    """(prediction, target, (B,) weight or None) that the loss compares, by family and
    model_prediction_type:
      FLUX raw          output,                   noise - x0, no weight (Anima: loss_weighting,
                                                              FlowSpec.weights_raw_loss)
      FLUX additive     output + x_t,             noise - x0, no weight (sd-scripts' formula)
      FLUX sigma_scaled x_t - sigma * output,     x0,         loss_weighting(weighting_scheme)
      SD3               x_t - sigma * output,     x0,         loss_weighting(weighting_scheme)
    x_t - sigma * v is the clean latent a velocity v implies, so the sigma-scaled loss is the
    velocity loss times sigma^2 (for l2). sd-scripts' FLUX trainer compares sigma_scaled with
    noise - x0 instead, whose minimiser is no velocity (docs/FLOW_MATCHING.md)."""
    if _bounded(o) or o.model_prediction_type == "sigma_scaled":
        s = _per_sample(sigmas, model_output)
        return model_output * (-s) + noisy, latents, loss_weighting(o.weighting_scheme, sigmas)
    if o.model_prediction_type == "additive":
        return model_output + noisy, flow_target(latents, noise), None
    weight = loss_weighting(o.weighting_scheme, sigmas) if flow_spec(o.family).weights_raw_loss else None
    return model_output, flow_target(latents, noise), weight


# -- sampling -------------------------------------------------------------------------------------

def flux_schedule(num_steps: int, image_seq_len: int, shift: bool = True,
                  base_shift: float = FLUX_BASE_SHIFT, max_shift: float = FLUX_MAX_SHIFT) -> list[float]:
    """num_steps + 1 noise levels from 1 to 0: linear, then (shift) time_shift with the mu of
    the packed sequence length (sd-scripts' get_schedule, as its samples use it for dev and
    schnell)."""
    t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
    if shift:
        t = time_shift(flux_mu(image_seq_len, base_shift, max_shift), t)
    return t.tolist()


def sd3_schedule(num_steps: int, shift: float = SD3_SAMPLE_SHIFT) -> list[float]:
    """num_steps + 1 noise levels: num_steps evenly spaced from 1 to the training table's lowest
    level shift(1/1000), each shifted, then 0 (sd-scripts' get_all_sigmas, diffusers'
    FlowMatchEulerDiscreteScheduler.set_timesteps; the low end is thus shifted twice)."""
    lowest = shift_sigmas(1 / NUM_TRAIN_TIMESTEPS, shift)
    t = torch.linspace(1, lowest, num_steps, dtype=torch.float64)
    return shift_sigmas(t, shift).tolist() + [0.0]


def linear_shift_schedule(num_steps: int, shift: float) -> list[float]:
    """num_steps + 1 noise levels: linspace(1, 0), each shifted (sd-scripts' anima_train_utils
    do_sample: the ends stay 1 and 0)."""
    return shift_sigmas(torch.linspace(1, 0, num_steps + 1, dtype=torch.float64), shift).tolist()


def euler_sample(model_fn, x, sigmas, *, family: str, guidance: float | None = None,
                 uncond_fn=None, cfg_scale: float = 1.0, cfg_trunc_ratio: float | None = None,
                 renorm_cfg: float | None = None):
    """Integrate dx/dsigma = v from sigmas[0] to sigmas[-1] with Euler steps:
    x <- x + (sigma_next - sigma) * v(x, sigma).

    model_fn(x, timesteps, guidance) -> v: timesteps (B,) the family's model input
    (model_timesteps), guidance (B,) filled with ``guidance`` (FLUX dev's distilled guidance
    input) or None. With cfg_scale != 1, uncond_fn (same signature, the negative prompt) is called
    too and v = v_uncond + cfg_scale * (v_cond - v_uncond) (classifier-free guidance; SD3, or FLUX
    with a negative prompt), shaped as ``cfg_shaped`` says (``cfg_trunc_ratio``, ``renorm_cfg``:
    Lumina 2). x is carried in float32 and handed to the model in its own dtype."""
    if cfg_scale != 1.0 and uncond_fn is None:
        raise ValueError("cfg_scale other than 1 needs uncond_fn")
    dtype, b = x.dtype, x.shape[0]
    acc = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    g = None if guidance is None else torch.full((b,), float(guidance), dtype=dtype, device=x.device)
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        xin = acc.to(dtype)
        t = model_timesteps(family, torch.full((b,), float(s), dtype=dtype, device=x.device))
        v = model_fn(xin, t, g).to(acc.dtype)
        if cfg_scale != 1.0 and (cfg_trunc_ratio is None or 1.0 - float(s) < cfg_trunc_ratio):
            v = cfg_shaped(v, uncond_fn(xin, t, g).to(acc.dtype), cfg_scale, renorm_cfg)
        acc = acc + (float(s_next) - float(s)) * v
    return acc.to(dtype)


def cfg_shaped(v_cond, v_uncond, scale: float, renorm_cfg: float | None = None):
    """Classifier-free guidance v_u + scale (v_c - v_u); with ``renorm_cfg`` > 0 each sample's
    guided velocity is scaled down to renorm_cfg x ||v_c|| where its norm (over all its elements)
    reaches that (sd-scripts' Lumina 2 ``renorm_cfg``; a norm is the same for the velocity and its
    negation, so the convention of the sign does not matter)."""
    v = v_uncond + (v_cond - v_uncond) * scale
    if not renorm_cfg or renorm_cfg <= 0:
        return v
    dims = tuple(range(1, v.ndim))
    cap = torch.linalg.vector_norm(v_cond, dim=dims, keepdim=True) * float(renorm_cfg)
    norm = torch.linalg.vector_norm(v, dim=dims, keepdim=True)
    return torch.where(norm >= cap, v * (cap / norm.clamp_min(torch.finfo(norm.dtype).tiny)), v)
