"""Where a model comes from and how it is loaded into one `ModelBundle`.

Sources: a built-in name (tiny-sd15, tiny-sd2, tiny-sdxl; sd15-arch, sd2-arch, sdxl-arch for
full-size random weights), a diffusers folder, a single file in the original SD/SDXL layout, or a
hub id (only when online). No torch/diffusers import at module level: `--dry_run` resolves the
source without paying for them.

Identities (cache keys for latents / text-encoder outputs) are cheap on purpose: a file is
identified by sha256(absolute path, size, mtime_ns), a folder by the same over every file in it;
hashing the weights of a multi-GB checkpoint would take longer than the cache saves. Rewriting a
file changes its mtime, so changed weights never reuse stale cache entries.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from library import symlinks
from library.config.parse import required
from library.errors import ModelError, UserError, first_line
from library.models import inpainting, sd_checkpoint
from library.models.families.sd_common import tiny_models
from library.models.families import registry
from library.models.sd_checkpoint import quiet_progress

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
SHIPPED_CONFIGS = os.path.join(ROOT, "configs", "models")
SHIPPED_TOKENIZER = os.path.join(ROOT, "configs", "tokenizers", "clip")

TINY_BUILTINS = {"tiny-sd15": "sd15", "tiny-sd2": "sd2", "tiny-sdxl": "sdxl",
                 # inpainting models (9-channel U-Net input): library/models/inpainting.py
                 "tiny-sd15-inpaint": "sd15", "tiny-sd2-inpaint": "sd2", "tiny-sdxl-inpaint": "sdxl"}
ARCH_BUILTINS = {"sd15-arch": "sd15", "sd2-arch": "sd2", "sdxl-arch": "sdxl"}
# the flow families' tiny built-ins (each family's ``tiny_models``), loaded by their homes
# (library/models/flow_family.py)
FLOW_BUILTINS = {n: f.name for f in registry.FAMILIES.values() if f.flow is not None for n in f.tiny_models}
BUILTINS = {**TINY_BUILTINS, **ARCH_BUILTINS, **FLOW_BUILTINS}
FAMILY_OF_ARCH = {"sd15": "sd1", "sd2": "sd2", "sdxl": "sdxl", **{n: n for n in registry.FLOW_FAMILIES}}
ARCH_OF_FAMILY = {v: k for k, v in FAMILY_OF_ARCH.items()}
WEIGHT_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
ARCH_SEED = 20240602
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "builtin" | "diffusers" | "single_file" | "hub"
    location: str  # absolute path, builtin name or hub id
    arch: str = ""  # sd15 / sd2 / sdxl, for builtins ("" for the other kinds)


def resolve_model_source(name_or_path: str) -> ModelSource:
    """Classify `pretrained_model_name_or_path` without loading anything."""
    p = os.path.expanduser(str(name_or_path))
    if os.path.islink(p) and not os.path.exists(p):
        raise ModelError(f"pretrained_model_name_or_path: {name_or_path} is {symlinks.problem(p)}")
    if os.path.exists(p):
        if name_or_path in BUILTINS:
            logger.warning("pretrained_model_name_or_path: %s is an existing path; using it instead of the "
                           "built-in model of the same name", name_or_path)
        kind = "diffusers" if os.path.isdir(p) else "single_file"
        broken = symlinks.first_broken(p) if kind == "diffusers" else None
        if broken:  # diffusers would report a missing file, or a raw OSError
            raise ModelError(f"pretrained_model_name_or_path: {broken} is {symlinks.problem(broken)}")
        return ModelSource(kind, os.path.abspath(p))
    if name_or_path in BUILTINS:
        return ModelSource("builtin", name_or_path, BUILTINS[name_or_path])
    looks_like_path = (p.lower().endswith(WEIGHT_SUFFIXES) or p.startswith((".", "/", "~", "\\"))
                       or p.count("/") > 1 or "\\" in p or os.path.isabs(p))
    if HUB_ID.match(name_or_path) and not looks_like_path:
        return ModelSource("hub", name_or_path)
    if looks_like_path or "/" in p:
        raise ModelError(f"pretrained_model_name_or_path: no such file or directory: {name_or_path}")
    raise ModelError(f"pretrained_model_name_or_path: no such file or directory: {name_or_path} "
                     f"(and not a built-in model: {', '.join(BUILTINS)})")


# --- identities ------------------------------------------------------------------------------

def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def path_identity(path: str) -> str:
    """sha256 of (absolute path, size, mtime_ns) of the file, or of every file under the folder."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        st = os.stat(path)
        return "file:" + _sha(f"{path}|{st.st_size}|{st.st_mtime_ns}")
    parts = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            st = os.stat(full)
            parts.append(f"{os.path.relpath(full, path)}|{st.st_size}|{st.st_mtime_ns}")
    return "dir:" + _sha(path + "\n" + "\n".join(parts))


# --- the bundle ------------------------------------------------------------------------------

@dataclass
class ModelBundle:
    family: str  # "sd1" | "sd2" | "sdxl" | "flux"
    unet: Any
    vae: Any
    text_encoders: list
    tokenizers: list
    noise_scheduler: Any  # DDPMScheduler with the model's betas and prediction type
    v_parameterization: bool
    source: str
    identity: str
    vae_identity: str
    scheduler_config: dict = field(default_factory=dict)  # the model's own (inference) scheduler config
    flow: Any = None  # FLUX.1: the FluxModel (variant, layout, config) the parts came from

    def components(self) -> dict:
        """Components under diffusers pipeline names (what sd_checkpoint.save_* take)."""
        out = {"unet": self.unet, "vae": self.vae, "text_encoder": self.text_encoders[0],
               "tokenizer": self.tokenizers[0], "scheduler": self.noise_scheduler}
        if self.family == "sdxl":
            out["text_encoder_2"] = self.text_encoders[1]
            out["tokenizer_2"] = self.tokenizers[1]
        return out


# --- tokenizers ------------------------------------------------------------------------------

def _has_tokenizer_files(d: str) -> bool:
    return os.path.isfile(os.path.join(d, "tokenizer.json")) or (
        os.path.isfile(os.path.join(d, "vocab.json")) and os.path.isfile(os.path.join(d, "merges.txt")))


def _load_tokenizers(family: str, text_encoders: list, source: str, *, folder: str | None,
                     tokenizer_path: str | None, record: dict | None, record_dir: str | None) -> list:
    """One CLIPTokenizer per text encoder, from (in order) tokenizer_path, the model's own
    folder/record, or the shipped CLIP files (SDXL's second one pads with '!', as SDXL does)."""
    # lazy: the dry run's plan loads this module before torch; transformers is imported when
    # _load_tokenizers() runs
    from transformers import CLIPTokenizer

    names = ["tokenizer", "tokenizer_2"] if family == "sdxl" else ["tokenizer"]
    toks = []
    for i, name in enumerate(names):
        pad = {"pad_token": "!"} if i == 1 else {}
        where, kwargs = None, {}
        if tokenizer_path:
            tp = os.path.expanduser(tokenizer_path)
            if not os.path.exists(tp):
                raise ModelError(f"tokenizer_path: no such file or directory: {tokenizer_path}")
            if _has_tokenizer_files(os.path.join(tp, name)):
                where = os.path.join(tp, name)
            elif _has_tokenizer_files(os.path.join(tp, "tokenizer")):  # one vocabulary for both
                where, kwargs = os.path.join(tp, "tokenizer"), pad
            elif _has_tokenizer_files(tp):
                where, kwargs = tp, pad
            else:
                raise ModelError(f"tokenizer_path: {tokenizer_path} has no tokenizer files "
                                 "(vocab.json + merges.txt, or tokenizer.json)")
        elif folder and _has_tokenizer_files(os.path.join(folder, name)):
            where = os.path.join(folder, name)
        elif record_dir and _has_tokenizer_files(os.path.join(record_dir, name)):
            where = os.path.join(record_dir, name)
        elif _has_tokenizer_files(SHIPPED_TOKENIZER):
            where, kwargs = SHIPPED_TOKENIZER, pad
            if record and record.get(name, {}).get("pad_token"):
                kwargs = {"pad_token": record[name]["pad_token"]}
        else:
            raise ModelError(f"{source}: no {name} files found and the shipped CLIP tokenizer "
                             f"({SHIPPED_TOKENIZER}) is missing; pass --tokenizer_path")
        tok = CLIPTokenizer.from_pretrained(where, **kwargs)
        vocab = text_encoders[i].config.vocab_size
        if len(tok) > vocab:
            raise ModelError(f"{source}: the {name} from {where} has {len(tok)} tokens but the text encoder "
                             f"only {vocab}; pass --tokenizer_path with the model's own tokenizer")
        toks.append(tok)
    return toks


# --- schedulers ------------------------------------------------------------------------------

def _noise_scheduler(config: dict, v_parameterization: bool):
    # lazy: the dry run's plan loads this module before torch; diffusers is imported when
    # _noise_scheduler() runs
    from diffusers import DDPMScheduler

    # Training uses DDPM noising with the model's betas (sd-scripts does the same).
    return DDPMScheduler(num_train_timesteps=config.get("num_train_timesteps", 1000),
                         beta_start=config.get("beta_start", 0.00085), beta_end=config.get("beta_end", 0.012),
                         beta_schedule=config.get("beta_schedule", "scaled_linear"),
                         trained_betas=config.get("trained_betas"), clip_sample=False,
                         prediction_type="v_prediction" if v_parameterization else "epsilon")


def read_json(path: str) -> dict:
    """A JSON config file's content; unreadable or not JSON: a ModelError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read ({first_line(e, typed=True)})") from None


# --- builtins --------------------------------------------------------------------------------

def _build_arch(arch: str) -> dict:
    """Full-size random weights from the shipped real architecture configs (benchmarks)."""
    # lazy: the dry run's plan loads this module before torch; torch, diffusers and transformers are
    # imported when _build_arch() runs
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    base = os.path.join(SHIPPED_CONFIGS, arch)
    out: dict[str, Any] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ARCH_SEED)
        out["unet"] = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(base, subfolder="unet"))
        out["vae"] = AutoencoderKL.from_config(AutoencoderKL.load_config(base, subfolder="vae"))
        for name, cls in (("text_encoder", CLIPTextModel), ("text_encoder_2", CLIPTextModelWithProjection)):
            cfg_path = os.path.join(base, name, "config.json")
            if os.path.isfile(cfg_path):
                out[name] = cls(CLIPTextConfig.from_json_file(cfg_path)).eval()
    return out


def _load_builtin(src: ModelSource, tokenizer_path: str | None) -> tuple[dict, str, dict, str, str]:
    arch = src.arch
    family = FAMILY_OF_ARCH[arch]
    if src.location in TINY_BUILTINS:
        comps = tiny_models.build_tiny_components(
            arch, inpaint=src.location.endswith(tiny_models.INPAINT_SUFFIX))
        sched = tiny_models.scheduler_config(arch)
        seed = tiny_models.SEED
    else:
        comps = _build_arch(arch)
        sched = read_json(os.path.join(SHIPPED_CONFIGS, arch, "scheduler", "scheduler_config.json"))
        seed = ARCH_SEED
    # Tiny models carry their own small vocabulary; the full-size ones take CLIP's shipped files.
    if tokenizer_path or src.location not in TINY_BUILTINS:
        tes = [comps["text_encoder"]] + ([comps["text_encoder_2"]] if family == "sdxl" else [])
        toks = _load_tokenizers(family, tes, src.location, folder=None, tokenizer_path=tokenizer_path,
                                record=None, record_dir=None)
        comps["tokenizer"] = toks[0]
        if family == "sdxl":
            comps["tokenizer_2"] = toks[1]
    ident = f"builtin:{src.location}:{seed}"
    return comps, family, sched, ident, ident + ":vae"


# --- diffusers folders -----------------------------------------------------------------------

def configured_family(name_or_path: str) -> str | None:
    """The family of a built-in model or diffusers folder from its configuration (no weights);
    None for the other sources (their family is known once they load)."""
    src = resolve_model_source(name_or_path)
    if src.kind == "builtin":
        return FAMILY_OF_ARCH[src.arch]
    if src.kind == "diffusers":
        return _family_of_folder(src.location)
    return None


def _family_of_folder(folder: str) -> str:
    index = read_json(os.path.join(folder, "model_index.json")) if os.path.isfile(
        os.path.join(folder, "model_index.json")) else {}
    if index.get("family") in FAMILY_OF_ARCH.values():
        return index["family"]
    if "text_encoder_2" in index or os.path.isdir(os.path.join(folder, "text_encoder_2")) \
            or "XL" in str(index.get("_class_name", "")):
        return "sdxl"
    te = read_json(os.path.join(folder, "text_encoder", "config.json"))
    # SD2's OpenCLIP-derived text encoder: plain gelu and (at full size) 1024 wide.
    if te.get("hidden_act") == "gelu" or te.get("hidden_size") == 1024:
        return "sd2"
    return "sd1"


def _load_folder(folder: str, source: str, tokenizer_path: str | None) -> tuple[dict, str, dict, str, str]:
    # lazy: the dry run's plan loads this module before torch; diffusers and transformers are
    # imported when _load_folder() runs
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    if not os.path.isfile(os.path.join(folder, "unet", "config.json")):
        raise ModelError(f"{source}: not a diffusers model folder (no unet/config.json)")
    family = _family_of_folder(folder)
    # lazy: the dry run's plan loads this module before torch; safetensors is imported when
    # _load_folder() runs
    from safetensors import SafetensorError

    comps: dict[str, Any] = {}
    classes = {"unet": UNet2DConditionModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel}
    if family == "sdxl":
        classes["text_encoder_2"] = CLIPTextModelWithProjection
    for name, cls in classes.items():
        try:
            comps[name] = cls.from_pretrained(folder, subfolder=name, local_files_only=True)
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:
            # SafetensorError: an empty or garbled weights file (not an OSError)
            raise ModelError(f"{source}: cannot load the diffusers folder ({name}): {first_line(e)}") from None
    tes = [comps["text_encoder"]] + ([comps["text_encoder_2"]] if family == "sdxl" else [])
    toks = _load_tokenizers(family, tes, source, folder=folder, tokenizer_path=tokenizer_path,
                            record=None, record_dir=None)
    comps["tokenizer"] = toks[0]
    if family == "sdxl":
        comps["tokenizer_2"] = toks[1]
    sched_path = os.path.join(folder, "scheduler", "scheduler_config.json")
    sched = read_json(sched_path) if os.path.isfile(sched_path) else {}
    vae_dir = os.path.join(folder, "vae")
    return comps, family, sched, path_identity(folder), path_identity(vae_dir)


# --- single files ----------------------------------------------------------------------------

def _load_file(path: str, source: str, tokenizer_path: str | None, allow_pickle: bool,
               v_parameterization: bool) -> tuple[dict, str, dict, str, str]:
    state_dict, meta = sd_checkpoint.read_state_dict(path, allow_pickle=allow_pickle)
    family = sd_checkpoint.detect_family(state_dict, path)
    record = None
    if sd_checkpoint.META_CONFIG_KEY in meta:
        try:
            record = json.loads(meta[sd_checkpoint.META_CONFIG_KEY])
        except json.JSONDecodeError:
            raise ModelError(f"{path}: metadata {sd_checkpoint.META_CONFIG_KEY} is not valid JSON") from None
        if record.get("family") != family:
            raise ModelError(f"{path}: metadata says family {record.get('family')!r} but the weights are {family}")
    with tempfile.TemporaryDirectory(prefix="sdtk-config-") as tmp:
        if record is not None:
            sd_checkpoint.write_config_dir(record, tmp)
            config_dir = tmp
            sched = record.get("scheduler", {})
        else:
            config_dir = _shipped_config_for(state_dict, family, tmp)
            sched = dict(read_json(os.path.join(config_dir, "scheduler", "scheduler_config.json")))
            # SD2 768-v and SD2-base share weights' shape: prediction type cannot be read from the
            # weights, so (as sd-scripts) it follows --v_parameterization.
            sched["prediction_type"] = "v_prediction" if v_parameterization else "epsilon"
            if family == "sd2" and not v_parameterization:
                logger.warning("%s: SD2 checkpoint without --v_parameterization: using epsilon prediction "
                               "(SD2.x-base); pass --v_parameterization for 768-v models", path)
        comps = sd_checkpoint.load_unet_vae_te(state_dict, family, config_dir, path)
        tes = [comps["text_encoder"]] + ([comps["text_encoder_2"]] if family == "sdxl" else [])
        toks = _load_tokenizers(family, tes, path, folder=None, tokenizer_path=tokenizer_path,
                                record=record, record_dir=tmp if record is not None else None)
    comps["tokenizer"] = toks[0]
    if family == "sdxl":
        comps["tokenizer_2"] = toks[1]
    ident = path_identity(path)
    return comps, family, sched, ident, "vae-of:" + _sha(ident)


def _shipped_config_for(state_dict: dict, family: str, tmp: str) -> str:
    """The shipped architecture configs of ``family``; for an inpainting checkpoint (a 9-channel
    first U-Net convolution, e.g. sd-v1-5-inpainting) a copy in ``tmp`` whose U-Net takes 9."""
    shipped = os.path.join(SHIPPED_CONFIGS, ARCH_OF_FAMILY[family])
    channels = inpainting.in_channels_of_state_dict(state_dict)
    if channels is None or channels == read_json(os.path.join(shipped, "unet", "config.json"))["in_channels"]:
        return shipped
    out = os.path.join(tmp, "shipped")
    shutil.copytree(shipped, out)
    cfg_path = os.path.join(out, "unet", "config.json")
    cfg = read_json(cfg_path)
    cfg["in_channels"] = channels
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return out


def _hub_snapshot(repo_id: str) -> str:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ModelError(f"pretrained_model_name_or_path: {repo_id} is neither a local path nor a built-in "
                         "model, and the hub is offline (HF_HUB_OFFLINE=1)")
    # lazy: the dry run's plan loads this module before torch; huggingface_hub is imported when
    # _hub_snapshot() runs
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=[
            "model_index.json", "*/config.json", "scheduler/*.json", "tokenizer*/*",
            "unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
            "text_encoder*/model.safetensors"])
    except Exception as e:  # network, auth and not-found errors all end the run the same way
        raise ModelError(f"pretrained_model_name_or_path: cannot download {repo_id} from the hub: "
                         f"{first_line(e)}") from None


# --- VAE override ----------------------------------------------------------------------------

def load_vae(vae: str, family: str, base_vae_config: dict):
    """A VAE from a diffusers folder (with or without a vae/ subfolder) or a single file; a
    single file is read with the base model's VAE architecture."""
    # lazy: the dry run's plan loads this module before torch; diffusers is imported when load_vae()
    # runs
    from diffusers import AutoencoderKL

    p = os.path.expanduser(vae)
    if not os.path.exists(p):
        raise ModelError(f"vae: no such file or directory: {vae}")
    if os.path.isdir(p):
        broken = symlinks.first_broken(p)
        if broken:
            raise ModelError(f"vae: {broken} is {symlinks.problem(broken)}")
        sub = "vae" if os.path.isfile(os.path.join(p, "vae", "config.json")) else None
        if sub is None and not os.path.isfile(os.path.join(p, "config.json")):
            raise ModelError(f"vae: {vae} is a folder without config.json or vae/config.json")
        try:
            return AutoencoderKL.from_pretrained(p, subfolder=sub, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelError(f"vae: cannot load {vae}: {first_line(e)}") from None
    state_dict, _ = sd_checkpoint.read_state_dict(p)
    with tempfile.TemporaryDirectory(prefix="sdtk-vae-") as tmp:
        os.makedirs(os.path.join(tmp, "vae"))
        with open(os.path.join(tmp, "vae", "config.json"), "w") as f:
            json.dump({k: v for k, v in base_vae_config.items() if not k.startswith("_")}
                      | {"_class_name": "AutoencoderKL"}, f)
        return sd_checkpoint.load_vae_from_state_dict(state_dict, tmp, vae)


# --- entry point -----------------------------------------------------------------------------

def load_from_options(opts: Options) -> "ModelBundle":
    """load_model_bundle with the run options that select and shape the model."""
    return load_model_bundle(required(opts.pretrained_model_name_or_path, "pretrained_model_name_or_path"),
                             vae=opts.vae, v2=opts.v2,
                             v_parameterization=opts.v_parameterization,
                             tokenizer_path=opts.tokenizer_path, allow_pickle=opts.allow_pickle)


def load_model_bundle(name_or_path: str, *, vae: str | None = None, v2: bool = False,
                      v_parameterization: bool = False, tokenizer_path: str | None = None,
                      allow_pickle: bool = False) -> ModelBundle:
    """Load a model from a built-in name, diffusers folder, single file or hub id.

    The family comes from the weights; `v2` only cross-checks it. v-prediction comes from the
    model's scheduler config or `v_parameterization`.
    """
    src = resolve_model_source(name_or_path)
    with quiet_progress():
        return _load_bundle(src, name_or_path, vae, v2, v_parameterization, tokenizer_path, allow_pickle)


def _load_bundle(src, name_or_path, vae, v2, v_parameterization, tokenizer_path, allow_pickle) -> ModelBundle:
    if src.location in FLOW_BUILTINS:
        raise ModelError(f"pretrained_model_name_or_path: {name_or_path} is a "
                         f"{registry.get(FLOW_BUILTINS[src.location]).title} model; it loads "
                         "through library/models/flow_family.py (train_dreambooth / finetune)")
    if src.kind == "builtin":
        comps, family, sched, ident, vae_ident = _load_builtin(src, tokenizer_path)
    elif src.kind == "diffusers":
        comps, family, sched, ident, vae_ident = _load_folder(src.location, name_or_path, tokenizer_path)
    elif src.kind == "single_file":
        comps, family, sched, ident, vae_ident = _load_file(src.location, name_or_path, tokenizer_path,
                                                            allow_pickle, v_parameterization)
    else:
        folder = _hub_snapshot(src.location)
        comps, family, sched, _, vae_ident = _load_folder(folder, name_or_path, tokenizer_path)
        ident = "hub:" + _sha(folder)  # the snapshot folder name is the resolved commit
        vae_ident = "hub:" + _sha(folder + "/vae")
    if v2 and family == "sd1":
        logger.warning("v2 is set but %s holds SD1 weights; loading it as SD1", name_or_path)
    if vae:
        comps["vae"] = load_vae(vae, family, dict(comps["vae"].config))
        vae_ident = path_identity(os.path.expanduser(vae))
    v_param = bool(v_parameterization) or sched.get("prediction_type") == "v_prediction"
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        if comps.get(name) is not None:
            comps[name].eval()
    tes = [comps["text_encoder"]] + ([comps["text_encoder_2"]] if family == "sdxl" else [])
    toks = [comps["tokenizer"]] + ([comps["tokenizer_2"]] if family == "sdxl" else [])
    return ModelBundle(family=family, unet=comps["unet"], vae=comps["vae"], text_encoders=tes, tokenizers=toks,
                       noise_scheduler=_noise_scheduler(sched, v_param), v_parameterization=v_param,
                       source=str(name_or_path), identity=ident, vae_identity=vae_ident,
                       scheduler_config=dict(sched))


ALIGNMENT = 64  # bytes


def align_for_cpu(*modules) -> None:
    """Each parameter and buffer of ``modules`` whose data is not 64-byte aligned, copied into its
    own storage (safetensors hands out tensors at the file's byte offsets): CPU matrix kernels take
    other code paths, with other rounding, on unaligned data, so a model loaded from a file would
    compute what the same weights built in memory compute only up to the last bits. For CPU runs
    (a GPU gets its own aligned copy of the weights anyway); it costs a copy of the unaligned ones."""
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            if t.data_ptr() % ALIGNMENT:
                t.data = t.data.clone()


def set_attention(b, opts: Options) -> None:
    """The bundle's attention: SDPA (default), xformers, or with --sdpa=false the plain math
    attention."""
    if opts.xformers:
        try:
            b.unet.enable_xformers_memory_efficient_attention()
        except Exception as e:  # noqa: BLE001 - diffusers raises several kinds here
            raise UserError(f"xformers: cannot enable xformers attention ({e}); "
                            "install the xformers extra or drop --xformers") from None
    elif not opts.sdpa:
        # lazy: the dry run's plan loads this module before torch; diffusers is imported when
        # set_attention() runs
        from diffusers.models.attention_processor import AttnProcessor

        b.unet.set_attn_processor(AttnProcessor())
        for te in b.text_encoders:
            te.set_attn_implementation("eager")


def load_single_file(path: str, *, vae: str | None = None, v_parameterization: bool = False,
                     tokenizer_path: str | None = None, allow_pickle: bool = False):
    """Load a single-file checkpoint (original layout) as a models.ModelBundle."""
    if not os.path.isfile(path):
        raise ModelError(f"{path}: no such file")
    return load_model_bundle(path, vae=vae, v_parameterization=v_parameterization,
                             tokenizer_path=tokenizer_path, allow_pickle=allow_pickle)
