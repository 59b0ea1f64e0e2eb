"""Single-file checkpoints in the ORIGINAL SD / SDXL key layout, and full-model saving.

Saving maps diffusers/transformers state dicts to the layout A1111, ComfyUI and the original
repos use (our own inverse of diffusers' conversion). Loading goes the other way through
diffusers' own single-file conversion (`from_single_file`, `create_diffusers_clip_model_from_ldm`),
with architecture configs taken from the file's `sdtk.diffusers_config` metadata when present
(tiny or custom architectures) or else the configs shipped in configs/models/.

Every save is atomic: written under a temporary name in the target folder, then renamed.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import pickle
import re
from typing import Any

from library import safetensors_file
from library.errors import ModelError, first_line
from library.files import atomic_dir, atomic_path
from library.models import embedded_config, unet_layout
from library.models.families import registry

logger = logging.getLogger("sdtk")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
SHIPPED_CONFIGS = os.path.join(ROOT, "configs", "models")
SHIPPED_TOKENIZER = os.path.join(ROOT, "configs", "tokenizers", "clip")
ARCH_OF_FAMILY = {"sd1": "sd15", "sd2": "sd2", "sdxl": "sdxl"}
META_CONFIG_KEY = "sdtk.diffusers_config"

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
TE_PREFIX = {  # (family, component) -> prefix in the original layout
    ("sd1", "text_encoder"): "cond_stage_model.transformer.",
    ("sd2", "text_encoder"): "cond_stage_model.model.",
    ("sdxl", "text_encoder"): "conditioner.embedders.0.transformer.",
    ("sdxl", "text_encoder_2"): "conditioner.embedders.1.model.",
}


# --- diffusers -> original key mapping ------------------------------------------------------

# U-Net modules outside the blocks (the blocks are mapped by library.models.unet_layout).
_UNET_TOP_LEVEL = unet_layout.TOP_LEVEL


def unet_to_original(state_dict: dict, config: dict) -> dict:
    blocks = unet_layout.block_map(config)
    out = {}
    for key, value in state_dict.items():
        top = next(((new, old) for new, old in _UNET_TOP_LEVEL if key.startswith(new)), None)
        if top is not None:
            out[UNET_PREFIX + top[1] + key[len(top[0]):]] = value
            continue
        try:
            out[UNET_PREFIX + unet_layout.original_path(key, blocks)] = value
        except KeyError:
            raise ModelError(f"U-Net key {key} has no place in the original SD layout") from None
    return out


def vae_to_original(state_dict: dict, config: dict) -> dict:
    n_up = len(config["up_block_types"])
    out = {}
    for key, value in state_dict.items():
        k = key
        k = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", k)
        k = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", k)
        # The decoder's up blocks are numbered in reverse in the original layout.
        k = re.sub(r"^decoder\.up_blocks\.(\d+)\.resnets\.",
                   lambda m: f"decoder.up.{n_up - 1 - int(m.group(1))}.block.", k)
        k = re.sub(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                   lambda m: f"decoder.up.{n_up - 1 - int(m.group(1))}.upsample.", k)
        k = re.sub(r"\.mid_block\.resnets\.(\d+)\.", lambda m: f".mid.block_{int(m.group(1)) + 1}.", k)
        k = k.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
        if ".mid_block.attentions.0." in k:
            k = k.replace(".mid_block.attentions.0.", ".mid.attn_1.")
            for a, b in (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")):
                k = k.replace(f".attn_1.{a}.", f".attn_1.{b}.")
            if value.ndim == 2:  # the original mid attention uses 1x1 convs
                value = value[:, :, None, None]
        out[VAE_PREFIX + k] = value
    return out


def _hf_text_keys(model) -> dict:
    """State dict with the classic `text_model.` prefix (transformers >= 5.6 flattened CLIPTextModel)."""
    sd = model.state_dict()
    has_wrapper = hasattr(model, "text_model")
    out = {}
    for k, v in sd.items():
        if k.endswith("position_ids"):
            continue  # a buffer, not a weight; absent from the original layout's loaders' expectations
        out[k if has_wrapper else "text_model." + k] = v
    return out


def clip_to_original(model, prefix: str) -> dict:
    return {prefix + k: v for k, v in _hf_text_keys(model).items()}


def openclip_to_original(model, prefix: str, dummy_last_layer: bool) -> dict:
    """transformers CLIP text model -> OpenCLIP layout (fused q/k/v `in_proj`)."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when
    # openclip_to_original() runs
    import torch

    sd = _hf_text_keys(model)
    out: dict[str, Any] = {}
    qkv: dict[str, dict[str, Any]] = {}
    for k, v in sd.items():
        if k == "text_projection.weight":
            out[prefix + "text_projection"] = v.T.contiguous()
            continue
        k2 = k.replace("text_model.embeddings.token_embedding.weight", "token_embedding.weight")
        k2 = k2.replace("text_model.embeddings.position_embedding.weight", "positional_embedding")
        k2 = k2.replace("text_model.final_layer_norm.", "ln_final.")
        m = re.match(r"text_model\.encoder\.layers\.(\d+)\.(.*)$", k2)
        if m:
            layer, rest = m.groups()
            qm = re.match(r"self_attn\.([qkv])_proj\.(weight|bias)$", rest)
            if qm:
                qkv.setdefault(f"transformer.resblocks.{layer}.attn.in_proj_{qm.group(2)}", {})[qm.group(1)] = v
                continue
            rest = (rest.replace("self_attn.out_proj", "attn.out_proj").replace("layer_norm1", "ln_1")
                    .replace("layer_norm2", "ln_2").replace("mlp.fc1", "mlp.c_fc").replace("mlp.fc2", "mlp.c_proj"))
            k2 = f"transformer.resblocks.{layer}.{rest}"
        out[prefix + k2] = v
    for name, parts in qkv.items():
        out[prefix + name] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    hidden = model.config.hidden_size
    if prefix + "text_projection" not in out:
        # SD2's CLIPTextModel has no projection; the original OpenCLIP model does (unused by SD).
        out[prefix + "text_projection"] = torch.eye(hidden, dtype=sd["text_model.final_layer_norm.weight"].dtype)
    out[prefix + "logit_scale"] = torch.tensor(4.6052)  # ln(100), CLIP's trained value; unused by SD
    if dummy_last_layer:
        # diffusers' SD2 text encoder drops OpenCLIP's last block (SD uses the penultimate one);
        # tools that build the full OpenCLIP model expect it, so copy the previous block (as sd-scripts).
        n = model.config.num_hidden_layers
        for k in list(out):
            if k.startswith(f"{prefix}transformer.resblocks.{n - 1}."):
                out[k.replace(f".resblocks.{n - 1}.", f".resblocks.{n}.")] = out[k].clone()
    return out


def original_state_dict(components: dict, family: str) -> dict:
    """All weights of a model in the original SD/SDXL single-file layout."""
    if family not in ARCH_OF_FAMILY:
        raise ModelError(f"family: unknown model family {family!r}; expected sd1, sd2 or sdxl")
    sd = projections_as(unet_to_original(components["unet"].state_dict(), dict(components["unet"].config)),
                        registry.get(family).linear_projections)
    sd.update(vae_to_original(components["vae"].state_dict(), dict(components["vae"].config)))
    te = components["text_encoder"]
    if family == "sd2":
        # 23 layers = the real SD2 text encoder minus OpenCLIP's last block.
        sd.update(openclip_to_original(te, TE_PREFIX[(family, "text_encoder")],
                                       dummy_last_layer=te.config.num_hidden_layers == 23))
    else:
        sd.update(clip_to_original(te, TE_PREFIX[(family, "text_encoder")]))
    if family == "sdxl":
        sd.update(openclip_to_original(components["text_encoder_2"], TE_PREFIX[(family, "text_encoder_2")],
                                       dummy_last_layer=False))
    return sd


_PROJECTIONS = ("proj_in.weight", "proj_out.weight")


def projections_as(unet_sd: dict, linear: bool) -> dict:
    """The transformer blocks' proj_in / proj_out weights of an original-layout U-Net state dict
    in the family's single-file form, whatever the diffusers model held: 2-D Linear weights
    (``linear``: SD2 and SDXL files, as A1111, ComfyUI and sd-scripts read them) or 4-D 1x1
    convolutions (SD1). The same numbers either way."""
    def form(key, v):
        if not key.endswith(_PROJECTIONS):
            return v
        if linear and v.ndim == 4:
            return v.flatten(1)
        return v[:, :, None, None] if not linear and v.ndim == 2 else v
    return {k: form(k, v) for k, v in unet_sd.items()}


# --- architecture description carried in the file's metadata ---------------------------------

def _tokenizer_record(tok) -> Any:
    """'clip' when the tokenizer is the shipped CLIP vocabulary, else its files (small vocabularies)."""
    vocab = tok.get_vocab()
    if len(vocab) == 49408:
        with open(os.path.join(SHIPPED_TOKENIZER, "vocab.json"), encoding="utf-8") as f:
            if json.load(f) == vocab:
                return {"shipped": "clip", "pad_token": str(tok.pad_token)}
    return {"files": embedded_config.tokenizer_files(tok)}


def architecture_record(components: dict, family: str) -> dict:
    """Everything needed to rebuild the model skeleton offline: configs, family, tokenizers."""
    rec: dict[str, Any] = {"family": family}
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        if components.get(name) is not None:
            cfg = components[name].config
            # transformers configs have to_dict(); diffusers configs are (frozen) dicts.
            rec[name] = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    if components.get("scheduler") is not None:
        rec["scheduler"] = dict(components["scheduler"].config)
    if "unet" in rec and "use_linear_projection" in rec["unet"]:  # the file's form (projections_as)
        rec["unet"]["use_linear_projection"] = registry.get(family).linear_projections
    for cfg in rec.values():
        # diffusers lists the defaulted keys in set order, which varies with the process's
        # string-hash seed: sorted, the same model writes the same bytes in every run
        if isinstance(cfg, dict) and "_use_default_values" in cfg:
            cfg["_use_default_values"] = sorted(cfg["_use_default_values"])
    for name in ("tokenizer", "tokenizer_2"):
        if components.get(name) is not None:
            rec[name] = _tokenizer_record(components[name])
    return json.loads(json.dumps(rec, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))


def write_config_dir(record: dict, out_dir: str) -> None:
    """Write an architecture record as a diffusers-layout config folder (what from_single_file reads)."""
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        if name in record:
            os.makedirs(os.path.join(out_dir, name), exist_ok=True)
            with open(os.path.join(out_dir, name, "config.json"), "w") as f:
                json.dump(record[name], f)
    if "scheduler" in record:
        os.makedirs(os.path.join(out_dir, "scheduler"), exist_ok=True)
        with open(os.path.join(out_dir, "scheduler", "scheduler_config.json"), "w") as f:
            json.dump(record["scheduler"], f)
    for name in ("tokenizer", "tokenizer_2"):
        files = record.get(name, {}).get("files")
        if files:
            os.makedirs(os.path.join(out_dir, name), exist_ok=True)
            for fname, text in files.items():
                with open(os.path.join(out_dir, name, fname), "w", encoding="utf-8") as f:
                    f.write(text)


@contextlib.contextmanager
def quiet_progress():
    """Hide transformers'/diffusers' per-file progress bars while loading or saving (log noise)."""
    # lazy: the dry run's plan loads this module before torch; diffusers and transformers are
    # imported when quiet_progress() runs
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    t_on, d_on = tlog.is_progress_bar_enabled(), dlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    dlog.disable_progress_bar()
    try:
        yield
    finally:
        if t_on:
            tlog.enable_progress_bar()
        if d_on:
            dlog.enable_progress_bar()


# --- saving ----------------------------------------------------------------------------------

def _cast(sd: dict, dtype) -> dict:
    out = {}
    for k, v in sd.items():
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.contiguous().cpu()
    return out


def save_single_file(components: dict, family: str, path: str, dtype=None, metadata: dict | None = None,
                     embed_config: bool = True, ckpt_extras: dict | None = None) -> None:
    """Save the model as one file in the original layout (.safetensors, or .ckpt/.pt as {"state_dict": ...}).

    The file's metadata carries `sdtk.diffusers_config` (configs, family, tokenizers) so that the
    loader rebuilds non-standard architectures offline; other tools ignore it. embed_config=False
    writes a file like any third-party one (loaded with the shipped configs). ckpt_extras: plain
    values beside the state dict of a .ckpt/.pt (``epoch``, ``global_step``, as sd-scripts writes them).
    """
    # lazy: the dry run's plan loads this module before torch; torch is imported when
    # save_single_file() runs
    import torch

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sd = _cast(original_state_dict(components, family), dtype)
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    if embed_config:
        meta.setdefault(META_CONFIG_KEY, json.dumps(architecture_record(components, family)))
    with atomic_path(path) as tmp:
        if path.endswith(".safetensors"):
            safetensors_file.save(sd, tmp, metadata=meta)
        else:
            # Plain strings keep the file loadable with weights_only=True.
            torch.save({"state_dict": sd, "sdtk_metadata": meta, **(ckpt_extras or {})}, tmp)


def save_diffusers(components: dict, family: str, out_dir: str, dtype=None) -> None:
    """Save a diffusers folder; built in a temporary sibling folder, swapped in at the end."""
    if family not in ARCH_OF_FAMILY:
        raise ModelError(f"family: unknown model family {family!r}; expected sd1, sd2 or sdxl")
    with atomic_dir(out_dir) as tmp, quiet_progress():
        _write_diffusers(components, family, tmp, dtype)


def _write_diffusers(components: dict, family: str, tmp: str, dtype) -> None:

    # lazy: the dry run's plan loads this module before torch; torch is imported when
    # _write_diffusers() runs
    import torch

    index: dict[str, Any] = {"_class_name": "StableDiffusionXLPipeline" if family == "sdxl" else "StableDiffusionPipeline",
                             "family": family}
    for name, comp in components.items():
        if comp is None:
            continue
        sub = os.path.join(tmp, name)
        if name in ("unet", "vae", "text_encoder", "text_encoder_2"):
            # Cast a copy: the caller's model (maybe still training) keeps its dtype. (nn.Module.to
            # directly: diffusers' override only adds a warning about fp32-kept modules, none here.)
            model = torch.nn.Module.to(copy.deepcopy(comp), dtype) if dtype is not None else comp
            model.save_pretrained(sub, safe_serialization=True)
            lib = "diffusers" if name in ("unet", "vae") else "transformers"
        else:
            comp.save_pretrained(sub)
            lib = "diffusers" if name == "scheduler" else "transformers"
        index[name] = [lib, type(comp).__name__]
    with open(os.path.join(tmp, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)


# --- loading ---------------------------------------------------------------------------------

def read_state_dict(path: str, allow_pickle: bool = False) -> tuple[dict, dict]:
    """(state dict, metadata) of a .safetensors or .ckpt/.pt/.bin file.
    Pickled files load with torch.load(weights_only=True); any other pickled content can run
    code, so it needs allow_pickle.
    """

    # lazy: the dry run's plan loads this module before torch; torch is imported when
    # read_state_dict() runs
    import torch

    if path.endswith((".safetensors", ".sft")):  # .sft: BFL's name for FLUX.1 files
        # lazy: the dry run's plan loads this module before torch; safetensors is imported when
        # read_state_dict() runs
        from safetensors import safe_open
        from safetensors.torch import load_file
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
            return load_file(path), meta
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelError(f"{path}: not a readable safetensors file ({first_line(e)})") from None
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror or e})") from None
    # a torch save file is a zip archive or (legacy) a pickle stream: anything else is not one,
    # whatever allow_pickle says (torch would report a bare "invalid load key" or worse)
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        raise ModelError(f"{path}: not a checkpoint (neither .safetensors nor a torch save file)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's weights_only refusal is a multi-line message: one line of ours instead
        if not allow_pickle:
            raise ModelError(f"{path}: holds pickled objects other than tensors, which can run code when loaded; "
                             "convert it to .safetensors or pass allow_pickle (--allow_pickle) if you trust it") from None
        logger.warning("%s: loading pickled content (allow_pickle)", path)
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - arbitrary unpickling can raise anything
            raise ModelError(f"{path}: not a readable checkpoint ({first_line(e, typed=True)})") from None
    except Exception as e:
        raise ModelError(f"{path}: not a readable checkpoint ({first_line(e, typed=True)})") from None
    meta = obj.get("sdtk_metadata", {}) if isinstance(obj, dict) else {}
    meta = {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}
    while isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ModelError(f"{path}: does not hold a state dict")
    return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}, meta


def detect_family(state_dict: dict, path: str = "checkpoint") -> str:
    """sd1 / sd2 / sdxl from the weights: SDXL has a second text encoder, SD2 an OpenCLIP one."""
    keys = state_dict.keys()
    if not any(k.startswith(UNET_PREFIX) for k in keys):
        raise ModelError(f"{path}: no U-Net weights ({UNET_PREFIX}*): not a Stable Diffusion checkpoint in the original layout")
    if any(k.startswith("conditioner.embedders.1.") for k in keys):
        return "sdxl"
    if any(k.startswith("cond_stage_model.model.") for k in keys):
        return "sd2"
    if any(k.startswith("cond_stage_model.transformer.") for k in keys):
        return "sd1"
    # No text encoder in the file: SD2's cross-attention context is 1024 wide.
    k = UNET_PREFIX + "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"
    if k in state_dict and state_dict[k].shape[-1] == 1024:
        return "sd2"
    return "sd1"


def _check_materialized(model, what: str, path: str) -> None:
    # diffusers builds the skeleton on the meta device: a tensor missing from the file stays meta.
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.device.type == "meta"]
    if missing:
        raise ModelError(f"{path}: {what} weights missing from the checkpoint (e.g. {missing[0]}; {len(missing)} tensors)")


def load_unet_vae_te(state_dict: dict, family: str, config_dir: str, path: str, dtype=None) -> dict:
    """Convert original-layout weights to diffusers/transformers models with diffusers' single-file code."""
    # lazy: the dry run's plan loads this module before torch; diffusers and transformers are
    # imported when load_unet_vae_te() runs
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    out = {}
    try:
        out["unet"] = UNet2DConditionModel.from_single_file(state_dict, config=config_dir, subfolder="unet",
                                                            local_files_only=True, torch_dtype=dtype)
        _check_materialized(out["unet"], "U-Net", path)
        out["vae"] = load_vae_from_state_dict(state_dict, config_dir, path, dtype)
        out["text_encoder"] = create_diffusers_clip_model_from_ldm(
            CLIPTextModel, state_dict, subfolder="text_encoder", config=config_dir, torch_dtype=dtype,
            local_files_only=True)
        _check_materialized(out["text_encoder"], "text encoder", path)
        if family == "sdxl":
            out["text_encoder_2"] = create_diffusers_clip_model_from_ldm(
                CLIPTextModelWithProjection, state_dict, subfolder="text_encoder_2", config=config_dir,
                torch_dtype=dtype, local_files_only=True)
            _check_materialized(out["text_encoder_2"], "second text encoder", path)
    except ModelError:
        raise
    except (ValueError, RuntimeError, KeyError, OSError) as e:
        msg = first_line(e)
        m = re.search(r"because (\S+) expected shape (torch\.Size\(\[[^\]]*\]\)), but got (torch\.Size\(\[[^\]]*\]\))", msg)
        if m:
            msg = (f"the weights do not fit the {family} architecture of {config_dir} ({m.group(1)}: expected "
                   f"{m.group(2)[11:-1]}, got {m.group(3)[11:-1]}); custom sizes load only from files this toolkit "
                   f"wrote (they carry {META_CONFIG_KEY})")
        raise ModelError(f"{path}: cannot convert the {family} checkpoint: {msg}") from None
    return out


def load_vae_from_state_dict(state_dict: dict, config_dir: str, path: str, dtype=None):
    """A VAE from a full checkpoint (first_stage_model.*), a standalone original-layout VAE
    (encoder.down.*), or a VAE file already in diffusers layout (encoder.down_blocks.*)."""
    # lazy: the dry run's plan loads this module before torch; diffusers is imported when
    # load_vae_from_state_dict() runs
    from diffusers import AutoencoderKL

    if any(k.startswith("encoder.down_blocks.") for k in state_dict):
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(config_dir, subfolder="vae"))
        missing, unexpected = vae.load_state_dict(state_dict, strict=False)
        if missing:
            raise ModelError(f"{path}: VAE weights missing (e.g. {missing[0]})")
        return vae.to(dtype) if dtype is not None else vae
    if not any(k.startswith(("encoder.", "decoder.", VAE_PREFIX, "vae.")) for k in state_dict):
        raise ModelError(f"{path}: no VAE weights found")
    vae = AutoencoderKL.from_single_file(state_dict, config=config_dir, subfolder="vae", local_files_only=True,
                                         torch_dtype=dtype)
    _check_materialized(vae, "VAE", path)
    return vae


