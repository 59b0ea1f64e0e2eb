"""Generate images from a model, its networks and embeddings: gen_img.py's core (sd-scripts'
gen_img, for every family the toolkit trains), callable by the UI.

    gen = Generator(args)                    model, embeddings, networks (hooked or merged)
    images = gen.render(batch)               PIL images of one batch of gen_options.Job
    paths = generate(args)                   the whole run: jobs, batches, PNGs with A1111's text

One implementation with the in-run samples (library/training/sampling.py): SD1/SD2/SDXL images come
from ``sampling.sd_batch`` (diffusers' pipeline over the model's components, the family model's
text conditioning with A1111 prompt weights, ``clip_skip`` and long prompts), FLUX.1 / SD3 images
from ``sampling.flow_batch`` (the family's Euler sampler; FLUX.1 dev's guidance input, SD3's
shift). A network acts through its hooks, at its multiplier (a prompt's ``--am``), or is merged
into the weights (``--network_merge``) before any dtype cast. Highres fix (SD): the 1st stage at
``highres_fix_scale`` times the size with ``highres_fix_steps`` steps, the image LANCZOS-resized
to the size, then diffusers' img2img pipeline at ``strength`` (0.8) from seed + 1, as sd-scripts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import logging
import os
import re
import sys
import time

import torch
from PIL import Image

from library.config import parse
from library.errors import UserError, first_line
from library.models import flow_family, loading
from library.models.families.sd_common import embeddings
from library.models.families import registry
from library.models.families.base import SHIFTED_SCHEDULES
from library.outputs import content_hash, gen_options, infotext
from library.outputs.gen_options import GenError, Job
from library.safetensors_file import read_header
from library.training import flow_sampling, network_options, sampling
from networks import lora

logger = logging.getLogger("sdtk")

SD_GEN_STEPS, SD_GEN_SCALE, STRENGTH = 50, 7.5, 0.8  # sd-scripts gen_img's defaults


def family_defaults(family: str, flux_guided: bool) -> dict:
    """The one place gen_img chooses by family: default size, steps, scale, guidance, and the
    latent grid sizes must be multiples of."""
    fam = registry.get(family)
    if fam.flow is not None:
        spec = fam.flow
        return {"size": fam.native_size, "steps": spec.sample_steps, "scale": spec.sample_scale,
                "guidance": spec.sample_guidance if flux_guided else None,
                "cfg_trunc_ratio": spec.sample_cfg_trunc_ratio, "renorm_cfg": spec.sample_renorm_cfg,
                "grid": spec.size_multiple, "flow": True,
                "network_module": network_options.FAMILY_LORA_MODULES[family]}
    return {"size": registry.get(family).native_size, "steps": SD_GEN_STEPS, "scale": SD_GEN_SCALE,
            "guidance": None, "cfg_trunc_ratio": None, "renorm_cfg": None, "grid": 8, "flow": False,
            "network_module": lora}


# gen_img's flags that are one family's parts or text options (the training options of the same
# names): a family that does not read one refuses it in one line, before any weight loads
PART_FLAGS = ("clip_l", "clip_g", "t5xxl", "ae", "apply_t5_attn_mask", "t5xxl_max_token_length", "qwen3",
              "llm_adapter_path", "t5_tokenizer_path", "qwen3_max_token_length", "t5_max_token_length", "gemma2",
              "gemma2_max_token_length", "system_prompt")


def _refusal(family, flag: str) -> str | None:
    """Why ``family`` does not read ``flag`` (None: it does): a flow family's own tables (another
    family's options, its ``unsupported``), for SD every flow family's option."""
    if family.flow is None:
        if flag not in flow_family.FLOW_OPTIONS:
            return None
        return f"an option of {registry.titles(flow=True, option=flag)}"
    return {**registry.foreign_options(family), **family.unsupported}.get(flag)


def _check_part_flags(args, family, title: str) -> None:
    for flag in PART_FLAGS:
        if getattr(args, flag, None) not in (None, False, ""):
            why = _refusal(family, flag)
            if why is not None:
                raise GenError(f"--{flag}: {why}; this model is {title}")


def _load_options(args):
    """The training options record the model loaders read (library/models/flow_family.py); a
    part flag the model's family does not read is refused here, before any weight loads."""
    values = {"pretrained_model_name_or_path": args.ckpt, "v2": args.v2,
              "v_parameterization": args.v_parameterization, "tokenizer_path": args.tokenizer_path,
              "xformers": args.xformers, "weighted_captions": True,
              **{flag: getattr(args, flag) for flag in PART_FLAGS if getattr(args, flag) not in (None, False)},
              "max_token_length": None if (args.max_embeddings_multiples or 1) == 1
              else 75 * args.max_embeddings_multiples}
    fam = flow_family.family_before_loading(args.ckpt)
    family = registry.get(fam or "sd1")  # the SD families read the same parts (told apart once loaded)
    _check_part_flags(args, family, family.title if fam else
                      "/".join(f.title for f in registry.FAMILIES.values() if f.flow is None))
    if fam is None:
        values["vae"] = args.vae
    elif family.autoencoder_option == "vae":
        if "ae" in family.unsupported:  # Anima: its loader reads vae
            values["vae"] = args.vae
        else:  # SD3: its VAE is the flow loader's ae
            values["ae"] = args.ae or args.vae
    elif args.vae:
        raise GenError(f"--vae: a {family.title} model's autoencoder is --ae")
    return parse.options_from_values("train_lora", values)


def _flag_message(e: UserError) -> str:
    """A loader's one line, with the training option it names as gen_img's flag."""
    msg = str(e).replace("pretrained_model_name_or_path", "--ckpt")
    name = msg.partition(":")[0]
    return f"--{msg}" if name in (*PART_FLAGS, "vae") else msg


def _file_hash(path: str) -> str:
    return content_hash.sha256_file(path)


def model_hash(source: str) -> str:
    """A1111's short model hash (sha256 of the file, 10 hex digits); a folder: of its weight
    files' hashes; a built-in model: of its name."""
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        return _file_hash(path)[:10]
    if os.path.isdir(path):
        digests = "".join(_file_hash(f) for f in sorted(content_hash.weight_files(path)))
        return hashlib.sha256(digests.encode()).hexdigest()[:10]
    return hashlib.sha256(f"builtin:{source}".encode()).hexdigest()[:10]


def lora_hash(path: str) -> str:
    """A1111's LoRA hash: the addnet hash of a .safetensors file (sha256 of the tensors after the
    header), else the file's sha256; 12 hex digits."""
    if path.lower().endswith(".safetensors"):
        with open(path, "rb") as f:
            return lora.addnet_hash_safetensors(f)[:12]
    return _file_hash(path)[:12]


class LoadedNetwork:
    def __init__(self, path: str, network, multiplier: float, merged: bool):
        self.path, self.network, self.multiplier, self.merged = path, network, multiplier, merged
        self.name = os.path.splitext(os.path.basename(path))[0]
        self.hash = lora_hash(path)


class Generator:
    """The model of a gen_img run with its embeddings and networks, on its device and dtype."""

    def __init__(self, args):
        self.args = args
        opts = _load_options(args)
        try:
            self.bundle = b = flow_family.load_from_options(opts)
        except UserError as e:  # a one-line error of the loaders, which name the training option
            raise GenError(_flag_message(e)) from None
        except (OSError, ValueError, RuntimeError) as e:
            raise GenError(f"--ckpt {args.ckpt}: cannot load it ({first_line(e)})") from None
        self.flow = sampling.is_flow(b)
        flow = registry.of(b).flow
        guided = flow is not None and flow.sample_guidance is not None and \
            bool(getattr(b.unet.config, "guidance_embed", False))
        self.defaults = family_defaults(b.family, guided)
        self._check_family(args)
        self.dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        rewrite = self._embeddings(args.textual_inversion_embeddings)
        self.networks = self._networks(args)
        loading.set_attention(b, opts)
        if self.dtype != torch.float32 or self.device.type != "cpu":
            for m in [b.unet, *b.text_encoders, *(n.network for n in self.networks if not n.merged)]:
                m.to(self.device, self.dtype)
            b.vae.to(self.device, torch.float32 if args.no_half_vae else self.dtype)
        if self.device.type == "cpu":  # a file's weights compute the built-in model's image bit for bit
            loading.align_for_cpu(*(m for m in (b.unet, *b.text_encoders, b.vae) if isinstance(m, torch.nn.Module)))
        if args.opt_channels_last:
            b.unet.to(memory_format=torch.channels_last)
        self.family_model = flow_family.family_model_for(b, opts, rewrite=rewrite)
        if args.add_system_prompt_to_negative_prompt:
            if _refusal(registry.of(b), "system_prompt") is not None:  # a family without a system prompt
                raise GenError(f"--add_system_prompt_to_negative_prompt: Lumina 2's system prompt; this model is "
                               f"{self.family_name}")
            self.family_model.negative_system_prompt = True
        self.pipe = sampling.pipeline(b)
        self.img2img = sampling.pipeline(b, kind="img2img") if args.highres_fix_scale or args.image_path else None
        self.model_hash = model_hash(b.source)

    def _check_family(self, args) -> None:
        family = registry.of(self.bundle)
        fam = family.title
        if args.sdxl and registry.for_gui({"sdxl": True}) is not family:
            raise GenError(f"--sdxl: this model is {fam}")
        if args.v1 and (family.gui_boxes or args.v_parameterization):
            raise GenError(f"--v1: this model is {fam}" if family.gui_boxes else "--v1 with --v_parameterization")
        if family.flow is None:
            if args.shift is not None or args.guidance_scale is not None:
                raise GenError("--shift / --guidance_scale are FLUX.1 / SD3 options; this model is SD")
            return
        for flag in ("highres_fix_scale", "image_path"):
            if getattr(args, flag) is not None:
                raise GenError(f"--{flag}: SD1/SD2/SDXL (sd-scripts' gen_img); this model is {fam}")
        if args.textual_inversion_embeddings:
            raise GenError(f"--textual_inversion_embeddings: SD1/SD2/SDXL embeddings; this model is {fam}")
        if args.clip_skip is not None:
            raise GenError(f"--clip_skip: an SD option; this model is {fam}")
        flow = registry.of(self.bundle).flow
        if args.shift is not None and flow is not None and flow.sample_schedule not in SHIFTED_SCHEDULES:
            raise GenError("--shift is SD3's; FLUX.1's schedule is shifted by the image's size")
        if args.guidance_scale is not None and self.defaults["guidance"] is None:
            raise GenError(f"--guidance_scale is FLUX.1 dev's guidance input; this {fam} model has none")

    def _embeddings(self, paths: list[str]):
        """Textual inversion files: each file's token is its name (A1111, sd-scripts), with as many
        vectors as the file holds; returns the prompt rewriter for multi-vector tokens."""
        if not paths:
            return None
        b = self.bundle
        loaded = [(p, embeddings.read_embedding_file(p, b.family)) for p in paths]
        specs = [embeddings.TokenSpec(os.path.splitext(os.path.basename(p))[0], None, int(t[0].shape[0]))
                 for p, t in loaded]
        embeddings.check_specs(specs, "--textual_inversion_embeddings")
        tokens = embeddings.NewTokens(specs, "--textual_inversion_embeddings")
        tokens.install(b.tokenizers, b.text_encoders, 0, b.text_encoders[0].dtype)
        for spec, (p, tensors) in zip(specs, loaded):
            tokens.load_rows(spec, tensors, p)
        for m in tokens.modules:
            m.requires_grad_(False)
        return embeddings.prompt_rewriter(specs)

    def _networks(self, args) -> list[LoadedNetwork]:
        out = []
        for i, path in enumerate(args.network_weights):
            mods = args.network_module
            module = (mods[i] if len(mods) > 1 else mods[0]) if mods else None
            mul = args.network_mul[i] if args.network_mul else 1.0
            kwargs = args.network_kwargs[i] if i < len(args.network_kwargs) else {}
            if args.network_show_meta:
                show_metadata(path)
            out.append(self.load_network(path, module, mul, kwargs, args.network_merge))
            logger.info(f"network {path}: {'merged' if args.network_merge else 'applied'} at {mul}")
        return out

    def load_network(self, path: str, module_name: str | None, mul: float, kwargs: dict,
                     merge: bool) -> LoadedNetwork:
        """The network in ``path`` (module ``module_name``, default the family's), hooked at
        ``mul`` or merged into the weights; a bad file is one GenError line naming it."""
        b = self.bundle
        tes = b.text_encoders if len(b.text_encoders) > 1 else b.text_encoders[0]
        module = self.defaults["network_module"]
        if module_name:
            try:
                module = importlib.import_module(module_name)
            except ImportError as e:
                raise GenError(f"--network_module {module_name}: cannot import it ({e})") from None
        try:
            sd = lora.load_state_dict_file(path)
            sd = {k: v for k, v in sd.items() if not k.startswith("bundle_emb.")}
            network, _ = module.create_network_from_weights(mul, path, b.vae, tes, b.unet, weights_sd=sd, **kwargs)
            if merge:
                network.merge_to(tes, b.unet, sd)
            else:
                network.apply_to(tes, b.unet, True, True)
                info = network.load_state_dict(sd, strict=False)
                if info.unexpected_keys:
                    unhook(network)
                    raise GenError(f"{len(info.unexpected_keys)} key(s) match no module of the network, "
                                   f"e.g. {info.unexpected_keys[0]}")
                network.requires_grad_(False)
                network.eval()
        except UserError as e:
            msg = str(e).replace(f"{path}: ", "").replace(f"weights {path}", "the file")
            if "exist in this model" in msg or "match no module" in msg:
                msg += f" (a network for another model family or base model? this model is {self.family_name})"
            raise GenError(f"--network_weights {path}: {msg}") from None
        except (OSError, RuntimeError, ValueError, TypeError) as e:
            raise GenError(f"--network_weights {path}: {first_line(e)}") from None
        return LoadedNetwork(path, network, mul, merge)

    def swap_network(self, path: str, module_name: str | None = None, kwargs: dict | None = None) -> LoadedNetwork:
        """Unhook the current networks and hook the one in ``path`` instead (the base model stays
        loaded: the checkpoint grid renders a run's files one after another)."""
        if any(n.merged for n in self.networks):
            raise GenError("--network_merge: merged networks cannot be swapped")
        for n in self.networks:
            unhook(n.network)
        self.networks = []
        n = self.load_network(path, module_name, 1.0, kwargs or {}, False)
        if self.dtype != torch.float32 or self.device.type != "cpu":
            n.network.to(self.device, self.dtype)
        self.networks = [n]
        return n

    @property
    def family_name(self) -> str:
        return registry.of(self.bundle).title

    def _set_multipliers(self, muls) -> None:
        for n, m in zip(self.networks, muls or [n.multiplier for n in self.networks]):
            if not n.merged:
                n.network.set_multiplier(m)

    def render(self, batch: list[Job]) -> list:
        """The PIL images of one batch (equal settings, gen_options.batches)."""
        j = batch[0]
        self._set_multipliers(j.muls)
        images = sampling.PromptBatch([x.prompt for x in batch], [x.negative for x in batch],
                                      [x.seed for x in batch], width=j.width, height=j.height,
                                      steps=j.steps, scale=j.scale, cfg_trunc_ratio=j.cfg_trunc_ratio,
                                      renorm_cfg=j.renorm_cfg)
        with torch.no_grad():
            if self.flow:
                latents = sampling.flow_batch(
                    self.bundle, self.family_model, images, guidance=j.guidance, device=self.device,
                    dtype=self.dtype, shift=self.args.shift, packed_draw=False)
                return [flow_sampling.decode_image(self.bundle.vae, latents[i:i + 1]) for i in range(len(batch))]
            kw: dict = dict(negative_scale=j.negative_scale)
            encoder = sampling.PromptEncoder(self.family_model, self.device, self.args.clip_skip)
            chunk = gen_options.vae_batch(self.args, len(batch))
            if chunk < len(batch):  # --vae_batch_size: latents out, decoded in smaller batches
                kw["output_type"] = "latent"
            strength = STRENGTH if self.args.strength is None else self.args.strength
            if j.image is not None:  # img2img from --image_path (the image's size: the job's)
                sources = [load_source(parse.required(x.image, "--image_path"), x.width, x.height) for x in batch]
                out = sampling.sd_batch(self.bundle, encoder, self.img2img, images,
                                        sampler=j.sampler, extra={"image": sources, "strength": strength}, **kw)
            elif self.args.highres_fix_scale is None:
                out = sampling.sd_batch(self.bundle, encoder, self.pipe, images, sampler=j.sampler, **kw)
            else:
                w1, h1 = (_first_stage(v, self.args.highres_fix_scale) for v in (j.width, j.height))
                first = sampling.sd_batch(self.bundle, encoder, self.pipe,
                                          dataclasses.replace(images, width=w1, height=h1,
                                                              steps=self.args.highres_fix_steps),
                                          sampler=j.sampler, **{**kw, "output_type": "pil"})
                up = [im.resize((j.width, j.height), Image.LANCZOS) for im in first]
                out = sampling.sd_batch(self.bundle, encoder, self.img2img,
                                        dataclasses.replace(images, seeds=[s + 1 for s in images.seeds]),
                                        sampler=j.sampler, extra={"image": up, "strength": strength}, **kw)
            return out if chunk >= len(batch) else decode(self.pipe, out, chunk)

    def parameters(self, job: Job) -> str:
        """A1111's ``parameters`` text of one image."""
        loras = [(n.name, (job.muls[i] if job.muls else n.multiplier), n.hash) for i, n in enumerate(self.networks)]
        args = self.args
        fields = {"Steps": job.steps,
                  "Sampler": infotext.A1111_SAMPLERS["flow_euler" if self.flow else job.sampler],
                  "CFG scale": f"{job.scale:g}",
                  "Negative scale": None if job.negative_scale is None else f"{job.negative_scale:g}",
                  "Seed": job.seed, "Size": f"{job.width}x{job.height}",
                  "Model hash": self.model_hash,
                  "Model": os.path.splitext(os.path.basename(os.path.normpath(self.bundle.source)))[0],
                  "Distilled CFG Scale": None if job.guidance is None else f"{job.guidance:g}",
                  "Shift": None if args.shift is None else f"{args.shift:g}",
                  "CFG truncation": None if job.cfg_trunc_ratio is None else f"{job.cfg_trunc_ratio:g}",
                  "CFG renorm": None if job.renorm_cfg is None else f"{job.renorm_cfg:g}",
                  "Clip skip": args.clip_skip,
                  "Hires upscale": None if args.highres_fix_scale is None else f"{1 / args.highres_fix_scale:g}",
                  "Hires steps": None if args.highres_fix_scale is None else job.steps,
                  "Denoising strength": None if args.highres_fix_scale is None and job.image is None
                  else f"{STRENGTH if args.strength is None else args.strength:g}",
                  "Hires upscaler": None if args.highres_fix_scale is None else "Lanczos",
                  "Emphasis": None if self.flow else "No norm"}
        return infotext.parameters(job.prompt, job.negative, fields, loras)


def load_source(path: str, width: int, height: int):
    """An img2img source image: RGB, LANCZOS-resized to the image's size."""
    try:
        with Image.open(path) as im:
            return im.convert("RGB").resize((width, height), Image.LANCZOS)
    except (OSError, ValueError) as e:
        raise GenError(f"--image_path {path}: cannot read it ({first_line(e)})") from None


def decode(pipe, latents, chunk: int) -> list:
    """Latents to PIL images, ``chunk`` at a time (--vae_batch_size), as the pipeline decodes (an
    SDXL pipeline's float16 VAE with ``force_upcast`` decodes in float32, as diffusers' does)."""
    vae, out, dtype = pipe.vae, [], pipe.vae.dtype
    upcast = dtype == torch.float16 and getattr(vae.config, "force_upcast", False) and hasattr(pipe, "upcast_vae")
    if upcast:
        vae.to(torch.float32)
    try:
        with torch.no_grad():
            for i in range(0, len(latents), chunk):
                z = latents[i:i + chunk].to(vae.dtype) / vae.config.scaling_factor
                out += pipe.image_processor.postprocess(vae.decode(z, return_dict=False)[0], output_type="pil")
    finally:
        if upcast:
            vae.to(dtype)
    return out


def show_metadata(path: str) -> None:
    """--network_show_meta: the file's metadata, a line per key."""
    if not path.lower().endswith(".safetensors"):
        logger.info(f"metadata of {path}: none (not a .safetensors file)")
        return
    try:
        md = read_header(path)[1].get("__metadata__") or {}
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise GenError(f"--network_weights {path}: not a safetensors file ({e})") from None
    logger.info(f"metadata of {path}: {len(md)} keys")
    for k in sorted(md):
        logger.info(f"  {k}: {md[k]}")


def unhook(network) -> None:
    """Restore the forwards a hooked network replaced (its ``remove_from``, else each module's
    ``restore``)."""
    if hasattr(network, "remove_from"):
        network.remove_from()
        return
    hooked = [m for m in network.modules() if m is not network and hasattr(m, "restore")]
    if not hooked:
        raise GenError(f"{type(network).__name__}: this network cannot be removed from the model")
    for m in hooked:
        m.restore()


def _first_stage(v: int, scale: float) -> int:
    """sd-scripts' 1st-stage size: round(v x scale), down to a multiple of 32."""
    v1 = int(v * scale + 0.5)
    return max(32, v1 - v1 % 32)


def _sequential_start(outdir: str) -> int:
    nums = [int(m.group(1)) for f in os.listdir(outdir) if (m := re.fullmatch(r"im_(\d{6})\.png", f))]
    return max(nums, default=0)


def check_before_loading(args) -> list[tuple[str, str]]:
    """The prompts (``read_prompts``), their lines and the output folder checked before the
    weights load (the latent grid is checked again once the family is known)."""
    prompts = gen_options.read_prompts(args)
    gen_options.check_output_dir(args.outdir)
    fam = flow_family.family_before_loading(args.ckpt)
    gen_options.plan_jobs(args, prompts, family_defaults(fam or "sd1", True))
    return prompts


def _stdin_prompts():
    """--interactive: (prompt line, where) per non-empty line of standard input, until its end."""
    n = 0
    while True:
        if sys.stdin.isatty():
            print("prompt> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        n += 1
        if line.strip() and not line.strip().startswith("#"):
            yield line.strip(), f"stdin:{n}"


def generate(args) -> list[str]:
    """The run: load, plan the images, render them batch by batch, write each PNG with its text.
    ``--interactive``: the model loads once, then each line of standard input is planned and
    rendered as it comes (a bad line is one error line, and the next line is read)."""
    if args.interactive:
        gen_options.check_output_dir(args.outdir)
        gen, writer, written = Generator(args), _Writer(args), []
        for prompt in _stdin_prompts():
            try:
                jobs = gen_options.plan_jobs(args, [prompt], gen.defaults)
            except GenError as e:
                print(f"error: {e}", file=sys.stderr)
                continue
            written += writer.render(gen, jobs)
        return written
    prompts = check_before_loading(args)
    gen = Generator(args)
    t0 = time.perf_counter()
    written = _Writer(args).render(gen, gen_options.plan_jobs(args, prompts, gen.defaults))
    logger.info(f"{len(written)} images in {args.outdir} ({time.perf_counter() - t0:.1f} s)")
    return written


class _Writer:
    """Names and writes a run's PNGs: ``im_<time>_<n>_<seed>.png``, sd-scripts' sequential
    ``im_000001.png`` (after the folder's last), with ``--use_original_file_name`` the source
    image's name first."""

    def __init__(self, args):
        self.args, self.n = args, 0
        self.n0 = _sequential_start(args.outdir) if args.sequential_file_name else 0
        self.stamp = time.strftime("%Y%m%d%H%M%S", time.localtime())

    def render(self, gen: Generator, jobs: list[Job]) -> list[str]:
        written = []
        for batch in gen_options.batches(jobs, self.args.batch_size):
            for job, image in zip(batch, gen.render(batch)):
                self.n += 1
                name = f"im_{self.n0 + self.n:06d}.png" if self.args.sequential_file_name \
                    else f"im_{self.stamp}_{self.n:03d}_{job.seed}.png"
                if self.args.use_original_file_name and job.image is not None:  # checked: img2img
                    name = f"{os.path.splitext(os.path.basename(job.image))[0]}-{name}"
                path = os.path.join(self.args.outdir, name)
                infotext.save_png(image, path, gen.parameters(job), {
                    "prompt": job.prompt, "negative-prompt": job.negative, "seed": job.seed,
                    "sampler": job.sampler, "steps": job.steps, "scale": job.scale,
                    **({} if job.negative_scale is None else {"negative-scale": job.negative_scale})})
                written.append(path)
        return written
