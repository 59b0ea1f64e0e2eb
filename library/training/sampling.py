"""Sample images during training (sd-scripts' sample_prompts, sample_every_n_*, sample_sampler).

    load_prompts(path)                 the prompt file: .txt (one prompt per line with --n/--w/--h/
                                       --d/--s/--l/--g/--ss), .toml ([prompt] + [[prompt.subset]]) or .json
    check_options(opts)                before any weight is loaded: file, values, samplers
    due(opts, epoch=None, step=None)         whether this step / epoch end samples
    sample_latents(bundle, family_model, prompt, seed, ...)   one prompt's final latents
    sample_images(opts, step, ...parts)      every process renders its share of the prompts

Images are ``<output_dir>/sample/<output_name>_<step:06d>_<prompt index:02d>_<seed>.png``. The
seed is the prompt's ``--d``, else ``seed + prompt index``; each image is generated alone from a
``torch.Generator`` with that seed (initial latents and any ancestral noise), so an image depends
on its prompt and the weights only, not on the process that renders it (prompt i is rendered by
process i mod P) nor on the other prompts. The pipeline is a diffusers StableDiffusionPipeline /
StableDiffusionXLPipeline (an inpainting model: their Inpaint pipelines, with the prompt's ``--i``
image and a mask drawn from its seed) over the in-memory components (a LoRA acts through the forward hooks it
installed, so the pipeline sees it); the prompt conditioning is the trainer's own (``clip_skip``,
SDXL's penultimate layers), passed as embeddings. FLUX.1 and SD3 sample with their flow-matching
Euler sampler (library/training/flow_sampling.py: sd-scripts' schedules, defaults, dev's guidance
input ``--g``, CFG with the negative prompt when ``--l`` is not 1) and their autoencoder. Sampling runs in eval mode (no network dropout),
under the optimizer's eval weights (schedule-free), without gradients and inside
``torch.random.fork_rng``: the trained weights and every random draw of the training are the same
with and without sampling.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import diffusers
import toml
import torch
from PIL import Image

from library import text_files
from library.accelerator import is_main_process
from library.config.parse import required
from library.data import images, inpaint_masks
from library.errors import UserError
from library.models import flow_family, inpainting
from library.models.families import registry
from library.training import flow_sampling, validation

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")

# sd-scripts' sampler names (train_util.SCHEDULER_CHOICES / get_my_scheduler) -> diffusers
SAMPLERS = {
    "ddim": ("DDIMScheduler", {}),
    "pndm": ("PNDMScheduler", {}),
    "lms": ("LMSDiscreteScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "dpm_2": ("KDPM2DiscreteScheduler", {}),
    "dpm_2_a": ("KDPM2AncestralDiscreteScheduler", {}),
    "dpmsolver": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver"}),
    "dpmsolver++": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}),
    "dpmsingle": ("DPMSolverSinglestepScheduler", {}),
}
ALIASES = {"k_lms": "lms", "k_euler": "euler", "k_euler_a": "euler_a", "k_dpm_2": "dpm_2",
           "k_dpm_2_a": "dpm_2_a"}
SAMPLER_CHOICES = tuple(SAMPLERS) + tuple(ALIASES)

# sd-scripts' defaults of a prompt line; steps and scale (None) are the family's (settings)
DEFAULTS = {"negative_prompt": "", "width": 512, "height": 512, "sample_steps": None, "scale": None,
            "seed": None, "sample_sampler": None, "image": None, "guidance_scale": None,
            "cfg_trunc_ratio": None, "renorm_cfg": None}
SD_STEPS, SD_SCALE = 30, 7.5  # SD's; FLUX's and SD3's: library/training/flow_sampling.py
# --x flags of a .txt line -> keys (also the keys of .toml / .json prompts)
# --i: the source image of an inpainting model's sample (sd-scripts' train_inpainting)
# --g: FLUX.1 dev's distilled guidance input (sd-scripts' guidance_scale of a prompt)
# --ctr / --rcfg: Lumina 2's CFG truncation ratio and renorm factor (sd-scripts' cfg_trunc_ratio,
# renorm_cfg; flow_sampling.cfg_shaping)
FLAGS = {"n": "negative_prompt", "w": "width", "h": "height", "d": "seed", "s": "sample_steps",
         "l": "scale", "ss": "sample_sampler", "i": "image", "g": "guidance_scale", "ctr": "cfg_trunc_ratio",
         "rcfg": "renorm_cfg"}
TYPES = {"negative_prompt": str, "width": int, "height": int, "seed": int, "sample_steps": int,
         "scale": float, "sample_sampler": str, "prompt": str, "image": str, "guidance_scale": float,
         "cfg_trunc_ratio": float, "renorm_cfg": float}


class SamplingError(UserError):
    pass


def _prompt(raw: dict, where: str) -> dict:
    p: dict[str, Any] = dict(DEFAULTS)
    for k, v in raw.items():
        if k not in TYPES:
            raise SamplingError(f"{where}: unknown key {k!r} (one of {', '.join(TYPES)})")
        t = TYPES[k]
        try:
            p[k] = t(v) if not (t is int and isinstance(v, str)) else int(v.strip())
        except (TypeError, ValueError):
            raise SamplingError(f"{where}: {k} must be a {t.__name__}, got {v!r}") from None
    if not p.get("prompt"):
        raise SamplingError(f"{where}: empty prompt")
    for k in ("width", "height"):
        if p[k] < 8:
            raise SamplingError(f"{where}: {k} must be at least 8, got {p[k]}")
        p[k] -= p[k] % 8  # the VAE's factor
    for k, flag in (("cfg_trunc_ratio", "--ctr"), ("renorm_cfg", "--rcfg")):
        if p[k] is not None and not p[k] >= 0:
            raise SamplingError(f"{where}: {flag} ({k}) must be at least 0, got {p[k]}")
    if p["sample_steps"] is not None and p["sample_steps"] < 1:
        raise SamplingError(f"{where}: sample steps must be at least 1, got {p['sample_steps']}")
    s = p["sample_sampler"]
    if s is not None:
        p["sample_sampler"] = _sampler_name(s, where)
    if p["image"] is not None and not os.path.isfile(p["image"]):
        raise SamplingError(f"{where}: --i {p['image']}: no such file")
    return p


# samplers whose diffusers scheduler needs another package (diffusers raises ImportError when built)
SAMPLER_NEEDS = {"lms": "scipy"}


def _sampler_name(s: str, where: str) -> str:
    s = ALIASES.get(s.lower(), s.lower())
    if s not in SAMPLERS:
        raise SamplingError(f"{where}: unknown sampler {s!r}; use one of {', '.join(SAMPLER_CHOICES)}")
    need = SAMPLER_NEEDS.get(s)
    if need is not None and importlib.util.find_spec(need) is None:
        raise SamplingError(f"{where}: sampler {s} needs the {need} package (pip install {need}); "
                            "or choose another sampler")
    return s


def parse_line(line: str, where: str) -> dict:
    """One .txt prompt line: ``prompt --n negative --w 512 --h 512 --d 1 --s 30 --l 7.5 --ss euler_a``."""
    parts = line.split(" --")
    raw = {"prompt": parts[0].strip()}
    for part in parts[1:]:
        flag, _, value = part.strip().partition(" ")
        if flag not in FLAGS:
            raise SamplingError(f"{where}: unknown option --{flag} (one of "
                                f"{', '.join('--' + f for f in FLAGS)})")
        raw[FLAGS[flag]] = value.strip()
    return _prompt(raw, where)


def load_prompts(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise SamplingError(f"sample_prompts: no such file: {path}")
    ext = os.path.splitext(path)[1].lower()

    text = text_files.read(path, SamplingError, "sample_prompts")
    if ext == ".toml":
        try:
            data = toml.loads(text)
        except toml.TomlDecodeError as e:
            raise SamplingError(f"sample_prompts: {path}: {e}") from None
        base = dict(data.get("prompt", {}))
        subsets = base.pop("subset", [])
        prompts = [_prompt({**base, **s}, f"{path}: prompt.subset {i + 1}") for i, s in enumerate(subsets)]
    elif ext == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SamplingError(f"sample_prompts: {path}: {e}") from None
        if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
            raise SamplingError(f"sample_prompts: {path}: expected a list of objects")
        prompts = [_prompt(d, f"{path}: prompt {i + 1}") for i, d in enumerate(data)]
    else:
        prompts = [parse_line(line.strip(), f"{path}:{n}")
                   for n, line in enumerate(text.splitlines(), start=1)
                   if line.strip() and not line.strip().startswith("#")]
    if not prompts:
        raise SamplingError(f"sample_prompts: {path} holds no prompt")
    return prompts


def check_options(opts: Options) -> None:
    when = opts.sample_every_n_steps or opts.sample_every_n_epochs or opts.sample_at_first
    if when and not opts.sample_prompts:
        raise SamplingError("sample_every_n_steps / sample_every_n_epochs / sample_at_first need "
                            "sample_prompts (the prompt file)")
    if opts.sample_prompts:
        if not when:
            # The kohya_ss GUI always writes a (possibly empty) prompt file: never read, as in
            # sd-scripts, when no sampling is scheduled.
            logger.warning("sample_prompts is set but no sample_every_n_steps, "
                           "sample_every_n_epochs or sample_at_first: no sample is generated")
        else:
            load_prompts(opts.sample_prompts)
    _sampler_name(opts.sample_sampler, "sample_sampler")
    if "sample_sampler" in opts.given and \
            flow_family.family_before_loading(opts.pretrained_model_name_or_path) is not None:
        logger.warning(f"option sample_sampler has no effect here ({registry.titles(flow=True)} sample with "
                       "their flow-matching Euler sampler, as sd-scripts)")


def due(o, *, epoch: int | None = None, step: int | None = None) -> bool:
    if not o.sample_prompts:
        return False
    if step is not None:
        return bool(o.sample_every_n_steps) and step % o.sample_every_n_steps == 0
    return bool(o.sample_every_n_epochs) and epoch % o.sample_every_n_epochs == 0


def prompt_seed(opts: Options, prompt: dict, index: int) -> int:
    """The prompt's --d, else seed + prompt index (sd-scripts)."""
    return prompt["seed"] if prompt["seed"] is not None else opts.seed + index


def image_path(opts: Options, step: int, index: int, seed: int) -> str:
    return os.path.join(sample_folder(opts), f"{opts.output_name}_{step:06d}_{index:02d}_{seed}.png")


def sample_folder(opts: Options) -> str:
    """``<output_dir>/sample``: where the sample images go."""
    return os.path.join(required(opts.output_dir, "output_dir"), "sample")


def sampler_config(bundle) -> dict:
    """The config a sampler is built from: the model's own inference scheduler config (what
    diffusers' pipeline of the model holds, so ``Scheduler.from_config(pipe.scheduler.config)``
    in diffusers reproduces an image), with the model's prediction type and no sample clipping
    (as diffusers' SD pipelines set it); the training's DDPM config when the model has none."""
    cfg = dict(bundle.scheduler_config or bundle.noise_scheduler.config)
    cfg.update(prediction_type="v_prediction" if bundle.v_parameterization else "epsilon", clip_sample=False)
    return cfg


def make_scheduler(name: str, config):
    cls_name, kw = SAMPLERS[name]
    return getattr(diffusers, cls_name).from_config(config, **kw)


# a pipeline's kind -> (SD1/SD2 class, SDXL class)
# the order of a family's ``pipelines`` (library/models/families/base.py)
PIPELINE_KINDS = ("txt2img", "inpaint", "img2img")


def _pipeline(b, kind: str):
    # diffusers' pipeline module imports image processors it does not use here; without
    # torchvision transformers then announces a fallback that says nothing about this run.
    logging.getLogger("transformers.utils.import_utils").addFilter(
        lambda r: "requires torchvision (not installed)" not in r.getMessage())
    comps = b.components()
    comps.pop("scheduler")
    fam = registry.of(b)
    if fam.pipelines is None:  # a flow family samples through library/training/flow_sampling.py
        raise ValueError(f"{fam.name}: no diffusers pipelines")
    cls = getattr(diffusers, fam.pipelines[PIPELINE_KINDS.index(kind)])
    if fam.size_conditioning:  # SDXL's pipelines: a watermarker, no safety checker
        pipe = cls(**comps, scheduler=None, add_watermarker=False)
    else:
        pipe = cls(**comps, scheduler=None, safety_checker=None, feature_extractor=None,
                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def inpaint_inputs(p: dict, seed: int):
    """An inpainting model's source image and mask for prompt ``p`` (sd-scripts' ``--i``): the
    image resized to the sample size with a random mask drawn from the prompt's seed
    (library/data/inpaint_masks.py); without ``--i`` a mid-grey image entirely masked, i.e. the
    model generates the whole image (text to image for an inpainting model)."""
    w, h = p["width"], p["height"]
    if p["image"] is None:
        return Image.new("RGB", (w, h), (128, 128, 128)), Image.new("L", (w, h), 255)
    img = images.load_image(p["image"]).resize((w, h), Image.LANCZOS)
    m = inpaint_masks.random_mask(w, h, random.Random(seed))
    return img, Image.fromarray((m.numpy() * 255).astype("uint8"), mode="L")


def prompt_conditioning(family_model, device, clip_skip, text: str | list[str]):
    """The trainer's text conditioning of one prompt or a list (``clip_skip``: SD's)."""
    texts = [text] if isinstance(text, str) else list(text)
    return family_model.encode([t.to(device) for t in family_model.tokenize(texts)], clip_skip)


@dataclass(frozen=True)
class PromptEncoder:
    """How an SD sample's prompts become conditioning: the family model's text encoders on
    ``device``, at SD's ``clip_skip`` (``prompt_conditioning``)."""
    family_model: Any
    device: Any
    clip_skip: int | None

    def __call__(self, texts: list[str]):
        return prompt_conditioning(self.family_model, self.device, self.clip_skip, texts)


def is_flow(bundle) -> bool:
    return registry.of(bundle).flow is not None


def settings(p: dict, family: str) -> tuple[int, float, float | None]:
    """(steps, CFG scale, FLUX.1 dev's guidance input or None) of prompt ``p``: its values, else
    the family's defaults (SD: 30 steps, scale 7.5; FLUX.1 and SD3: their FlowSpec's)."""
    if registry.is_flow(family):
        return flow_sampling.settings(p, family)
    return (SD_STEPS if p["sample_steps"] is None else p["sample_steps"],
            SD_SCALE if p["scale"] is None else p["scale"], None)


def pipeline(bundle, inpaint: bool = False, kind: str | None = None):
    """An SD family's diffusers pipeline over the model's components (None for FLUX.1 / SD3,
    which sample with flow_sampling); ``kind``: txt2img (default), inpaint or img2img."""
    return None if is_flow(bundle) else _pipeline(bundle, kind or ("inpaint" if inpaint else "txt2img"))


def sample_latents(bundle, family_model, p: dict, seed: int, *, device, clip_skip=None,
                   sampler: str = "ddim", pipe=None, dtype=None):
    """The final latents (1, C, h, w) of prompt ``p`` from seed ``seed``, before the VAE decode,
    as the sample images are made: an SD family through its diffusers ``pipe`` (``pipeline``;
    ``sampler`` unless the prompt's ``--ss`` says), FLUX.1 / SD3 with their Euler sampler
    (library/training/flow_sampling.py; ``dtype`` the transformer's input dtype)."""
    if not is_flow(bundle):
        return _pipe_call(bundle, PromptEncoder(family_model, device, clip_skip), p, seed,
                          sampler=sampler, pipe=pipe, output_type="latent")
    return flow_group_latents(bundle, family_model, [(p, seed)], device=device, dtype=dtype)


def _flow_settings(p: dict, family: str) -> tuple:
    """What a batch of flow prompts shares: steps, scale, guidance, (height, width), CFG shaping."""
    return (*settings(p, family), flow_sampling.image_size(p, family), flow_sampling.cfg_shaping(p, family))


def flow_group_latents(bundle, family_model, items: list[tuple[dict, int]], *, device, dtype=None):
    """The final latents of flow prompts [(prompt, seed)] with equal ``_flow_settings``, rendered as
    one batch (image i from its own seed's noise)."""
    (steps, scale, guidance, (h, w), (ctr, rcfg)) = _flow_settings(items[0][0], bundle.family)
    batch = PromptBatch([p["prompt"] for p, _ in items], [p["negative_prompt"] for p, _ in items],
                        [seed for _, seed in items], width=w, height=h, steps=steps, scale=scale,
                        cfg_trunc_ratio=ctr, renorm_cfg=rcfg)
    return flow_batch(bundle, family_model, batch, guidance=guidance, device=device, dtype=dtype)


def sample_batch_size(opts: Options, bundle) -> int:
    """Prompts a sample batch may hold: a family that reads ``sample_batch_size`` (Lumina 2,
    sd-scripts' lumina_train_util) renders that many together (unset: train_batch_size); the others
    one at a time, as sd-scripts."""
    fam = registry.of(bundle)
    if fam.flow is None or "sample_batch_size" in {**registry.foreign_options(fam), **fam.unsupported}:
        return 1
    return opts.sample_batch_size or opts.train_batch_size or 1


def sample_groups(share: list[tuple[int, bool]], prompts: list[dict], family: str, size: int) -> list[list]:
    """This process's share [(prompt index, kept)] in batches: consecutive flow prompts with equal
    settings (size, steps, scale, guidance, CFG shaping), at most ``size`` each (sd-scripts'
    lumina batchify groups by the same settings; here each image keeps its own seed)."""
    groups: list[list] = []
    for item in share:
        key = _flow_settings(prompts[item[0]], family) if size > 1 else None
        if groups and len(groups[-1]) < size and key is not None and \
                _flow_settings(prompts[groups[-1][0][0]], family) == key:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


@dataclass(frozen=True, slots=True)
class PromptBatch:
    """A batch of images: image i from ``prompts[i]`` against ``negatives[i]``, from the noise
    of ``seeds[i]``; every image ``width`` x ``height``, ``steps`` sampler steps, guidance
    ``scale``."""

    prompts: list[str]
    negatives: list[str]
    seeds: list[int]
    width: int
    height: int
    steps: int
    scale: float
    cfg_trunc_ratio: float | None = None  # a flow family's CFG shaping (flow_sampling.cfg_shaping)
    renorm_cfg: float | None = None


def flow_batch(bundle, family_model, batch: PromptBatch, *, guidance: float | None, device,
               dtype=None, shift: float | None = None, packed_draw: bool = True):
    """A batch of FLUX.1 / SD3 final latents (B, 16, h/8, w/8): image i of ``batch`` from the
    noise of its seed (flow_sampling.initial_noise, as for a batch of one; ``packed_draw``:
    FLUX's noise drawn as sd-scripts, else as diffusers), the family's Euler schedule
    (``shift``: SD3's, default sd-scripts' 3.0); the one flow path of the in-run samples and
    gen_img."""
    pos = prompt_conditioning(family_model, device, None, batch.prompts)
    neg = prompt_conditioning(family_model.for_negative_prompts(), device, None, batch.negatives)
    noise = torch.cat([flow_sampling.initial_noise(bundle.family, batch.height, batch.width, s, packed_draw)
                       for s in batch.seeds]).to(device)
    sigmas = flow_sampling.schedule(bundle.family, batch.steps, tuple(noise.shape[2:]), shift=shift)
    return flow_sampling.sample(family_model, pos, neg, noise, sigmas, scale=batch.scale,
                                guidance=guidance, dtype=dtype, cfg_trunc_ratio=batch.cfg_trunc_ratio,
                                renorm_cfg=batch.renorm_cfg)


def _pipe_call(bundle, encoder: PromptEncoder, p: dict, seed: int, *, sampler: str, pipe,
               output_type: str, inpaint_kw=None):
    """An SD family's sample through its diffusers pipeline: latents or PIL images."""
    steps, scale, _ = settings(p, bundle.family)
    batch = PromptBatch([p["prompt"]], [p["negative_prompt"]], [seed], width=p["width"],
                        height=p["height"], steps=steps, scale=scale)
    return sd_batch(bundle, encoder, pipe, batch, sampler=p["sample_sampler"] or _sampler_name(sampler, ""),
                    output_type=output_type, extra=inpaint_kw)


class NegativeScale:
    """sd-scripts' gen_img ``negative_scale`` inside a diffusers pipeline: the pipeline's U-Net
    (attributes passed through) that, called on the [negative prompt; prompt] halves, also
    predicts e_u for the empty prompt and returns [n'; e_p] with n' = (g - s e_p) / (1 - s), so
    that the pipeline's n' + s (e_p - n') is sd-scripts' guided prediction
    g = e_u + s (e_p - e_u) - ns (e_n - e_u) (s > 1: the pipeline guides only then)."""

    def __init__(self, unet, uncond, scale: float, negative_scale: float):
        self.unet, self.uncond, self.scale, self.negative_scale = unet, uncond, scale, negative_scale

    def __getattr__(self, name):
        return getattr(self.unet, name)

    def __call__(self, sample, t, encoder_hidden_states=None, added_cond_kwargs=None, return_dict=True, **kw):
        e_n, e_p = self.unet(sample, t, encoder_hidden_states=encoder_hidden_states,
                             added_cond_kwargs=added_cond_kwargs, return_dict=False, **kw)[0].chunk(2)
        b = e_p.shape[0]
        added = None
        if added_cond_kwargs:  # SDXL: the empty prompt's pooled embedding, the same size conditioning
            added = {"text_embeds": self.uncond.pooled.to(e_p.dtype), "time_ids": added_cond_kwargs["time_ids"][:b]}
        e_u = self.unet(sample[:b], t, encoder_hidden_states=self.uncond.hidden_states.to(e_p.dtype),
                        added_cond_kwargs=added, return_dict=False, **kw)[0]
        s, ns = self.scale, self.negative_scale
        guided = e_u + s * (e_p - e_u) - ns * (e_n - e_u)
        return (torch.cat([(guided - s * e_p) / (1 - s), e_p]),)


def sd_batch(bundle, encoder: PromptEncoder, pipe, batch: PromptBatch, *, sampler: str,
             output_type: str = "pil", extra=None, negative_scale: float | None = None):
    """A batch of SD images (or latents) through the diffusers ``pipe`` (``pipeline``), image i
    of ``batch`` from its prompt and negative (``encoder``'s conditioning) and the initial
    latents (and ancestral noise) of ``torch.Generator("cpu").manual_seed(seed)``, as
    diffusers' pipeline draws them for a batch of one: the one SD path of the in-run samples and
    gen_img (library/outputs/generation.py). ``extra``: more pipeline arguments (inpainting's
    image and mask, img2img's image and strength); ``negative_scale``: sd-scripts' separate scale
    of the negative prompt, the empty prompt then the unconditional one (``NegativeScale``)."""
    pipe.scheduler = make_scheduler(sampler, sampler_config(bundle))
    prompts, width, height, scale = batch.prompts, batch.width, batch.height, batch.scale
    pos, neg = (encoder(texts) for texts in (prompts, batch.negatives))
    kw = dict(prompt_embeds=pos.hidden_states, negative_prompt_embeds=neg.hidden_states)
    if registry.of(bundle).size_conditioning:
        kw.update(pooled_prompt_embeds=pos.pooled, negative_pooled_prompt_embeds=neg.pooled)
    kw.update(extra or {})
    if "image" not in kw or "mask_image" in kw:  # img2img takes no size: its image's
        kw.update(height=height, width=width)
    gens = [torch.Generator("cpu").manual_seed(int(s)) for s in batch.seeds]
    unet = pipe.unet
    if negative_scale is not None and scale > 1:
        # not pipe.unet = ...: a pipeline registers what is assigned to it in its config
        uncond = encoder([""] * len(prompts))
        object.__setattr__(pipe, "unet", NegativeScale(unet, uncond, scale, negative_scale))
    # a VAE in another dtype than the U-Net (gen_img's --no_half_vae): decoded here, in its dtype
    own_decode = output_type == "pil" and pipe.vae.dtype != unet.dtype
    try:
        out = pipe(num_inference_steps=batch.steps, guidance_scale=scale, generator=gens[0] if len(gens) == 1 else gens,
                   output_type="latent" if own_decode else output_type, **kw).images
    finally:
        object.__setattr__(pipe, "unet", unet)
    if not own_decode:
        return out
    vae = pipe.vae
    with torch.no_grad():
        x = vae.decode(out.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
    return pipe.image_processor.postprocess(x, output_type="pil")


def _warn_unused(bundle, p: dict, i: int) -> None:
    # FLUX.1 dev, not schnell
    flow = registry.of(bundle).flow
    guided = flow is not None and flow.sample_guidance is not None and bundle.unet.config.guidance_embed
    if not guided and p["guidance_scale"] is not None:
        logger.warning(f"sample prompt {i}: --g is FLUX.1 dev's guidance input; this model has "
                       "none (ignored)")
    if (flow is None or flow.sample_cfg_trunc_ratio is None) and \
            (p["cfg_trunc_ratio"] is not None or p["renorm_cfg"] is not None):
        logger.warning(f"sample prompt {i}: --ctr / --rcfg shape Lumina 2's CFG; this model's CFG has no "
                       "truncation or renorm (ignored)")
    if is_flow(bundle) and p["sample_sampler"] is not None:
        logger.warning(f"sample prompt {i}: --ss {p['sample_sampler']}: {bundle.family} samples "
                       "with its flow-matching Euler sampler (ignored)")


def sample_images(opts: Options, step: int, model: validation.Evaluated, *, frozen, placement) -> list[str]:
    """Render this process's prompts (the model's strategy's share) at global step ``step`` with
    ``model`` (the bundle and the method's network, in the stepper's eval mode), the ``frozen``
    parts back, the transformer's inputs in ``placement``'s dtype (FLUX.1 / SD3); returns the
    files written."""
    acc, bundle, family_model = model.accelerator, model.bundle, model.family_model
    stepper, strategy = model.stepper, model.strategy
    prompts = load_prompts(required(opts.sample_prompts, "sample_prompts"))
    written = []
    mods = model.modules()
    modes = {m: m.training for root in mods for m in root.modules()}
    devices = [acc.device] if acc.device.type == "cuda" else []
    os.makedirs(sample_folder(opts), exist_ok=True)
    dtype = placement.input_dtype(placement.unet)
    try:
        # the VAE and text encoders, released after caching, are back for the samples
        with torch.random.fork_rng(devices=devices), torch.no_grad(), stepper.eval_mode(), \
                frozen.available():
            for root in mods:
                root.eval()

            inpaint = not is_flow(bundle) and inpainting.is_inpainting(bundle.unet)
            pipe = pipeline(bundle, inpaint)
            encoder = PromptEncoder(family_model, acc.device, opts.clip_skip)
            share = strategy.share(len(prompts))  # fsdp: all prompts, own ones written
            for group in sample_groups(share, prompts, bundle.family, sample_batch_size(opts, bundle)):
                items = [(prompts[i], prompt_seed(opts, prompts[i], i)) for i, _ in group]
                for (i, kept), (p, _) in zip(group, items):
                    if p["image"] is not None and not inpaint:
                        raise SamplingError(f"sample_prompts: --i {p['image']} is the source image "
                                            "of an inpainting model's sample; this model is not one")
                    if kept:
                        _warn_unused(bundle, p, i)
                with acc.autocast():
                    if is_flow(bundle):
                        latents = flow_group_latents(bundle, family_model, items, device=acc.device, dtype=dtype)
                        rendered = [flow_sampling.decode_image(bundle.vae, latents[k:k + 1]) for k in range(len(items))]
                    else:
                        [(p, seed)] = items
                        kw = None
                        if inpaint:
                            src, mask = inpaint_inputs(p, seed)
                            kw = dict(image=src, mask_image=mask, strength=1.0)
                        rendered = _pipe_call(bundle, encoder, p, seed, sampler=opts.sample_sampler,
                                              pipe=pipe, output_type="pil", inpaint_kw=kw)[:1]
                for (i, kept), (_, seed), image in zip(group, items, rendered):
                    if not kept:
                        continue
                    path = image_path(opts, step, i, seed)
                    tmp = path + ".tmp"
                    image.save(tmp, format="PNG")
                    os.replace(tmp, path)
                    written.append(path)
    finally:
        for m, training in modes.items():
            m.training = training
    acc.wait_for_everyone()
    if is_main_process():
        logger.info(f"sample images at step {step}: {len(prompts)} in "
                    f"{sample_folder(opts)}")
    return written
