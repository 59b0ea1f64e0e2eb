"""Proof that training learns, per family: a tiny model trained on four distinct patterns samples
latents near its training latents; untrained weights and noise do not.

    python benchmarks/learns.py [--families sd15 sd2 sdxl sd15-v flux chroma sd3 lumina anima anima-lora] [--images docs/images]
                                [--k 2] [--steps N] [--lr X] [--size PX] [--batch B] [--norm_groups G]
                                [--train_args "--min_snr_gamma 5"] [--out DIR [--reuse]]

For each family: four 64 px images of distinct patterns (solid red, solid blue, horizontal
stripes, a checkerboard), each with its own one-word caption, train the built-in tiny model's
whole denoiser from its random initial weights through the real entry script
(``train_dreambooth.py``; Anima: ``anima_train.py``, which runs it at sd-scripts' per-part rates;
full fine-tune, cached latents, one CPU thread, AdamW at 2e-3 with a
cosine schedule, batch 4, 400 steps; ``sd15-v`` is tiny-sd15 trained on the v target; the epsilon
entries ``sd15`` and ``sdxl`` train the built-in with 8 and 4 GroupNorm groups in its U-Net instead
of 32, written as a diffusers folder by write_grouped_model (``--norm_groups 32``: the built-in
itself), for 1000 steps, as ``sd3``). Then ``k``
samples per caption from fresh noise, as training's sample images are made
(library/training/sampling.py: the diffusers pipeline over the model's components, the trainer's
text conditioning, a prompt line ``<caption> --w 64 --h 64 --d <seed> --l 1`` with the other
defaults: 30 steps, the default sampler ``ddim``), for the trained and for the untrained weights;
their final latents (before the VAE decode) are compared with the training latents (the trainer's
own encoding, library/data/latent_cache.py: the VAE posterior mean times its scaling factor).

Two choices, both measured (docs/SAMPLING_VALIDATION.md, "Proof that training learns", with the
table, the grids and why the epsilon models need GroupNorms of several channels): no classifier-free
guidance (``--l 1``), because these models never saw an unconditional caption, so the default
scale 7.5 extrapolates from an untrained branch (tiny-sd2: d 0.26 at scale 1, 2.49 at 7.5); and
the tiny VAE with a ``scaling_factor`` that makes the training latents unit-variance
(``write_unit_vae``, passed as ``--vae``), as SD's 0.18215 was chosen for its VAE.

The metric, per sample: the RMS difference to the nearest training latent; reported is the mean
over samples for (a) the trained weights, (b) the untrained weights, (c) Gaussian noise latents of
the same shape with the training latents' per-channel mean and standard deviation. ``hits`` is
the fraction of samples whose nearest training latent is the one of their own caption (chance:
1/4), which a model that collapses to one pattern cannot reach. ratio = d_trained /
min(d_untrained, d_noise); ``learned`` passes below MARGIN. What this catches that the per-formula
unit tests cannot: the chain wrong as a whole (a sign in the sampler or the training target, a
target other than the sampler's, samples that are not denoised). What it cannot see on data this
tight: a slightly shifted schedule (tests/tools/test_learns.py measures both).

Grids (``--images``): ``learns_<family>_latents.png``, the first three latent channels as RGB
(each channel mapped from the training latents' mean +- 2.5 std to 0..255, 8x8 latents shown as
32x32), and ``learns_<family>_decoded.png``, the same samples through the tiny (random) VAE; one
row per caption: the training latent, then k untrained samples, then k trained samples.

A family is one FAMILIES entry: the built-in model, its training options and steps, and the prompt
options of its samples (EARLIER: configurations the docs' table keeps as history, run only by name). FLUX.1 and SD3 (tiny-flux, tiny-sd3) sample with their own flow-matching
Euler sampler (sampling.sample_latents -> library/training/flow_sampling.py, as their sample
images are made: FLUX dev 20 steps with guidance input 3.5, SD3 30 steps at shift 3, no CFG);
their unit-variance autoencoder goes in as ``--ae`` (FLUX: a diffusers folder) or in the record
of an SD3 model file the benchmark writes from tiny-sd3 (same weights; SD3 takes no separate VAE
folder), and the x0 diagnosis is x_t - sigma v at sigma = t / 1000.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from diffusers import UNet2DConditionModel  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from library.config import parse  # noqa: E402
from library.data import images  # noqa: E402
from library.data import latent_cache  # noqa: E402
from library.models import family  # noqa: E402
from library.models import flow_family  # noqa: E402
from library.models import loading  # noqa: E402
from library.models.families import registry  # noqa: E402
from library.models.families.anima.weights import load_dit  # noqa: E402
from library.models.families.sd3 import sd3_checkpoint  # noqa: E402
from library.models import sd_checkpoint  # noqa: E402
from library.models.families.sd_common import tiny_models  # noqa: E402
from library.training import flow_matching  # noqa: E402
from library.training import network_options  # noqa: E402
from library.training import flow_sampling  # noqa: E402
from library.training import sampling  # noqa: E402

SIZE = 64
PATTERNS = ("red", "blue", "stripes", "checker")
LR = 2e-3
STEPS = 400
SEED = 0
MARGIN = 0.5


@dataclasses.dataclass(frozen=True)
class Family:
    model: str  # the built-in name
    steps: int = STEPS  # optimizer steps
    lr: float = LR
    size: int = SIZE  # pixels, square
    batch: int = 4  # each image repeated batch / 4 times per epoch: one epoch per step
    script: str = "train_dreambooth.py"
    args: tuple[str, ...] = ()
    v_parameterization: bool = False  # trained (and so sampled) as v-prediction
    # the U-Net's GroupNorm groups when not the built-in's 32 (one channel per group at width 32):
    # the benchmark trains the built-in model written as a diffusers folder with this U-Net
    # (write_grouped_model; same seed, same widths)
    norm_groups: int | None = None
    # a prompt line's options besides --w/--h/--d: no guidance (see the module docstring)
    prompt_options: str = "--l 1"


FAMILIES = {
    # the epsilon chains: the built-in U-Net with 8 (SDXL: 4) GroupNorm groups (4 to 16 channels
    # per group; real SD: 10 and more), 1000 steps. With the built-in's one channel per group the U-Net
    # cannot predict the noise's per-channel mean, which an eps model's x0 multiplies by 14.6 at
    # t = 999 (docs/SAMPLING_VALIDATION.md; measured ratios: 32 groups 1.44 after 400 steps and
    # no better after 1500; 8 groups 0.88 after 400, 0.43 after 1000; SDXL: 1.59, 0.80, 0.502, with 4 groups 0.367)
    "sd15": Family("tiny-sd15", steps=1000, norm_groups=8),
    "sd2": Family("tiny-sd2"),  # v-prediction
    "sdxl": Family("tiny-sdxl", steps=1000, norm_groups=4),
    # SD1's U-Net trained on the v target: tells the parametrisation from the rest of the chain
    "sd15-v": Family("tiny-sd15", args=("--v_parameterization",), v_parameterization=True),
    # rectified flow: sampled with their own Euler sampler (FLUX.1 dev: 20 steps, guidance
    # input 3.5; SD3: 30 steps, shift 3), no CFG
    "flux": Family("tiny-flux"),
    "chroma": Family("tiny-chroma"),  # FLUX.1's sampler without a guidance input; --l 1: no CFG
    "sd3": Family("tiny-sd3", steps=1000),  # 400: ratio 0.53, every sample its own caption's
    # Lumina 2: its whole Next-DiT (lumina_train.py's fine-tune), its sampler (shift 6, 36 steps), no CFG
    "lumina": Family("tiny-lumina"),
    # Anima: its whole DiT with the LLM adapter (anima_train.py's fine-tune; every per-part rate the
    # learning rate), its sampler (shift 3, 30 steps), no CFG. Trained with Lumina 2's sigma draw
    # (shift sampling at 6) for 1000 steps: sd-scripts' default draw (sigmoid, shift 1) puts sigma
    # above 0.9 in 1.4% of the steps while the sampler spends a quarter of its steps there, so at
    # 400 steps the defaults give 0.857, shift 6 0.553, 1000 steps 0.523, both 0.355
    # (docs/SAMPLING_VALIDATION.md)
    "anima": Family("tiny-anima", script="anima_train.py", steps=1000,
                    args=("--timestep_sampling", "shift", "--discrete_flow_shift", "6")),
}

# earlier configurations whose rows the docs keep as history; run by name (--families), not by default
EARLIER = {
    # Anima as a LoRA (before anima_train.py): rank 64, the width of the tiny DiT, on every Linear of
    # the DiT (include_patterns .*: also the modulations, embedders and final layer sd-scripts'
    # default leaves out; with the default targets: ratio 0.98, hits 1.00); ratio 0.864 at 400 steps
    "anima-lora": Family("tiny-anima", script="train_lora.py",
                         args=("--network_module", "networks.lora_anima", "--network_dim", "64", "--network_alpha", "64",
                               "--network_args", "include_patterns=.*")),
}
ENTRIES = {**FAMILIES, **EARLIER}


# --- the model -------------------------------------------------------------------------------

def flow_of(model: str) -> str | None:
    """The flow family of a model ("flux", "sd3", "chroma"), None for SD."""
    return flow_family.family_before_loading(model)


def load_bundle(fam: Family, vae: str | None, weights: str | None = None):
    """The model ``fam.model`` with the autoencoder ``vae`` (SD: --vae; FLUX.1: --ae; SD3: its
    own) and, when given, the trained ``weights`` file the entry script saved."""
    flow = flow_of(fam.model)
    if flow is None:
        return loading.load_model_bundle(weights or fam.model, vae=vae, v_parameterization=fam.v_parameterization)
    if flow == "sd3":  # the saved file is a whole SD3 model (MMDiT, CLIPs, VAE)
        return flow_family.load_from_options(flow_options(weights or fam.model))
    script = "train_lora" if fam.script == "train_lora.py" else "train_dreambooth"  # the options' script
    opts = flow_options(fam.model, script, **{registry.get(flow).autoencoder_option: vae})
    bundle = flow_family.load_from_options(opts)
    if weights and script == "train_lora":  # a LoRA: merged into the model, as base_weights are
        network_options.merge_base_weights(bundle, opts.replace(base_weights=[weights]), logging.getLogger("learns"))
    elif weights:  # FLUX.1, Chroma, Lumina 2, Anima save the transformer alone, in its original layout
        # (Anima's: the released file, keys under ``net.``, read by its own loader)
        bundle.unet.load_state_dict(load_dit(weights).state_dict() if flow == "anima" else load_file(weights))
    return bundle


def write_grouped_model(model: str, groups: int, folder: str) -> str:
    """The built-in SD model ``model`` as a diffusers folder whose U-Net has ``groups`` GroupNorm
    groups (its config otherwise, built from the built-in's seed); the other components are the
    built-in's. Returns the folder."""
    arch = loading.resolve_model_source(model).arch
    comps = tiny_models.build_tiny_components(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny_models.SEED)
        comps["unet"] = UNet2DConditionModel(**{**tiny_models.unet_config(arch), "norm_num_groups": groups})
    sd_checkpoint.save_diffusers(comps, tiny_models.FAMILY_OF_ARCH[arch], folder)
    return folder


def builtin_groups(model: str) -> int | None:
    """The GroupNorm groups of a built-in SD model's U-Net (None for FLUX.1 / SD3)."""
    if flow_of(model) is not None:
        return None
    return tiny_models.unet_config(loading.resolve_model_source(model).arch)["norm_num_groups"]


def flow_options(model: str, script: str = "train_dreambooth", **values):
    return parse.options_from_values(script, {"pretrained_model_name_or_path": model, **values})


def family_model_of(bundle):
    """The trainer's family model (tokenize / encode / forward) with the default options."""
    if sampling.is_flow(bundle):
        return flow_family.family_model_for(bundle, flow_options(bundle.source))
    return family.family_model_for(bundle)


def model_args(fam: Family, vae: str | None) -> tuple[str, ...]:
    """The entry script's options that give it the unit-variance autoencoder (none for SD3)."""
    flow = flow_of(fam.model)
    if flow == "sd3" or vae is None:
        return ()
    return ("--" + (registry.get(flow).autoencoder_option if flow else "vae"), vae)


# --- the metric ------------------------------------------------------------------------------

def rms_distances(samples: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
    """(K, N): RMS over all latent elements of samples[k] - train[n]."""
    s = samples.double().flatten(1)
    t = train.double().flatten(1)
    return ((s[:, None, :] - t[None, :, :]) ** 2).mean(-1).sqrt()


def nearest(samples: torch.Tensor, train: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: the RMS distance to the nearest training latent, and that latent's index."""
    d = rms_distances(samples, train)
    return d.min(dim=1)


def noise_like(train: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """k Gaussian latents shaped as the training latents, with their per-channel mean and std."""
    t = train.double()
    mean = t.mean(dim=(0, 2, 3), keepdim=True)
    std = t.std(dim=(0, 2, 3), keepdim=True)
    z = torch.randn((k, *t.shape[1:]), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (mean + std * z).to(train.dtype)


def learned(d_trained: float, d_untrained: float, d_noise: float, margin: float | None = None) -> bool:
    """The verdict: the trained samples' distance is below ``margin`` times both baselines."""
    margin = MARGIN if margin is None else margin
    return d_trained < margin * min(d_untrained, d_noise)


def score(samples: torch.Tensor, labels: list[int], train: torch.Tensor) -> dict:
    """Mean nearest-training-latent distance and the fraction of samples nearest their own one."""
    d, idx = nearest(samples, train)
    hits = sum(int(i) == lab for i, lab in zip(idx.tolist(), labels)) / len(labels)
    return {"d": float(d.mean()), "hits": hits}


# --- data ------------------------------------------------------------------------------------

def pattern_image(name: str, size: int = SIZE):
    """One clearly distinct pattern per caption (PIL, deterministic)."""
    y, x = np.mgrid[0:size, 0:size]
    img = np.zeros((size, size, 3), dtype=np.uint8)
    if name == "red":
        img[:] = (220, 30, 30)
    elif name == "blue":
        img[:] = (30, 60, 220)
    elif name == "stripes":
        img[(y // (size // 8)) % 2 == 0] = (255, 255, 255)
    elif name == "checker":
        on = ((x // (size // 4)) + (y // (size // 4))) % 2 == 0
        img[on] = (240, 220, 40)
        img[~on] = (20, 120, 40)
    else:
        raise ValueError(name)
    return Image.fromarray(img)


def write_dataset(folder: str, repeats: int = 1, size: int = SIZE) -> str:
    """``folder/<repeats>_pattern/NN.png`` + ``NN.caption``; returns the train_data_dir."""
    concept = os.path.join(folder, f"{repeats}_pattern")
    os.makedirs(concept, exist_ok=True)
    for i, name in enumerate(PATTERNS):
        pattern_image(name, size).save(os.path.join(concept, f"{i:02d}.png"))
        with open(os.path.join(concept, f"{i:02d}.caption"), "w", encoding="utf-8") as f:
            f.write(name)
    return folder


def training_latents(vae, size: int = SIZE) -> torch.Tensor:
    """(4, C, h, w): the patterns as the trainer caches them (posterior mean x scaling factor)."""
    pixels = torch.stack([images.to_tensor(pattern_image(n, size)) for n in PATTERNS])
    with torch.no_grad():
        return latent_cache.encode_pixels(vae, pixels.to(vae.dtype)).float()


def write_unit_vae(vae, folder: str, size: int = SIZE) -> tuple[str, float]:
    """The tiny model's VAE as a diffusers folder whose ``scaling_factor`` makes the training
    latents unit-variance (1 / their std before scaling), as SD's 0.18215 was chosen for its VAE.
    With SD's factor the random tiny VAE's latents have a std near 0.06: the diffusion would see
    data twenty times smaller than its noise, and a model has to predict the noise to within a few
    percent before its samples get anywhere near its data (measured: samples of std ~1 after 200
    steps). Returns the folder and the factor."""
    scaled = training_latents(vae, size)
    factor = float(vae.config.scaling_factor / scaled.double().std())
    unit = copy.deepcopy(vae)
    unit.register_to_config(scaling_factor=factor)
    unit.save_pretrained(folder)
    return folder, factor


def write_unit_qwen_vae(vae, folder: str, size: int = SIZE) -> tuple[str, float]:
    """Anima's Qwen-Image VAE (behind family_model.LatentVAE, which normalises each channel by the
    config's latents_mean / latents_std, the real VAE's latent statistics) as a diffusers folder
    whose latents_mean / latents_std are the training latents' own per-channel statistics, so that
    they are zero-mean and unit-variance per channel: the random tiny VAE's channels have offsets
    much larger than what tells the patterns apart (with its scale alone the noise baseline lies
    0.15 from the training latents). Returns the folder and the mean scale factor (1 / the std)."""
    lat = training_latents(vae, size).double()
    m, s = lat.mean(dim=(0, 2, 3)), lat.std(dim=(0, 2, 3))
    unit = copy.deepcopy(vae.vae)
    mean, std = (torch.tensor(unit.config.latents_mean, dtype=torch.float64),
                 torch.tensor(unit.config.latents_std, dtype=torch.float64))
    unit.register_to_config(latents_mean=(mean + m * std).tolist(), latents_std=(std * s).tolist())
    unit.save_pretrained(folder)
    return folder, float((1 / s).mean())


def write_unit_sd3(bundle, path: str, size: int = SIZE) -> tuple[str, float]:
    """The SD3 model as a single file whose VAE record (sdtk.sd3_config) carries the unit-variance
    scaling factor of write_unit_vae (SD3 takes no separate VAE folder); same weights."""
    scaled = training_latents(bundle.vae, size)
    factor = float(bundle.vae.config.scaling_factor / scaled.double().std())
    bundle.vae.register_to_config(scaling_factor=factor)
    sd3_checkpoint.save_sd3(bundle.flow, path)
    return path, factor


# --- training --------------------------------------------------------------------------------

def train(fam: Family, data: str, vae: str | None, out: str, steps: int, lr: float, batch: int,
          extra: tuple[str, ...] = (), reuse: bool = False) -> tuple[str, dict]:
    """Train through the entry script in a subprocess (one thread); the saved model's path and
    its times: wall seconds and the child's CPU seconds (the machine may be shared), start-up and
    latent caching included. ``reuse``: a model this function saved in ``out`` before is kept."""
    path, record = os.path.join(out, "learned.safetensors"), os.path.join(out, "learns_train.json")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT)
    cmd = [sys.executable, os.path.join(ROOT, fam.script), "--pretrained_model_name_or_path",
           fam.model, "--resolution", str(fam.size), "--train_data_dir", data, "--cache_latents",
           "--max_train_steps", str(steps), "--learning_rate", str(lr), "--train_batch_size",
           str(batch), "--seed", str(SEED), *model_args(fam, vae), "--output_dir", out, "--output_name", "learned",
           "--lr_scheduler", "cosine", *fam.args, *extra]
    if reuse and os.path.isfile(path) and os.path.isfile(record):
        with open(record, encoding="utf-8") as f:
            times = json.load(f)
        if times.get("cmd") == cmd[2:]:
            return path, times
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        sys.exit(f"{fam.script} ({fam.model}) failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    times = {"wall_s": wall, "cpu_s": (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime),
             "cmd": cmd[2:]}
    with open(record, "w", encoding="utf-8") as f:
        json.dump(times, f)
    return path, times


# --- sampling --------------------------------------------------------------------------------

def sample_latents(bundle, k: int, options: str = "", size: int = SIZE, seed: int = 1000,
                   sampler: str = "ddim") -> tuple[torch.Tensor, list[int]]:
    """k final latents per caption, made as training's sample images are
    (sampling.sample_latents: SD's diffusers pipeline, FLUX.1's / SD3's Euler sampler), from the
    prompt line ``<caption> --w 64 --h 64 --d <seed> <options>`` (its defaults otherwise, and
    ``sampler``, sample_sampler's default, unless ``--ss`` says); (latents, caption index)."""
    family_model = family_model_of(bundle)
    pipe = sampling.pipeline(bundle)
    device = torch.device("cpu")
    out, labels = [], []
    with torch.no_grad():
        for i, name in enumerate(PATTERNS):
            for j in range(k):
                s = seed + i * k + j
                p = sampling.parse_line(f"{name} --w {size} --h {size} --d {s} {options}".strip(), "learns")
                lat = sampling.sample_latents(bundle, family_model, p, p["seed"], device=device,
                                              sampler=sampler, pipe=pipe)
                out.append(lat[0].float())
                labels.append(i)
    return torch.stack(out), labels


def x0_error_by_t(bundle, train: torch.Tensor, timesteps=(999, 700, 400, 200, 50, 1)) -> dict:
    """The diagnosis of a failing row: at each timestep, noise the training latents as training
    does (fixed noise), let the model predict with each latent's own caption, and report the RMS
    error of the x0 it implies. An eps model's x0 = (x_t - sqrt(1 - a) eps) / sqrt(a) multiplies
    its error by sqrt((1 - a) / a), 14.6 at t = 999; a v model's x0 = sqrt(a) x_t - sqrt(1 - a) v
    does not amplify it."""
    if sampling.is_flow(bundle):
        return x0_error_by_sigma(bundle, train, [t / 1000 for t in timesteps])
    family_model = family_model_of(bundle)
    ac = bundle.noise_scheduler.alphas_cumprod.double()
    out = {}
    with torch.no_grad():
        conds = [sampling.prompt_conditioning(family_model, torch.device("cpu"), None, n) for n in PATTERNS]
        g = torch.Generator().manual_seed(SEED)
        for t in timesteps:
            eps = torch.randn(train.shape, generator=g)
            a = ac[t].float()
            xt = a.sqrt() * train + (1 - a).sqrt() * eps
            preds = []
            for i, c in enumerate(conds):
                size_cond = None
                if bundle.family == "sdxl":
                    h, w = xt.shape[-2] * 8, xt.shape[-1] * 8
                    size_cond = torch.tensor([[h, w, 0, 0, h, w]], dtype=torch.float32)
                preds.append(family_model.unet_forward(xt[i:i + 1], torch.tensor([t]), c, size_cond))
            pred = torch.cat(preds)
            x0 = a.sqrt() * xt - (1 - a).sqrt() * pred if bundle.v_parameterization else \
                (xt - (1 - a).sqrt() * pred) / a.sqrt()
            out[t] = float(((x0 - train) ** 2).mean().sqrt())
    return out


def x0_error_by_sigma(bundle, train: torch.Tensor, sigmas) -> dict:
    """x0_error_by_t of a flow model: x_t = (1 - sigma) x0 + sigma noise, x0 = x_t - sigma v
    (the error of v times sigma); keyed by the timestep 1000 sigma."""
    family_model = family_model_of(bundle)
    out = {}
    with torch.no_grad():
        conds = [sampling.prompt_conditioning(family_model, torch.device("cpu"), None, n) for n in PATTERNS]
        g = torch.Generator().manual_seed(SEED)
        for sigma in sigmas:
            noise = torch.randn(train.shape, generator=g)
            s = torch.full((len(train),), float(sigma))
            xt = flow_matching.noisy_input(train, noise, s)
            t = flow_matching.model_timesteps(bundle.family, s)
            v = torch.cat([family_model.unet_forward(xt[i:i + 1], t[i:i + 1], c) for i, c in enumerate(conds)])
            x0 = xt - sigma * v
            out[round(sigma * 1000)] = float(((x0 - train) ** 2).mean().sqrt())
    return out


# --- pictures --------------------------------------------------------------------------------

def latent_rgb(lat: torch.Tensor, train: torch.Tensor, px: int = 32):
    """The first three channels as an RGB PIL image, each channel's training mean +- 2.5 std
    mapped to 0..255 (the same mapping for every latent of a family)."""
    t = train[:, :3].double()
    mean = t.mean(dim=(0, 2, 3))[:, None, None]
    std = t.std(dim=(0, 2, 3))[:, None, None].clamp_min(1e-8)
    x = ((lat[:3].double() - mean) / (5 * std) + 0.5).clamp(0, 1)
    arr = (x * 255).round().byte().permute(1, 2, 0).numpy()
    img = Image.fromarray(arr, mode="RGB")
    return img.resize((px, px), Image.NEAREST)


def decoded(bundle, lat: torch.Tensor):

    if sampling.is_flow(bundle):
        return flow_sampling.decode_image(bundle.vae, lat[None])
    with torch.no_grad():
        x = bundle.vae.decode(lat[None].to(bundle.vae.dtype) / bundle.vae.config.scaling_factor).sample
    arr = ((x[0].float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
    return Image.fromarray(arr, mode="RGB")


def grid(rows: list[list], gap: int = 2):
    """Tiles (PIL images, all the same size) in rows, on a white background."""
    w, h = rows[0][0].size
    cols = max(len(r) for r in rows)
    g = Image.new("RGB", (cols * (w + gap) - gap, len(rows) * (h + gap) - gap), (255, 255, 255))
    for r, row in enumerate(rows):
        for c, tile in enumerate(row):
            g.paste(tile, (c * (w + gap), r * (h + gap)))
    return g


def write_grids(name: str, bundle, train: torch.Tensor, before: torch.Tensor, after: torch.Tensor,
                k: int, folder: str) -> list[str]:
    """One row per caption. Latents: training latent | k untrained | k trained samples. Decoded
    (32 px tiles, 64 colours, to keep the files small): the pattern | its latent decoded | k
    untrained | k trained."""
    os.makedirs(folder, exist_ok=True)

    def small(img):
        return img.resize((32, 32), Image.BILINEAR)

    kinds = {"latents": (lambda i: [], lambda z: latent_rgb(z, train)),
             "decoded": (lambda i: [small(pattern_image(PATTERNS[i], 64))],
                         lambda z: small(decoded(bundle, z)))}
    paths = []
    for kind, (first, tile) in kinds.items():
        rows = [first(i) + [tile(train[i])] + [tile(before[i * k + j]) for j in range(k)]
                + [tile(after[i * k + j]) for j in range(k)] for i in range(len(PATTERNS))]
        path = os.path.join(folder, f"learns_{name}_{kind}.png")
        img = grid(rows)
        if kind == "decoded":
            img = img.quantize(64)
        img.save(path, optimize=True)
        paths.append(path)
    return paths


# --- one family ------------------------------------------------------------------------------

def run_family(name: str, work: str, k: int = 2, images_dir: str | None = None,
               extra: tuple[str, ...] = (), reuse: bool = False, **overrides) -> dict:
    """Train, sample, measure one family; the table row. ``overrides``: Family fields (steps,
    lr, size, batch, norm_groups) other than the entry's; None keeps the entry's."""
    fam = dataclasses.replace(ENTRIES[name], **{f: v for f, v in overrides.items() if v is not None})
    steps, lr, batch = fam.steps, fam.lr, fam.batch
    data = write_dataset(os.path.join(work, "data"), max(1, batch // len(PATTERNS)), fam.size)
    if fam.norm_groups is not None and fam.norm_groups != builtin_groups(fam.model):
        fam = dataclasses.replace(fam, model=write_grouped_model(fam.model, fam.norm_groups,
                                                                 os.path.join(work, "model")))
    base = load_bundle(fam, None)
    if flow_of(fam.model) == "sd3":  # the autoencoder's factor is in the model file's record
        source, factor = write_unit_sd3(base, os.path.join(work, "initial.safetensors"), fam.size)
        fam, vae = dataclasses.replace(fam, model=source), None
    elif flow_of(fam.model) == "anima":  # its VAE normalises per channel: no scaling factor
        vae, factor = write_unit_qwen_vae(base.vae, os.path.join(work, "vae"), fam.size)
    else:
        vae, factor = write_unit_vae(base.vae, os.path.join(work, "vae"), fam.size)
    model_path, times = train(fam, data, vae, os.path.join(work, name), steps, lr, batch, extra, reuse)
    initial = load_bundle(fam, vae)
    trained = load_bundle(fam, vae, model_path)
    train_lat = training_latents(initial.vae, fam.size)
    before, labels = sample_latents(initial, k, fam.prompt_options, fam.size)
    after, _ = sample_latents(trained, k, fam.prompt_options, fam.size)
    noise = noise_like(train_lat, len(labels), seed=SEED + 1)
    a, b, c = (score(x, labels, train_lat) for x in (after, before, noise))
    groups = fam.norm_groups if fam.norm_groups != builtin_groups(ENTRIES[name].model) else None
    row = {"family": name, "model": ENTRIES[name].model, "norm_groups": groups, "steps": steps, "lr": lr, "batch": batch, "size": fam.size,
           "train_s": times["wall_s"], "cpu_s": times["cpu_s"],
           "d_trained": a["d"], "d_untrained": b["d"], "d_noise": c["d"],
           "ratio": a["d"] / min(b["d"], c["d"]), "learned": learned(a["d"], b["d"], c["d"]),
           "hits_trained": a["hits"],
           "hits_untrained": b["hits"], "hits_noise": c["hits"], "samples": len(labels),
           "vae_scaling_factor": factor, "x0_error_by_t": x0_error_by_t(trained, train_lat)}
    if images_dir:
        row["images"] = write_grids(name, initial, train_lat, before, after, k, images_dir)
    return row


def table(rows: list[dict]) -> str:
    head = ("| family | steps | train time (CPU) | d_trained | d_untrained | d_noise | ratio | learned | "
            "hits (trained / untrained / noise) |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        groups = f", {r['norm_groups']} groups" if r.get("norm_groups") else ""
        lines.append(f"| {r['family']} ({r['model']}{groups}) | {r['steps']} | "
                     f"{r['train_s']:.0f} s ({r['cpu_s']:.0f} s) | {r['d_trained']:.4f} | "
                     f"{r['d_untrained']:.4f} | {r['d_noise']:.4f} | {r['ratio']:.3f} | "
                     f"{'yes' if r['learned'] else 'no'} | {r['hits_trained']:.2f} / "
                     f"{r['hits_untrained']:.2f} / {r['hits_noise']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(ENTRIES))
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the family's)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the family's)")
    p.add_argument("--size", type=int, default=None, help="image size in pixels (default: the family's)")
    p.add_argument("--batch", type=int, default=None,
                   help="batch size, a multiple of 4 (default: the family's)")
    p.add_argument("--norm_groups", type=int, default=None,
                   help="the SD U-Net's GroupNorm groups (default: the family's; 32: the built-in model's)")
    p.add_argument("--train_args", default="", help="more options for the entry script, one string")
    p.add_argument("--reuse", action="store_true",
                   help="keep a model trained before in --out with the same command")
    p.add_argument("--k", type=int, default=2, help="samples per caption")
    p.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    p.add_argument("--images", default=None, help="write the grids here (e.g. docs/images)")
    a = p.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = a.out or tmp
        for name in a.families:
            rows.append(run_family(name, os.path.join(work, name), a.k, a.images, tuple(a.train_args.split()),
                                   a.reuse, steps=a.steps, lr=a.lr, size=a.size, batch=a.batch,
                                   norm_groups=a.norm_groups))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    print("RMS error of the trained model's x0 on noised training latents, by timestep:")
    for r in rows:
        print(f"  {r['family']}: " + ", ".join(f"t={t} {e:.3f}" for t, e in r["x0_error_by_t"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
