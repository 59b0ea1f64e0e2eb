"""gen_img.py's options and its list of images (no torch): sd-scripts' gen_img flags, the prompt
lines, the seeds.

    args = parse_args(argv)                  sd-scripts' flag names; one-line errors (GenError)
    prompts = read_prompts(args)             [(text, where)]: --prompt, or --from_file's lines
    jobs = plan_jobs(args, prompts, family)  one Job per image, in order, with its seed

A prompt line is the in-run samples' (library/training/sampling.py ``parse_line``: ``--n``,
``--w``, ``--h``, ``--s``, ``--l``, ``--ss``, ``--g``, Lumina 2's ``--ctr`` / ``--rcfg``) plus gen_img's ``--d`` (seeds, comma-
separated, one per image of the line) and ``--am`` (the networks' multipliers, comma-separated,
the last repeated for the remaining networks). A size must be a multiple of the family's latent
grid (``grid``); a bad option is one line naming the file and line.

Seeds, as sd-scripts' gen_img: with ``--seed S``, one prompt and one image, the image's seed is S;
otherwise the seeds are drawn from ``random.Random(S)`` (unseeded without ``--seed``), one per
image, except those a line's ``--d`` gives; ``--iter_same_seed`` draws one seed per iteration for
every image without ``--d``. An image's seed means what it means in diffusers: its initial latents
are those of ``torch.Generator("cpu").manual_seed(seed)``.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import re
import sys
from typing import Any
from dataclasses import dataclass

from library import text_files
from library.data.folders import IMAGE_EXTENSIONS
from library.errors import UserError
from library.training import sampling

SD_SAMPLERS = sampling.SAMPLER_CHOICES
MAX_SEED = 2 ** 32 - 1


class GenError(UserError):
    pass


@dataclass(frozen=True)
class Job:
    """One image: what the renderer needs, plus where its prompt came from."""
    prompt: str
    negative: str
    width: int
    height: int
    steps: int
    scale: float
    negative_scale: float | None
    guidance: float | None
    sampler: str
    seed: int
    muls: tuple[float, ...] | None
    where: str
    image: str | None = None    # img2img's source image (--image_path)
    cfg_trunc_ratio: float | None = None  # Lumina 2's CFG shaping (--ctr / --rcfg)
    renorm_cfg: float | None = None

    def batch_key(self) -> tuple:
        """Images with equal keys can share a batch."""
        return (self.width, self.height, self.steps, self.scale, self.negative_scale, self.guidance,
                self.sampler, self.muls, self.cfg_trunc_ratio, self.renorm_cfg)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's usage block is not one line)
        raise GenError(message)


# sd-scripts gen_img flags that this gen_img does not implement: refused by name, never ignored
_NOT_HERE = {
    "prompter module": ("a Python prompter module is not run here; give prompts with --prompt, --from_file "
                        "or --interactive", ("from_module", "prompter_module_args")),
    "inpainting": ("inpainting is not in gen_img here (train_inpainting's samples have it)", ("mask_path",)),
    "SDXL size conditioning": ("SDXL's size and crop conditioning is the image's own size here (diffusers' "
                               "default)", ("original_height", "original_width", "original_height_negative",
                                            "original_width_negative", "crop_top", "crop_left")),
    "VAE slices": ("sliced VAE decoding is not implemented; --vae_batch_size 1 decodes one image at a time",
                   ("vae_slices",)),
    "tokenizer cache": ("the CLIP tokenizers ship with the toolkit (--tokenizer_path for another)",
                        ("tokenizer_cache_dir",)),
    "network options": ("not implemented: --network_merge merges every network, --am sets multipliers per "
                        "prompt", ("network_merge_n_models", "network_pre_calc",
                                   "network_regional_mask_max_color_codes")),
    "emphasis": ("prompt weights act as A1111's 'No norm' emphasis here; sd-scripts' normalisation modes "
                 "are not implemented", ("emb_normalize_mode",)),
    "ControlNet": ("ControlNet and ControlNet-LLLite are not implemented in gen_img here",
                   ("guide_image_path", "control_net_lllite_models", "control_net_models", "control_net_preps",
                    "control_net_multipliers", "control_net_ratios", "highres_fix_disable_control_net")),
    "CLIP Vision": ("CLIP Vision conditioning is not implemented", ("clip_vision_strength",)),
    "highres fix extras": ("not implemented: the highres fix here is the 1st stage, LANCZOS, then img2img",
                           ("highres_fix_strength", "highres_fix_save_1st", "highres_fix_latents_upscaling",
                            "highres_fix_upscaler", "highres_fix_upscaler_args")),
    "Deep Shrink": ("Deep Shrink is not implemented", ("ds_depth_1", "ds_timesteps_1", "ds_depth_2",
                                                       "ds_timesteps_2", "ds_ratio")),
    "Gradual Latent": ("Gradual Latent is not implemented", (
        "gradual_latent_timesteps", "gradual_latent_ratio", "gradual_latent_ratio_step",
        "gradual_latent_every_n_steps", "gradual_latent_s_noise", "gradual_latent_unsharp_params")),
    "console logging": ("console logging is not configurable here", ("console_log_level", "console_log_file",
                                                                     "console_log_simple")),
}
REFUSED = {flag: why for why, flags in _NOT_HERE.values() for flag in flags}
# sd-scripts' flags that mean what one of ours does
ALIASES = {"diffusers_xformers": "xformers", "full_fp16": "fp16", "full_bf16": "bf16"}

GEN_IMG_DESCRIPTION = ("Generate images (sd-scripts' gen_img flags) with SD1/SD2/SDXL/FLUX.1/SD3 models, "
                       "LoRAs and embeddings; docs/GENERATION.md")


def build_parser(prog: str = "gen_img.py", description: str = GEN_IMG_DESCRIPTION) -> argparse.ArgumentParser:
    """gen_img's flags (tools/compare_checkpoints.py adds its own to them)."""
    p = _Parser(prog=prog, description=description, epilog=(
        "sd-scripts' flags refused here (one line each, with the reason): "
        + "; ".join(f"{k}: --{' --'.join(flags)}" for k, (_, flags) in _NOT_HERE.items())))
    p.add_argument("--ckpt", required=True, help="model: single file, diffusers folder, hub id or built-in name (tiny-sd15, ...)")
    p.add_argument("--vae", help="another VAE (SD1/SD2/SDXL; SD3: its autoencoder file)")
    p.add_argument("--v1", action="store_true", help="an SD1/SD2 model (checked against the weights)")
    p.add_argument("--v2", action="store_true", help="SD2 model (checked against the weights)")
    p.add_argument("--sdxl", action="store_true", help="an SDXL model (checked against the weights)")
    p.add_argument("--v_parameterization", action="store_true", help="v-prediction (detected from the model when it says)")
    p.add_argument("--clip_l", help="FLUX.1 / SD3: CLIP-L file")
    p.add_argument("--clip_g", help="SD3: CLIP-G file")
    p.add_argument("--t5xxl", help="FLUX.1 / SD3: T5-XXL file")
    p.add_argument("--ae", "--ae_path", dest="ae", help="FLUX.1 / Chroma / Lumina 2: autoencoder file")
    p.add_argument("--qwen3", help="Anima: the Qwen3 text encoder (a Hugging Face folder or one .safetensors file)")
    p.add_argument("--llm_adapter_path", help="Anima: the LLM adapter's weights in their own file")
    p.add_argument("--t5_tokenizer_path", help="Anima: folder of the T5 tokenizer the LLM adapter reads")
    p.add_argument("--qwen3_max_token_length", type=int, help="Anima: Qwen3 tokens (the training default)")
    p.add_argument("--t5_max_token_length", type=int, help="Anima: T5 tokens (the training default)")
    p.add_argument("--gemma2", "--gemma2_path", dest="gemma2",
                   help="Lumina 2: the Gemma-2 2B text encoder (a .safetensors file or a transformers folder)")
    p.add_argument("--gemma2_max_token_length", type=int, help="Lumina 2: Gemma-2 tokens (default 256)")
    p.add_argument("--system_prompt", help="Lumina 2: text before every prompt, as in training (sd-scripts' "
                   "--system_prompt; give the run's)")
    p.add_argument("--add_system_prompt_to_negative_prompt", action="store_true",
                   help="Lumina 2: the system prompt before the negative prompt too (sd-scripts' "
                   "lumina_minimal_inference; training's samples leave it out)")
    p.add_argument("--apply_t5_attn_mask", action="store_true", help="FLUX.1 / SD3: mask T5's padding")
    p.add_argument("--t5xxl_max_token_length", type=int, help="FLUX.1 / SD3: T5 tokens (the model's default)")
    p.add_argument("--tokenizer_path", help="CLIP tokenizer folder for a single file (default: the shipped one)")
    p.add_argument("--prompt", help="the prompt (prompt-line options allowed)")
    p.add_argument("--from_file", help="a file of prompts, one per line with prompt-line options ('#' comments)")
    p.add_argument("--interactive", action="store_true",
                   help="read prompt lines from standard input, each rendered as it comes, until end of input")
    p.add_argument("--no_preview", action="store_true", help="with --interactive: show no window (none is ever shown here)")
    p.add_argument("--shuffle_prompts", action="store_true", help="each iteration takes the prompts in a shuffled order")
    p.add_argument("--image_path", help="img2img (SD1/SD2/SDXL): a source image, or a folder of them (used in turn)")
    p.add_argument("--use_original_file_name", action="store_true", help="img2img: each file name starts with its source image's")
    p.add_argument("--outdir", required=True, help="folder for the images")
    p.add_argument("--images_per_prompt", type=int, default=1)
    p.add_argument("--n_iter", type=int, default=1, help="times the prompts are repeated")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--vae_batch_size", type=float,
                   help="images the VAE decodes at once (below 1: that share of --batch_size); default: the batch")
    p.add_argument("--W", type=int, help="width (default 512 for SD1/SD2, else 1024)")
    p.add_argument("--H", type=int, help="height (default 512 for SD1/SD2, else 1024)")
    p.add_argument("--steps", type=int, help="steps (default SD 50, FLUX.1 20, SD3 30)")
    p.add_argument("--scale", type=float, help="CFG scale (default 7.5; FLUX.1 1.0)")
    p.add_argument("--negative_scale", type=float, help="a separate scale for the negative prompt (uncond = empty prompt)")
    p.add_argument("--guidance_scale", type=float, help="FLUX.1 dev: the distilled guidance input (default 3.5)")
    p.add_argument("--shift", type=float, help="SD3: the schedule's shift (default 3.0)")
    p.add_argument("--cfg_trunc_ratio", type=float, help="Lumina 2: guidance only while 1 - sigma is below this "
                   "(default 0.25; a prompt's --ctr)")
    p.add_argument("--renorm_cfg", type=float, help="Lumina 2: the guided velocity's norm capped at this times the "
                   "conditional one's (default 1.0, 0: no cap; a prompt's --rcfg)")
    p.add_argument("--sampler", default="ddim", help=f"SD sampler: {', '.join(SD_SAMPLERS)} (FLUX.1 / SD3: Euler)")
    p.add_argument("--strength", type=float, help="img2img strength; highres fix: its 2nd stage's (default 0.8)")
    p.add_argument("--highres_fix_scale", type=float, help="highres fix: the 1st stage's size factor (< 1)")
    p.add_argument("--highres_fix_steps", type=int, default=28, help="highres fix: the 1st stage's steps")
    p.add_argument("--seed", type=int)
    p.add_argument("--iter_same_seed", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--sdpa", action="store_true", help="SDPA attention (the default)")
    p.add_argument("--xformers", action="store_true")
    p.add_argument("--clip_skip", type=int)
    p.add_argument("--max_embeddings_multiples", type=int, help="prompt length in 75-token windows: 1, 2 or 3")
    p.add_argument("--network_module", nargs="*", default=[], help="one per network (default: the family's LoRA)")
    p.add_argument("--network_weights", nargs="*", default=[])
    p.add_argument("--network_mul", type=float, nargs="*", default=[])
    p.add_argument("--network_merge", action="store_true", help="merge the networks into the weights")
    p.add_argument("--network_show_meta", action="store_true", help="log each network file's metadata")
    p.add_argument("--network_args", nargs="*", default=[], help="per network: 'key=value;key=value' for its module")
    p.add_argument("--no_half_vae", action="store_true", help="with --fp16 / --bf16: the VAE stays float32")
    p.add_argument("--opt_channels_last", action="store_true", help="the U-Net in channels-last memory format")
    p.add_argument("--textual_inversion_embeddings", nargs="*", default=[])
    p.add_argument("--sequential_file_name", action="store_true", help="im_000001.png, ... (after the folder's last)")
    for flag, ours in ALIASES.items():
        p.add_argument(f"--{flag}", action="store_true", dest=ours, help=f"as --{ours}")
    for flag in REFUSED:
        p.add_argument(f"--{flag}", nargs="*", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    check_args(args)
    return args


def check_args(args) -> None:
    """Values and combinations, before any weight loads."""
    for flag, why in REFUSED.items():
        if getattr(args, flag, None) is not None:
            raise GenError(f"--{flag}: {why}")
    if args.interactive and (args.prompt is not None or args.from_file is not None):
        raise GenError("--interactive reads the prompts from standard input: give no --prompt or --from_file")
    if not args.interactive and (args.prompt is None) == (args.from_file is None):
        raise GenError("give one of --prompt, --from_file or --interactive")
    if args.v1 and (args.v2 or args.sdxl):
        raise GenError("--v1 with --v2 / --sdxl: give the one the model is")
    if args.vae_batch_size is not None and not args.vae_batch_size > 0:
        raise GenError(f"--vae_batch_size must be above 0, got {args.vae_batch_size:g}")
    if args.use_original_file_name and not args.image_path:
        raise GenError("--use_original_file_name names the files after --image_path's images; no --image_path given")
    if args.image_path and args.highres_fix_scale is not None:
        raise GenError("--image_path with --highres_fix_scale: img2img as the highres fix's 1st stage is not implemented")
    args.init_images = init_images(args.image_path) if args.image_path else []
    for name in ("images_per_prompt", "n_iter", "batch_size", "steps", "highres_fix_steps"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise GenError(f"--{name} must be at least 1, got {v}")
    if args.fp16 and args.bf16:
        raise GenError("give one of --fp16 or --bf16")
    if args.max_embeddings_multiples not in (None, 1, 2, 3):
        raise GenError(f"--max_embeddings_multiples must be 1, 2 or 3, got {args.max_embeddings_multiples}")
    args.sampler = sampler_name(args.sampler, "--sampler")
    n = len(args.network_weights)
    if len(args.network_module) not in (0, 1, n):
        raise GenError(f"--network_module: {len(args.network_module)} modules for {n} --network_weights files")
    if len(args.network_mul) not in (0, n) or (n == 0 and args.network_mul):
        raise GenError(f"--network_mul: {len(args.network_mul)} multipliers for {n} --network_weights files")
    if len(args.network_args) > max(n, 0) or (args.network_args and n == 0):
        raise GenError(f"--network_args: {len(args.network_args)} entries for {n} --network_weights files")
    args.network_kwargs = [network_kwargs(a, i) for i, a in enumerate(args.network_args)]
    for path in [*args.network_weights, *args.textual_inversion_embeddings, args.from_file]:
        if path is not None and not os.path.isfile(path):
            raise GenError(f"{path}: no such file")
    if args.highres_fix_scale is not None and not 0 < args.highres_fix_scale < 1:
        raise GenError(f"--highres_fix_scale must be between 0 and 1 (the 1st stage's size factor), "
                       f"got {args.highres_fix_scale}")
    for name in ("cfg_trunc_ratio", "renorm_cfg"):
        v = getattr(args, name)
        if v is not None and not v >= 0:
            raise GenError(f"--{name} must be at least 0, got {v:g}")
    if args.strength is not None and not 0 < args.strength <= 1:
        raise GenError(f"--strength must be in (0, 1], got {args.strength}")


def init_images(path: str) -> list[str]:
    """--image_path: the file, or the folder's images in name order."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise GenError(f"--image_path {path}: no such file or folder")
    found = [os.path.join(path, f) for f in sorted(os.listdir(path))
             if os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS]
    if not found:
        raise GenError(f"--image_path {path}: holds no image ({', '.join(IMAGE_EXTENSIONS)})")
    return found


def vae_batch(args, batch: int) -> int:
    """sd-scripts' --vae_batch_size: a count, or below 1 a share of the batch (at least 1)."""
    v = args.vae_batch_size
    if v is None:
        return batch
    return max(1, int(batch * v)) if v < 1 else int(v)


def network_kwargs(text: str, i: int) -> dict[str, str]:
    """sd-scripts' ``--network_args`` entry of network i: ``key=value;key=value``."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise GenError(f"--network_args entry {i + 1}: {part!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def sampler_name(name: str, where: str) -> str:
    try:
        return sampling._sampler_name(name, where)
    except sampling.SamplingError as e:
        raise GenError(str(e)) from None


def read_prompts(args) -> list[tuple[str, str]]:
    """[(prompt line, where)]: ``--prompt``, or each non-empty, non-comment line of --from_file."""
    if args.prompt is not None:
        return [(args.prompt, "--prompt")]
    text = text_files.read(args.from_file, GenError, "from_file")
    lines = [(line.strip(), f"{args.from_file}:{n}") for n, line in enumerate(text.splitlines(), 1)
             if line.strip() and not line.strip().startswith("#")]
    if not lines:
        raise GenError(f"{args.from_file}: holds no prompt")
    return lines


# gen_img's own options of a prompt line; the others are the samples' (sampling.parse_line)
_OWN = re.compile(r"^(d|am|w|h|nl)\s+(.*)$", re.S)


def _numbers(value: str, kind, what: str, where: str) -> list:
    try:
        return [kind(v) for v in value.split(",") if v.strip()] or [kind("")]
    except ValueError:
        raise GenError(f"{where}: {what} must be {kind.__name__}s separated by commas, got {value!r}") from None


def parse_prompt_line(line: str, where: str) -> tuple[dict, dict]:
    """(the samples' prompt dict, gen_img's own values: seeds, muls, width, height, negative_scale)."""
    parts = line.split(" --")
    rest: list[str] = [parts[0]]
    own: dict[str, Any] = {}
    for part in parts[1:]:
        m = _OWN.match(part.strip())
        if m is None:
            rest.append(part)
            continue
        flag, value = m.group(1), m.group(2).strip()
        if flag == "d":
            own["seeds"] = _numbers(value, int, "--d", where)
            if any(not 0 <= s <= MAX_SEED for s in own["seeds"]):
                raise GenError(f"{where}: --d seeds must be in 0..{MAX_SEED}, got {value}")
        elif flag == "am":
            own["muls"] = _numbers(value, float, "--am", where)
        elif flag == "nl":
            own["negative_scale"] = None if value.lower() == "none" else _numbers(value, float, "--nl", where)[0]
        else:
            n = _numbers(value, int, f"--{flag}", where)
            if len(n) != 1:
                raise GenError(f"{where}: --{flag} takes one number, got {value!r}")
            own["width" if flag == "w" else "height"] = n[0]
    try:
        p = sampling.parse_line(" --".join(rest), where)
    except sampling.SamplingError as e:
        raise GenError(str(e)) from None
    if p["image"] is not None:
        raise GenError(f"{where}: --i is the in-run sample's inpainting image; gen_img has no inpainting")
    return p, own


def check_size(width: int, height: int, grid: int, where: str) -> None:
    for name, v in (("width", width), ("height", height)):
        if v < grid or v % grid:
            raise GenError(f"{where}: {name} {v} is not a multiple of {grid} (this model's latent grid)")


def _default(given, fallback):
    return fallback if given is None else given


def plan_jobs(args, prompts: list[tuple[str, str]], defaults: dict) -> list[Job]:
    """Every image of the run, in order. ``defaults``: the family's size, steps, scale,
    guidance and grid (generation.family_defaults)."""
    parsed = [(parse_prompt_line(line, where), where) for line, where in prompts]
    if args.seed is not None and len(prompts) == 1 and args.images_per_prompt == 1 and args.n_iter == 1:
        draw = lambda: args.seed  # noqa: E731 - sd-scripts: the seed itself
    else:
        rng = random.Random(args.seed)
        draw = lambda: rng.randint(0, MAX_SEED)  # noqa: E731
    jobs = []
    shuffler = random.Random(args.seed)  # its own generator: the seeds drawn stay those without it
    for _ in range(args.n_iter):
        iter_seed = draw() if args.iter_same_seed else None
        if args.shuffle_prompts:
            parsed = shuffler.sample(parsed, len(parsed))
        for (p, own), where in parsed:
            width = _default(own.get("width"), _default(args.W, defaults["size"]))
            height = _default(own.get("height"), _default(args.H, defaults["size"]))
            check_size(width, height, defaults["grid"], where if ("width" in own or "height" in own) else "--W/--H")
            negative_scale = own.get("negative_scale", args.negative_scale)
            if negative_scale is not None and defaults["flow"]:
                raise GenError(f"{where}: a negative scale (--negative_scale / --nl) is sd-scripts' gen_img's, "
                               "for SD1/SD2/SDXL")
            shaping = {}
            for key, flag in (("cfg_trunc_ratio", "--ctr"), ("renorm_cfg", "--rcfg")):
                given = _default(p[key], getattr(args, key))
                if given is not None and defaults.get(key) is None:
                    raise GenError(f"{where}: {flag} / --{key} shape Lumina 2's CFG; this model's has no "
                                   "truncation or renorm")
                shaping[key] = _default(given, defaults.get(key))
            muls = None
            if "muls" in own:
                n = len(args.network_weights)
                if n == 0:
                    raise GenError(f"{where}: --am sets the networks' multipliers; no --network_weights given")
                if args.network_merge:
                    raise GenError(f"{where}: --am needs unmerged networks; drop --network_merge")
                muls = tuple((own["muls"] + [own["muls"][-1]] * n)[:n])
            seeds = list(own.get("seeds", []))
            seed = 0  # set for the first image: --d's first seed, else drawn
            for _ in range(args.images_per_prompt):
                if seeds:
                    seed = seeds.pop(0)
                elif "seeds" not in own:  # sd-scripts: once --d's seeds run out, the last is kept
                    seed = iter_seed if iter_seed is not None else draw()
                scale = _default(p["scale"], _default(args.scale, defaults["scale"]))
                jobs.append(Job(prompt=p["prompt"], negative=p["negative_prompt"], width=width,
                                height=height,
                                steps=_default(p["sample_steps"], _default(args.steps, defaults["steps"])),
                                scale=scale, negative_scale=negative_scale,
                                guidance=_default(p["guidance_scale"], _default(args.guidance_scale,
                                                                                defaults["guidance"])),
                                sampler=p["sample_sampler"] or args.sampler, seed=seed, muls=muls,
                                where=where, **shaping))
    sources = args.init_images
    if sources:  # img2img: the source images in turn (sd-scripts)
        jobs = [dataclasses.replace(j, image=sources[k % len(sources)]) for k, j in enumerate(jobs)]
    return jobs


def batches(jobs: list[Job], size: int) -> list[list[Job]]:
    """Consecutive images with the same settings, at most ``size`` per batch."""
    out: list[list[Job]] = []
    for j in jobs:
        if out and len(out[-1]) < size and out[-1][0].batch_key() == j.batch_key():
            out[-1].append(j)
        else:
            out.append([j])
    return out


def run_main(work, argv: list[str] | None) -> int:
    """An image tool's main (gen_img.py, tools/compare_checkpoints.py): ``work(argv)``; a user
    error is one line (exit 2), Ctrl-C exits 130."""
    try:
        work(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    logging.shutdown()
    return 0


def check_output_dir(outdir: str) -> None:
    """--outdir is (or becomes) a writable folder, before any weight loads."""
    if os.path.exists(outdir) and not os.path.isdir(outdir):
        raise GenError(f"--outdir {outdir}: is a file, not a folder")
    try:
        os.makedirs(outdir, exist_ok=True)
    except OSError as e:
        raise GenError(f"--outdir {outdir}: cannot create it ({e.strerror or e})") from None
    if not os.access(outdir, os.W_OK):
        raise GenError(f"--outdir {outdir}: not writable")
