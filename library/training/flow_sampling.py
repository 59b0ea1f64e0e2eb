"""Sample latents of a flow-matching family (FLUX.1, SD3.x) for one prompt, as sd-scripts makes
its sample images (flux_train_utils.sample_image_inference, sd3_train_utils.do_sample): the
Euler sampler of library/training/flow_matching.py over the family model's forward.

    steps, scale, guidance = settings(prompt, family)   the prompt line's values, else the family's
                                                        defaults (FLUX: 20 steps, CFG 1, --g 3.5;
                                                        SD3: 30 steps, CFG 7.5)
    h, w = image_size(prompt, family)                   FLUX: multiples of 16, SD3: of 8 (>= 64)
    noise = initial_noise(family, h, w, seed)           (1, 16, h/8, w/8) float32
    sigmas = schedule(family, steps, latent_hw)         FLUX: shifted by the image's sequence length;
                                                        SD3: shift 3.0
    x0 = sample(family_model, cond, uncond, noise, sigmas, scale=..., guidance=...)
    image = decode_image(vae, x0)                       PIL

The noise comes from a CPU ``torch.Generator`` seeded with the prompt's seed, drawn as sd-scripts
draws it: FLUX in its packed shape (1, h/16 * w/16, 64) and unpacked (so the same seed gives
the same starting point as sd-scripts' packed noise), SD3 as (1, 16, h/8, w/8). Euler in the
packed or the unpacked layout is the same computation (packing is a permutation), so the sampler
calls the family model's own forward, which packs (FLUX) and gives dev its guidance input.

Classifier-free guidance runs only with a scale other than 1 (sd-scripts' SD3 sampler also
computes the negative branch at scale 1, whose result it then discards): v_neg + scale (v - v_neg).
FLUX.1 dev's distilled guidance is the model's guidance input (the prompt's ``--g``, default 3.5),
schnell has none. SD3's shift is sd-scripts' fixed 3.0 for samples, not the training's
``training_shift``: the shift only places the steps on the same ODE, whose velocity field the
model learned whatever sigmas training drew.
"""
from __future__ import annotations

import copy

import torch
from PIL import Image

from library.models.families.flux import flux
from library.models.families.base import FIXED_SHIFT, LINEAR_SHIFT, SEQUENCE_SHIFT
from library.training import flow_matching

MIN_SIZE = 64  # sd-scripts: max(64, size - size % multiple)
LATENT_CHANNELS = 16


def settings(prompt: dict, family: str) -> tuple[int, float, float | None]:
    """(steps, CFG scale, FLUX's distilled guidance or None) of a prompt: its values, else
    sd-scripts' defaults of the family."""
    spec = flow_matching.flow_spec(family)  # sd-scripts' defaults of a prompt line, per family
    def pick(key, default):
        return prompt[key] if prompt.get(key) is not None else default

    guidance = pick("guidance_scale", spec.sample_guidance)
    return (int(pick("sample_steps", spec.sample_steps)), float(pick("scale", spec.sample_scale)),
            None if guidance is None else float(guidance))


def cfg_shaping(prompt: dict, family: str) -> tuple[float | None, float | None]:
    """(CFG truncation ratio, renorm factor) of a prompt: its ``--ctr`` / ``--rcfg``, else the
    family's (Lumina 2: sd-scripts' 0.25 and 1.0; None for the families without them)."""
    spec = flow_matching.flow_spec(family)
    ctr, rcfg = prompt.get("cfg_trunc_ratio"), prompt.get("renorm_cfg")
    return (spec.sample_cfg_trunc_ratio if ctr is None else float(ctr),
            spec.sample_renorm_cfg if rcfg is None else float(rcfg))


def image_size(prompt: dict, family: str) -> tuple[int, int]:
    """(height, width) in pixels, rounded down to the family's multiple, at least 64."""
    m = flow_matching.flow_spec(family).size_multiple
    return tuple(max(MIN_SIZE, v - v % m) for v in (prompt["height"], prompt["width"]))


def initial_noise(family: str, height: int, width: int, seed: int, packed_draw: bool = True):
    """(1, 16, height/8, width/8) float32 standard normal noise from a CPU generator seeded with
    ``seed``; FLUX draws it packed, as sd-scripts does (the in-run samples), or with
    ``packed_draw=False`` unpacked, as diffusers' FluxPipeline does (gen_img: a seed reproduces
    in diffusers)."""
    g = torch.Generator("cpu").manual_seed(int(seed))
    if flow_matching.flow_spec(family).packed_noise and packed_draw:
        h, w = height // 16, width // 16
        packed = torch.randn((1, h * w, LATENT_CHANNELS * 4), generator=g, dtype=torch.float32)
        return flux.unpack_latents(packed, h, w)
    return torch.randn((1, LATENT_CHANNELS, height // 8, width // 8), generator=g, dtype=torch.float32)


def schedule(family: str, steps: int, latent_hw: tuple[int, int], shift: float | None = None) -> list[float]:
    """The steps + 1 noise levels from 1 to 0: FLUX's shifted by the packed sequence length of
    this image (dev and schnell alike, as sd-scripts), SD3's and Anima's with ``shift`` (default:
    the family's sample_shift, 3.0)."""
    spec = flow_matching.flow_spec(family)
    if spec.sample_schedule == SEQUENCE_SHIFT:
        return flow_matching.flux_schedule(steps, flow_matching.flux_image_seq_len(*latent_hw))
    if spec.sample_schedule in (FIXED_SHIFT, LINEAR_SHIFT):
        shift = spec.sample_shift if shift is None else shift
        if shift is None:
            raise ValueError(f"{family}: a shifted sample schedule without sample_shift")
        if spec.sample_schedule == FIXED_SHIFT:
            return flow_matching.sd3_schedule(steps, shift)
        return flow_matching.linear_shift_schedule(steps, shift)
    raise ValueError(f"{family}: unknown sample_schedule {spec.sample_schedule!r}")


def with_guidance(family_model, guidance: float | None):
    """The FLUX family model with dev's guidance input set to ``guidance`` (its training value is
    opts.guidance_scale); the model itself unchanged (a shallow copy), others as they are."""
    if guidance is None or flow_matching.flow_spec(family_model.family).sample_guidance is None:
        return family_model
    guided = copy.copy(family_model)
    guided.guidance_scale = float(guidance)
    return guided


def sample(family_model, cond, uncond, noise, sigmas, *, scale: float, guidance: float | None,
           dtype=None, cfg_trunc_ratio: float | None = None, renorm_cfg: float | None = None):
    """Integrate from ``noise`` over ``sigmas`` with the family model's velocity for the text
    conditioning ``cond`` (``uncond``: the negative prompt's, used when scale != 1, while
    ``cfg_trunc_ratio`` allows, capped by ``renorm_cfg``: cfg_shaping); the model
    input in ``dtype`` (default: the noise's), the running latents in float32. Returns
    (1, 16, h, w) float32."""
    family = family_model.family
    model = with_guidance(family_model, guidance)

    def velocity(text):
        return lambda x, t, g: model.unet_forward(x, t, text)

    x = noise if dtype is None else noise.to(dtype)
    out = flow_matching.euler_sample(velocity(cond), x, sigmas, family=family,
                                     uncond_fn=velocity(uncond) if scale != 1.0 else None,
                                     cfg_scale=scale, cfg_trunc_ratio=cfg_trunc_ratio, renorm_cfg=renorm_cfg)
    return out.float()


def decode_image(vae, latents):
    """A PIL image of (1, C, h, w) training latents: latents / scale + shift, decoded, [-1, 1]
    -> 0..255 (sd-scripts' clamp and 127.5 (x + 1))."""
    z = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor
    shift = getattr(vae.config, "shift_factor", None)
    if shift is not None:
        z = z + shift
    with torch.no_grad():
        x = vae.decode(z).sample
    arr = (127.5 * (x[0].float().clamp(-1, 1) + 1)).permute(1, 2, 0).cpu().numpy().astype("uint8")
    return Image.fromarray(arr, mode="RGB")
