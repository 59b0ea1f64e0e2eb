"""The losses of a flow-matching family (FLUX.1), behind the interface the batch loss calls on
library/training/losses.py's ``Losses``: ``draw`` (per-sample noise, then the sample's noise
level, then FLUX.1's ip_noise_gamma perturbation xi, each from the sample's own generator),
``noisy_latents`` (x_t = (1 - sigma) x0 + sigma (noise + gamma xi), sd-scripts'
flux_train_utils; the target stays noise - x0), ``per_sample_loss`` (prediction and target by
model_prediction_type, the elementwise loss, masks, the scheme's per-sample weight). The formulas are library/training/flow_matching.py's.

    losses = losses_for(opts, bundle)      FlowLosses for FLUX.1, the DDPM Losses otherwise
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from library.config import method_kinds
from library.config.parse import required
from library.models import flow_family
from library.models.families import registry
from library.models.families.base import SHIFTED_BOUNDED
from library.training import flow_matching, network_options
from library.training.losses import Draw, Losses, apply_masked_loss, elementwise_loss

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")


@dataclass
class FlowDraw(Draw):
    """Draw plus the (B,) float32 noise levels; ``timesteps`` is the model's timestep input."""

    sigmas: torch.Tensor | None = None


def losses_for(opts: Options, bundle):
    """The run's losses: flow matching for a FLUX.1 bundle, else the DDPM noise schedule's."""
    if registry.of(bundle).flow is not None:
        return FlowLosses(opts, flow_options(opts, bundle.family))
    return Losses(opts, bundle.noise_scheduler, bundle.v_parameterization)


class FlowLosses:
    """Noise levels, noisy input and loss of one flow-matching run (FlowOptions ``flow``)."""

    v_prediction = False

    def __init__(self, opts: Options, flow: flow_matching.FlowOptions):
        flow_matching.check_flow_options(flow)
        self.opts = opts
        self.flow = flow

    def draw(self, latents, generators) -> FlowDraw:
        """Sample k's noise (randn of its latent's shape) and then its noise level, both from
        generators[k] only (noise before the level, as losses.py orders noise before timestep)."""
        c, h, w = latents.shape[1:]
        noise = torch.stack([torch.randn((c, h, w), generator=g) for g in generators])
        t = flow_matching.sample_timesteps(self.flow, generators, (h, w))
        input_noise = noise
        gamma = self.opts.ip_noise_gamma
        # (SD3: no effect, as sd-scripts; check_options)
        if gamma and flow_matching.flow_spec(self.flow.family).input_perturbation:
            input_noise = torch.stack([noise[k] + self._ip_strength(gamma, g) * torch.randn((c, h, w), generator=g)
                                       for k, g in enumerate(generators)])
        dev = latents.device
        return FlowDraw(noise.to(dev), input_noise.to(dev), t.model_timesteps.to(dev), t.sigmas.to(dev))

    def _ip_strength(self, gamma: float, g) -> float:
        """ip_noise_gamma's strength for one sample: gamma, or with ip_noise_gamma_random_strength
        u gamma, u ~ U[0, 1) from the sample's generator (sd-scripts: one u per batch)."""
        if self.opts.ip_noise_gamma_random_strength:
            return float(torch.rand(1, generator=g)) * gamma
        return gamma

    def fixed_draw(self, noise, count: int) -> FlowDraw:
        """The validation's draw (library/training/validation.py): the given (count, C, h, w)
        noise at ``count`` fixed noise levels, the midpoints of equal slices of the training's
        range: FLUX.1 sigma = (k + 1/2) / count; SD3 (its timestep bounds: FlowSpec.training_draw)
        the integer timesteps of the midpoints of [min_timestep, max_timestep) (the SD rule),
        sigma = t / 1000."""
        if flow_matching.flow_spec(self.flow.family).training_draw == SHIFTED_BOUNDED:
            lo, hi = flow_matching.sd3_timestep_range(self.flow)
            ts = [hi] * count if hi <= lo else \
                [min(hi - 1, lo + int((k + 0.5) * (hi - lo) / count)) for k in range(count)]
            sigmas = torch.tensor(ts, dtype=torch.float64) / flow_matching.NUM_TRAIN_TIMESTEPS
        else:
            sigmas = (torch.arange(count, dtype=torch.float64) + 0.5) / count
        t = flow_matching.model_timesteps(self.flow.family, sigmas)
        dev = noise.device
        return FlowDraw(noise, noise, t.to(dev, torch.float32), sigmas.to(dev, torch.float32))

    def noisy_latents(self, latents, d: FlowDraw):
        return flow_matching.noisy_input(latents, d.input_noise, d.sigmas)

    def target(self, latents, d: FlowDraw):
        """What a raw prediction is compared with: the velocity noise - x0."""
        return flow_matching.flow_target(latents, d.noise)

    def huber_threshold(self, sigmas):
        """sd-scripts' get_huber_threshold_if_needed at its flow timesteps t = 1000 sigma: (B,)
        huber_c x huber_scale (constant) or exp(-alpha t) x huber_scale with alpha = -ln(huber_c)
        / 1000, i.e. huber_c^sigma x huber_scale (exponential); None for l2 / l1."""
        o = self.opts
        if o.loss_type not in ("huber", "smooth_l1"):
            return None
        if o.huber_schedule == "constant":
            return torch.full(sigmas.shape, o.huber_c * o.huber_scale, device=sigmas.device)
        alpha = -math.log(o.huber_c) / flow_matching.NUM_TRAIN_TIMESTEPS
        return torch.exp(-alpha * flow_matching.NUM_TRAIN_TIMESTEPS * sigmas.float()) * o.huber_scale

    def per_sample_loss(self, pred, latents, d: FlowDraw, mask=None, target=None):
        """(B,) loss of each sample: prediction and target by model_prediction_type, the
        elementwise loss (huber / smooth_l1: at huber_threshold), times the mask, averaged per
        sample, times the scheme's weight."""
        noisy = self.noisy_latents(latents, d)
        p, t, weight = flow_matching.prediction_and_target(self.flow, pred.float(), noisy.float(),
                                                           latents.float(), d.noise.float(), d.sigmas)
        if target is not None:
            t = target
        loss = elementwise_loss(p, t.float(), self.opts.loss_type, self.huber_threshold(d.sigmas))
        if mask is not None:
            loss = apply_masked_loss(loss, mask)
        loss = loss.mean(dim=(1, 2, 3))
        return loss if weight is None else loss * weight.to(loss.device, loss.dtype)


def flow_options(opts: Options, family: str):
    """The run's FlowOptions (library/training/flow_matching.py)."""
    # SD3 reads the timestep bounds (FLUX.1 ignores them)
    sd3 = flow_matching.flow_spec(family).training_draw == SHIFTED_BOUNDED
    def value(name):
        return registry.flow_option(opts, family, name)

    return flow_matching.FlowOptions(family=family, timestep_sampling=value("timestep_sampling"),
                       sigmoid_scale=opts.sigmoid_scale, discrete_flow_shift=value("discrete_flow_shift"),
                       model_prediction_type=value("model_prediction_type"),
                       weighting_scheme=opts.weighting_scheme, logit_mean=opts.logit_mean,
                       logit_std=opts.logit_std, mode_scale=opts.mode_scale,
                       training_shift=opts.training_shift,
                       min_timestep=opts.min_timestep if sd3 else None,
                       max_timestep=opts.max_timestep if sd3 else None)


# SD options that sd-scripts' FLUX.1 / SD3 scripts accept and ignore (the kohya_ss GUI writes them
# for every model type): a warning, as there
NO_EFFECT = {
    "clip_skip": "FLUX.1 reads CLIP-L's pooled output and T5's last layer, SD3 the CLIP encoders' "
                 "penultimate layers, as sd-scripts' flux_train / sd3_train, which ignore it",
    "max_token_length": "CLIP reads 77 tokens; T5's length is t5xxl_max_token_length (sd-scripts' "
                        "flux_train / sd3_train ignore max_token_length)",
    "min_snr_gamma": "an SNR weighting of the DDPM schedule (use weighting_scheme); sd-scripts' "
                     "FLUX.1 / SD3 trainers skip it",
    **{name: "an SNR weighting of the DDPM schedule; sd-scripts' FLUX.1 / SD3 trainers skip it "
             "(their post_process_loss returns the loss unchanged)"
       for name in ("scale_v_pred_loss_like_noise_pred", "v_pred_like_loss", "debiased_estimation_loss")},
    "xformers": "the transformer attends with SDPA, as sd-scripts' FLUX.1 / SD3 models, which ignore it",
    "noise_offset": "sd-scripts' FLUX.1 / SD3 trainers draw plain Gaussian noise",
    "adaptive_noise_scale": "sd-scripts' FLUX.1 / SD3 trainers draw plain Gaussian noise",
    "multires_noise_iterations": "sd-scripts' FLUX.1 / SD3 trainers draw plain Gaussian noise",
}
def with_family_network(opts: Options, method_name: str):
    """train_lora with network_module unset on a FLUX.1 / SD3 model: the family's own LoRA module
    (train_lora.py is one entry for every family, as sd-scripts' flux_train_network.py /
    sd3_train_network.py default to theirs); an explicit module stays as given (check_options
    refuses one that cannot target the family)."""
    if not method_kinds.get(method_name).trains_network or "network_module" in opts.given:
        return opts
    fam = flow_family.family_before_loading(opts.pretrained_model_name_or_path)
    if fam is None:
        return opts
    module = registry.get(fam).lora_module
    if module != opts.network_module:
        logger.info("network_module: unset; the %s model trains with %s", registry.get(fam).title, module)
        return opts.replace(network_module=module)
    return opts


def check_options(opts: Options, method_name: str) -> str | None:
    """Before any weight loads: with an SD model no FLUX option may be given; with a FLUX.1
    model every option the run sets must be one this family honours. Returns the family (None:
    SD, decided when the weights load)."""
    src = required(opts.pretrained_model_name_or_path, "pretrained_model_name_or_path")
    fam = flow_family.family_before_loading(src)
    kind = method_kinds.get(method_name)
    if opts.model_type:
        _check_model_type(opts.model_type, fam, src)
    if fam is None:
        for name in flow_family.FLOW_OPTIONS:
            if name in opts.given and flow_family._is_set(opts, name):
                raise flow_family.FlowFamilyError(f"{name}: an option of {registry.titles(flow=True, option=name)} "
                                                  f"models; {src} is not one")
        if kind.trains_network:
            if opts.network_module in network_options.DIT_NETWORK_MODULES:
                fams, what, _ = network_options.DIT_NETWORK_MODULES[opts.network_module]
                titles = " / ".join(registry.get(f).title for f in fams)
                raise flow_family.FlowFamilyError(f"network_module {opts.network_module}: the {what} of "
                                                  f"{titles} models; {src} is not one")
        return None
    family = registry.get(fam)
    what = family.title
    if not kind.flow_families:
        raise flow_family.FlowFamilyError(f"{src} is a {what} model ({fam}): train_lora, train_dreambooth and "
                                          f"finetune train it; this trainer's {method_name} does not train "
                                          f"{what} yet")
    if kind.trains_network:
        _check_network(opts, fam, src)
    if "CLIP-G" not in family.text_encoder_names and opts.clip_g:
        raise flow_family.FlowFamilyError(f"clip_g: SD3's CLIP-G; {src} is a {what} model "
                                          f"({' and '.join(family.text_encoder_names)})")
    for name, why in {**flow_family.UNSUPPORTED, **registry.foreign_options(family), **family.unsupported}.items():
        if flow_family._is_set(opts, name):
            raise flow_family.FlowFamilyError(f"{name}: not with the {what} model {src}: {why}")
    warned = set()  # one "no effect" line per option
    for name, why in {**NO_EFFECT, **family.no_effect}.items():
        if flow_family._is_set(opts, name) and name not in family.honours:
            logger.warning("option %s has no effect with the %s model (%s)", name, what, why)
            warned.add(name)
    if not opts.sdpa and not opts.xformers:  # (xformers turns sdpa off: warned above)
        logger.warning("option sdpa = false has no effect with the %s model (the transformer attends "
                       "with SDPA, as sd-scripts' FLUX.1 / SD3 models, which ignore it)", what)
    if family.autoencoder_option == "vae" and "ae" not in family.unsupported:  # SD3's file, ae accepted too
        _check_sd3_ae(opts)
    if opts.loss_type in ("huber", "smooth_l1") and opts.huber_schedule not in flow_family.HUBER_SCHEDULES:
        raise flow_family.FlowFamilyError(
            f"huber_schedule {opts.huber_schedule}: loss_type {opts.loss_type} with the {what} model takes "
            "huber_schedule constant or exponential (snr is the DDPM schedule's SNR, which a flow model "
            "has not; sd-scripts stops on it too)")
    if kind.trains_model and (opts.save_model_as or "safetensors") != "safetensors":
        raise flow_family.FlowFamilyError(f"save_model_as {opts.save_model_as}: a {what} model is saved "
                              "in the layout it was loaded from (save_model_as = \"safetensors\")")
    if os.path.isfile(os.path.expanduser(src)):
        for name in family.single_file_parts:
            value = getattr(opts, name)
            if not value:
                raise flow_family.FlowFamilyError(f"{name}: required with a single-file {what} transformer "
                                      f"({src}); give the {name} file")
            if not os.path.exists(os.path.expanduser(value)):
                raise flow_family.FlowFamilyError(f"{name}: no such file or directory: {value}")
    flow_family.check_sources(opts, fam)
    flow = flow_options(opts, fam)
    flow_matching.check_flow_options(flow)
    for name, why in flow_matching.ignored_options(flow):
        if name in opts.given and name not in warned:
            logger.warning("option %s has no effect here (%s)", name, why)
    return fam


def _check_model_type(model_type: str, fam: str | None, src: str) -> None:
    """sd-scripts' model_type names the family the weights must be (one line before loading)."""
    types = {f.model_type: f for f in registry.FAMILIES.values() if f.model_type}
    if model_type not in types:
        raise flow_family.FlowFamilyError(f"model_type {model_type}: not a model type of this toolkit "
                                          f"({', '.join(types)})")
    want = types[model_type]
    if fam is None:
        raise flow_family.FlowFamilyError(f"model_type {model_type}: {src} is not a {want.title} model")
    if fam != want.name:
        raise flow_family.FlowFamilyError(f"model_type {model_type}: {src} is a {registry.get(fam).title} model, "
                                          f"not {want.title} (the family comes from the weights)")


def _check_sd3_ae(opts: Options) -> None:
    """SD3's autoencoder file is sd-scripts' vae (ae, FLUX.1's name, is accepted too): one file."""
    if opts.vae and not os.path.isfile(os.path.expanduser(opts.vae)):
        raise flow_family.FlowFamilyError(f"vae: no such file: {opts.vae} (SD3's autoencoder file)")
    if opts.vae and opts.ae and os.path.expanduser(opts.vae) != os.path.expanduser(opts.ae):
        raise flow_family.FlowFamilyError(f"vae ({opts.vae}) and ae ({opts.ae}) both name SD3's "
                                          "autoencoder file; give one")


def _check_network(opts: Options, fam: str, src: str) -> None:
    """train_lora on a FLUX.1 / SD3 model: a network module that trains its transformer (the
    family's LoRA, FLUX.1's OFT, LyCORIS, as sd-scripts' flux_train_network.py /
    sd3_train_network.py train them), and train_t5xxl only where the run trains the text encoders
    and the module puts modules on T5 (an SD3 model without T5: networks/lora_sd3.py says so when built)."""
    what, module = registry.get(fam).title, opts.network_module
    allowed = network_options.FAMILY_NETWORK_MODULES[fam]
    if module not in allowed and not network_options.is_lycoris(module):
        choices = " or ".join(f'"{m}"' for m in (*allowed, "lycoris.kohya"))
        raise flow_family.FlowFamilyError(f"network_module {module}: not for the {what} model {src}: "
                                          f"{network_options.why_not_for(module, fam)}; {what} trains with "
                                          f"network_module = {choices}")
    if opts.pivotal_tokens:
        raise flow_family.FlowFamilyError(f"pivotal_tokens: pivotal tuning trains SD / SDXL embeddings; not with the "
                                          f"{what} model {src} (sd-scripts has no {what} textual inversion)")
    if network_options.is_lycoris(module):
        t5 = str((opts.network_args or {}).get("train_t5xxl", "")).strip().lower() in ("true", "1", "yes")
        if t5:
            raise flow_family.FlowFamilyError(
                f"network_args: train_t5xxl with {module}: LyCORIS puts no module on T5 (its text-encoder targets "
                "are CLIP's and mT5's layer classes), so T5 would not train; drop train_t5xxl")
        return
    args = network_options.DIT_NETWORK_MODULES[module][2].parse_network_args(dict(opts.network_args or {}))
    check_weights = getattr(network_options.DIT_NETWORK_MODULES[module][2], "check_network_weights", None)
    if check_weights is not None and opts.network_weights:  # the file's header, before any weight loads
        check_weights(os.path.expanduser(opts.network_weights))
    if args.get("train_t5xxl"):
        if opts.network_train_unet_only:
            raise flow_family.FlowFamilyError("network_args: train_t5xxl trains a LoRA on T5, a text encoder; "
                                              "network_train_unet_only = true trains none (drop one of them)")
