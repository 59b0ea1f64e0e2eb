"""SD3 / SD3.5 models from the sources sd-scripts takes, and saved back in the layout they came from.

Sources:
- a built-in name: `tiny-sd3`, `tiny-sd3.5-medium`, `tiny-sd3.5-large`, and the full-size random
  `sd3-arch`, `sd3.5-medium-arch`, `sd3.5-large-arch` (library/models/families/sd3/sd3_builtins.py);
- an SAI single file: the transformer under `model.diffusion_model.` (or without a prefix), and
  in an all-in-one file also `text_encoders.clip_l.transformer.*`, `text_encoders.clip_g.transformer.*`,
  `text_encoders.t5xxl.transformer.*` (transformers layouts) and `first_stage_model.*` (the VAE,
  LDM layout); what the file lacks comes from separate `clip_l` / `clip_g` / `t5xxl` / `ae` files
  (sd-scripts' options; a separate file wins over the same component in the main file);
- a diffusers folder (StableDiffusion3Pipeline layout): the transformer is converted to SAI's
  layout on load (`mmdit_from_diffusers`, the inverse of diffusers' own conversion).

Saving writes the layout of the source: the main file again with the components it held (SAI
layout; separate files are not rewritten), or a diffusers folder (the transformer through
diffusers' own conversion). Files this toolkit writes carry `sdtk.sd3_config` (CLIP, VAE and
tokenizer configs) so that tiny or custom sizes load offline; other files use SD3's real configs.

The T5 encoder is not built here (another module's job): `t5_loader(state_dict, source)` builds one
from transformers-layout T5 weights; without it, T5 weights are carried through unchanged. A T5
tokenizer of a small vocabulary (the tiny models') travels in the record (`tokenizer_t5`), or in a
separate t5xxl file's own (library/models/t5.py), or in a diffusers folder's `tokenizer_3`.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from accelerate import init_empty_weights
from diffusers import AutoencoderKL, SD3Transformer2DModel
from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Tokenizer

from library import safetensors_file
from library.errors import first_line
from library.files import atomic_dir, atomic_path
from library.models import embedded_config, sd_checkpoint, t5
from library.models.families.sd3 import sd3, sd3_builtins, sd3_text, sd3_vae
from library.models.loading import quiet_progress
from library.models.families.sd3.sd3 import SD3ModelError

logger = logging.getLogger("sdtk")

TE_PREFIX = {"clip_l": "text_encoders.clip_l.transformer.", "clip_g": "text_encoders.clip_g.transformer.",
             "t5xxl": "text_encoders.t5xxl.transformer."}
META_KEY = "sdtk.sd3_config"
LAYOUT_FILE = "sai"  # an SAI single file (with separate component files or not)
LAYOUT_DIFFUSERS = "diffusers"

SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}


@dataclass
class SD3Model:
    mmdit: sd3.MMDiT
    clip_l: Any  # transformers CLIPTextModelWithProjection
    clip_g: Any
    vae: Any  # diffusers AutoencoderKL
    tokenizer_l: Any
    tokenizer_g: Any  # pads with id 0 ("!")
    source: str
    layout: str  # LAYOUT_FILE or LAYOUT_DIFFUSERS
    # the components the main file (or folder) held: what a save writes back
    in_source: frozenset = frozenset()
    t5xxl: Any = None  # a T5 encoder module (from t5_loader), or None
    t5xxl_state_dict: dict | None = None  # T5 weights carried through when no t5_loader was given
    tokenizer_t5: Any = None
    extra_metadata: dict = field(default_factory=dict)

    @property
    def variant(self) -> str:
        return self.mmdit.config.variant


# --- the family from the weights ---------------------------------------------------------------

def detect_variant(state_dict: dict) -> str | None:
    """sd3 / sd3.5-medium / sd3.5-large for SAI-layout MMDiT weights (prefix optional), else None:
    `joint_blocks.0.x_block.attn.qkv.weight` -> SD3, `ln_q` -> SD3.5, `attn2` -> SD3.5 medium."""
    sd = sd3.strip_prefix(state_dict)
    if "joint_blocks.0.x_block.attn.qkv.weight" not in sd:
        return None
    if "joint_blocks.0.x_block.attn.ln_q.weight" not in sd:
        return "sd3"
    return "sd3.5-medium" if any(".x_block.attn2." in k for k in sd) else "sd3.5-large"


def detect_source(name_or_path: str) -> str | None:
    """The SD3 variant of a source without loading weights (a safetensors header, a diffusers
    transformer config, a built-in name), or None when it is not an SD3 model: what a dry run
    and the family choice need."""
    path = os.path.expanduser(name_or_path)
    if not os.path.exists(path):
        return sd3_builtins.variant_of(name_or_path)
    if os.path.isdir(path):
        cfg_path = os.path.join(path, "transformer", "config.json")
        if not os.path.isfile(cfg_path):
            return None
        with open(cfg_path) as f:
            cfg = json.load(f)
        if cfg.get("_class_name") != "SD3Transformer2DModel":
            return None
        if not cfg.get("qk_norm"):
            return "sd3"
        return "sd3.5-medium" if cfg.get("dual_attention_layers") else "sd3.5-large"
    if path.endswith(".safetensors"):
        try:
            with safe_open(path, framework="pt") as f:
                return detect_variant(dict.fromkeys(f.keys()))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise SD3ModelError(f"{path}: not a readable safetensors file ({first_line(e)})") from None
    return None


# --- diffusers <-> SAI transformer keys ----------------------------------------------------------

_TOP = {"pos_embed.proj": "x_embedder.proj",
        "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
        "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
        "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
        "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
        "context_embedder": "context_embedder", "proj_out": "final_layer.linear",
        "norm_out.linear": "final_layer.adaLN_modulation.1"}
_IN_BLOCK = {"attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
             "attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
             "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
             "attn2.to_out.0": "x_block.attn2.proj", "attn2.norm_q": "x_block.attn2.ln_q",
             "attn2.norm_k": "x_block.attn2.ln_k", "norm1.linear": "x_block.adaLN_modulation.1",
             "norm1_context.linear": "context_block.adaLN_modulation.1",
             "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
             "ff_context.net.0.proj": "context_block.mlp.fc1", "ff_context.net.2": "context_block.mlp.fc2"}
# q, k, v projections fused into one qkv in SAI's layout
_QKV = {"attn.to_": "x_block.attn.qkv", "attn.add_": "context_block.attn.qkv", "attn2.to_": "x_block.attn2.qkv"}
_QKV_KEY = re.compile(r"^(attn\.to_|attn\.add_|attn2\.to_)([qkv])(?:_proj)?\.(weight|bias)$")


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    # diffusers' AdaLayerNormContinuous takes (scale, shift) where SAI has (shift, scale)
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def mmdit_from_diffusers(state_dict: dict, source: str = "transformer") -> dict:
    """diffusers SD3Transformer2DModel weights -> SAI layout (no prefix)."""
    blocks = [int(m.group(1)) for k in state_dict if (m := re.match(r"transformer_blocks\.(\d+)\.", k))]
    last = max(blocks, default=-1)
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        if key == "pos_embed.pos_embed":
            out["pos_embed"] = value
            continue
        name, _, kind = key.rpartition(".")
        if name in _TOP:
            if name == "norm_out.linear":
                value = _swap_halves(value)
            out[f"{_TOP[name]}.{kind}"] = value
            continue
        m = re.match(r"transformer_blocks\.(\d+)\.(.+)$", key)
        if m is None:
            raise SD3ModelError(f"{source}: {key} has no place in the SD3 (SAI) layout")
        i, rest = int(m.group(1)), m.group(2)
        q = _QKV_KEY.match(rest)
        if q:
            qkv.setdefault(f"joint_blocks.{i}.{_QKV[q.group(1)]}.{q.group(3)}", {})[q.group(2)] = value
            continue
        name, _, kind = rest.rpartition(".")
        if name not in _IN_BLOCK:
            raise SD3ModelError(f"{source}: {key} has no place in the SD3 (SAI) layout")
        if name == "norm1_context.linear" and i == last:
            value = _swap_halves(value)  # the pre-only context block: (shift, scale) in SAI's order
        out[f"joint_blocks.{i}.{_IN_BLOCK[name]}.{kind}"] = value
    for key, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise SD3ModelError(f"{source}: {key} lacks {', '.join(sorted({'q', 'k', 'v'} - set(parts)))}")
        out[key] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


def diffusers_config(config: sd3.MMDiTConfig) -> dict:
    """The SD3Transformer2DModel config of an MMDiT config."""
    return {"_class_name": "SD3Transformer2DModel", "sample_size": config.sample_size,
            "patch_size": config.patch_size, "in_channels": config.in_channels, "out_channels": config.in_channels,
            "num_layers": config.depth, "attention_head_dim": sd3.HEAD_DIM, "num_attention_heads": config.num_heads,
            "joint_attention_dim": config.context_dim, "caption_projection_dim": config.hidden_size,
            "pooled_projection_dim": config.adm_in_channels, "pos_embed_max_size": config.pos_embed_max_size,
            "dual_attention_layers": list(config.x_block_self_attn_layers),
            "qk_norm": "rms_norm" if config.qk_norm else None}


def mmdit_to_diffusers(mmdit: sd3.MMDiT):
    """A diffusers SD3Transformer2DModel with the MMDiT's weights, converted by diffusers' own
    single-file conversion."""
    sd = convert_sd3_transformer_checkpoint_to_diffusers(dict(mmdit.state_dict()))
    model = SD3Transformer2DModel.from_config(diffusers_config(mmdit.config))
    model.load_state_dict(sd, strict=True)
    return model


# --- text encoders -------------------------------------------------------------------------------

def _hf_keys(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("position_ids")}


def _without(prefix: str, sd: dict) -> dict:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def _build_clip(which: str, sd: dict, config: dict, source: str):
    """A CLIPTextModelWithProjection with the weights ``sd`` (transformers layout, float32). Built
    with empty parameters that take the file's tensors (no random initialisation of a 700M-parameter
    CLIP-G to throw away)."""
    if sd and all(k.startswith("transformer.") for k in sd):
        sd = _without("transformer.", sd)
    sd = {k: v.float() for k, v in sd.items() if not k.endswith("position_ids")}
    if not sd:
        raise SD3ModelError(f"{source}: no {which} weights")
    with init_empty_weights(include_buffers=False):
        model = CLIPTextModelWithProjection(CLIPTextConfig(**config))
    if which == "clip_l" and "text_projection.weight" not in sd:
        sd["text_projection.weight"] = torch.eye(config["hidden_size"])
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    except RuntimeError as e:
        raise SD3ModelError(f"{source}: the {which} weights do not fit its configuration "
                            f"(custom sizes load only from files this toolkit wrote): {first_line(e)}") from None
    if missing or unexpected:
        what = f"missing (e.g. {missing[0]})" if missing else f"unexpected (e.g. {unexpected[0]})"
        raise SD3ModelError(f"{source}: {which} weights {what}")
    return model.eval()


def _clip_config(which: str, sd: dict, record: dict | None, source: str) -> dict:
    if record is not None and which in record:
        return record[which]
    config = sd3_text.CLIP_L_CONFIG if which == "clip_l" else sd3_text.CLIP_G_CONFIG
    key = next((k for k in sd if k.endswith("token_embedding.weight")), None)
    if key is None or sd[key].shape[1] != config["hidden_size"]:
        width = sd[key].shape[1] if key else "unknown"
        raise SD3ModelError(f"{source}: {which} is {width} wide, not {config['hidden_size']}; custom sizes load "
                            f"only from files this toolkit wrote (they carry {META_KEY})")
    return config


# --- the record carried in files this toolkit writes ---------------------------------------------

def config_record(model: SD3Model) -> dict:
    """What a file this toolkit writes carries (`sdtk.sd3_config`): the CLIP and VAE configs, the
    tokenizer (files of a small vocabulary), the variant and the position table's layout size."""
    rec: dict[str, Any] = {"variant": model.variant, "sample_size": model.mmdit.config.sample_size}
    if model.clip_l is not None:
        rec["clip_l"] = model.clip_l.config.to_dict()
    if model.clip_g is not None:
        rec["clip_g"] = model.clip_g.config.to_dict()
    if model.vae is not None:
        rec["vae"] = dict(model.vae.config)
        if "_use_default_values" in rec["vae"]:
            # a set in diffusers, in an order that follows the string-hash seed: sorted, the same
            # model writes the same bytes in every run
            rec["vae"]["_use_default_values"] = sorted(rec["vae"]["_use_default_values"])
    if model.tokenizer_l is not None:
        rec["tokenizer_l"] = _tokenizer_record(model.tokenizer_l)
    if model.tokenizer_t5 is not None and len(model.tokenizer_t5.get_vocab()) < t5.T5XXL_CONFIG["vocab_size"] - 100:
        rec["tokenizer_t5"] = embedded_config.tokenizer_files(model.tokenizer_t5)  # a tiny vocabulary
    return json.loads(json.dumps(rec, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))


def _tokenizer_record(tok) -> dict:
    """{"shipped": "clip"} for CLIP's own vocabulary (configs/tokenizers/clip), else the files of
    a small one (the tiny models')."""
    if len(tok.get_vocab()) == sd3_text.CLIP_L_CONFIG["vocab_size"]:
        return {"shipped": "clip"}
    return {"files": embedded_config.tokenizer_files(tok)}


def _tokenizers_from_record(record: dict | None):
    files = (record or {}).get("tokenizer_l", {}).get("files")
    if not files:
        return sd3_text.shipped_tokenizers()
    with tempfile.TemporaryDirectory(prefix="sdtk-sd3-tok-") as tmp:
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        return CLIPTokenizer.from_pretrained(tmp), CLIPTokenizer.from_pretrained(tmp, pad_token="!")


# --- loading --------------------------------------------------------------------------------------

def load_sd3(name_or_path: str, *, clip_l: str | None = None, clip_g: str | None = None, t5xxl: str | None = None,
             ae: str | None = None, t5_loader: Callable[[dict, str], Any] | None = None,
             allow_pickle: bool = False) -> SD3Model:
    """An SD3 model from a built-in name, an SAI single file (plus optional separate component
    files, sd-scripts' `clip_l`, `clip_g`, `t5xxl`, `ae`) or a diffusers folder."""
    path = os.path.expanduser(name_or_path)
    separate = {"clip_l": clip_l, "clip_g": clip_g, "ae": ae, "t5xxl": t5xxl}
    for option, given in separate.items():  # before any weight loads
        if given and not os.path.isfile(os.path.expanduser(given)):
            raise SD3ModelError(f"{option}: no such file: {given}")
    if os.path.isfile(path):
        return _load_file(path, t5_loader, allow_pickle, separate)
    if os.path.isdir(path):
        with quiet_progress():
            model = _load_folder(path, t5_loader)
    elif sd3_builtins.variant_of(name_or_path) is not None:
        comps = sd3_builtins.build_builtin(name_or_path)
        model = SD3Model(comps["mmdit"], comps["clip_l"], comps["clip_g"], comps["vae"], comps["tokenizer_l"],
                         comps["tokenizer_g"], source=name_or_path, layout=LAYOUT_FILE,
                         in_source=frozenset({"mmdit", "clip_l", "clip_g", "vae"}
                                             | ({"t5xxl"} if "t5xxl" in comps else set())),
                         t5xxl=comps.get("t5xxl"), tokenizer_t5=comps.get("tokenizer_t5"))
    else:
        raise SD3ModelError(f"pretrained_model_name_or_path: no such file or directory: {name_or_path}")
    # separate files of this model's own (maybe tiny) sizes
    _replace_separate(model, separate, config_record(model), t5_loader, allow_pickle)
    return model


def _read(path: str, option: str, allow_pickle: bool) -> tuple[dict, dict]:
    p = os.path.expanduser(path)
    if not os.path.isfile(p):
        raise SD3ModelError(f"{option}: no such file: {path}")
    return sd_checkpoint.read_state_dict(p, allow_pickle=allow_pickle)


def _replace_separate(model: SD3Model, separate: dict, record: dict | None, t5_loader, allow_pickle: bool) -> None:
    for option in ("clip_l", "clip_g"):
        if separate.get(option):
            sd, _ = _read(separate[option], option, allow_pickle)
            sd = _without(TE_PREFIX[option], sd) if any(k.startswith(TE_PREFIX[option]) for k in sd) else sd
            setattr(model, option, _build_clip(option, sd, _clip_config(option, sd, record, separate[option]),
                                               separate[option]))
    if separate.get("ae"):
        sd, _ = _read(separate["ae"], "ae", allow_pickle)
        model.vae = sd3_vae.load_vae(sd, separate["ae"], (record or {}).get("vae"))
    if separate.get("t5xxl"):
        sd, meta = _read(separate["t5xxl"], "t5xxl", allow_pickle)
        sd = _without(TE_PREFIX["t5xxl"], sd) if any(k.startswith(TE_PREFIX["t5xxl"]) for k in sd) else sd
        _set_t5(model, sd, separate["t5xxl"], t5_loader, in_source=False)
        model.tokenizer_t5 = t5.tokenizer_of_record(embedded_config.read_record(meta, t5.META_CONFIG_KEY,
                                                                                separate["t5xxl"]))


def _set_t5(model: SD3Model, sd: dict, source: str, t5_loader, in_source: bool) -> None:
    if t5_loader is not None:
        model.t5xxl, model.t5xxl_state_dict = t5_loader(sd, source), None
    else:
        logger.info("%s: T5-XXL weights kept as they are (no T5 encoder given to build)", source)
        model.t5xxl, model.t5xxl_state_dict = None, sd if in_source else None


def _load_file(path: str, t5_loader, allow_pickle: bool, separate: dict) -> SD3Model:
    sd, meta = sd_checkpoint.read_state_dict(path, allow_pickle=allow_pickle)
    if detect_variant(sd) is None:
        raise SD3ModelError(f"{path}: no SD3 transformer weights (model.diffusion_model.joint_blocks.*)")
    record = None
    if META_KEY in meta:
        try:
            record = json.loads(meta[META_KEY])
        except json.JSONDecodeError:
            raise SD3ModelError(f"{path}: metadata {META_KEY} is not valid JSON") from None
    cfg = sd3.config_from_state_dict(sd, path)
    if record and record.get("sample_size"):
        cfg = replace(cfg, sample_size=int(record["sample_size"]))
    mmdit = sd3.build_mmdit(cfg, sd, path).eval()
    in_source = {"mmdit"}
    encoders: dict[str, Any] = {"clip_l": None, "clip_g": None}
    for which in ("clip_l", "clip_g"):
        part = _without(TE_PREFIX[which], sd)
        if part and not separate.get(which):
            encoders[which] = _build_clip(which, part, _clip_config(which, part, record, path), path)
            in_source.add(which)
    vae = None
    if any(k.startswith(sd3_vae.PREFIX) for k in sd) and not separate.get("ae"):
        vae = sd3_vae.load_vae(sd, path, (record or {}).get("vae"))
        in_source.add("vae")
    tok_l, tok_g = _tokenizers_from_record(record)
    model = SD3Model(mmdit, encoders["clip_l"], encoders["clip_g"], vae, tok_l, tok_g, source=path,
                     layout=LAYOUT_FILE, in_source=frozenset(in_source))
    t5_part = _without(TE_PREFIX["t5xxl"], sd)
    if t5_part and not separate.get("t5xxl"):
        _set_t5(model, t5_part, path, t5_loader, in_source=True)
        model.in_source = model.in_source | {"t5xxl"}
        if record and record.get("tokenizer_t5"):
            model.tokenizer_t5 = t5.tokenizer_of_record({"tokenizer": record["tokenizer_t5"]})
    _replace_separate(model, separate, record, t5_loader, allow_pickle)
    for which, option in (("clip_l", "clip_l"), ("clip_g", "clip_g"), ("vae", "ae")):
        if getattr(model, which) is None:
            raise SD3ModelError(f"{path}: holds no {which} weights; give the {option} file (--{option})")
    return model


def _folder_state_dict(folder: str) -> dict:
    sd: dict = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            sd.update(load_file(os.path.join(folder, name)))
    return sd


def _load_folder(folder: str, t5_loader) -> SD3Model:
    if not os.path.isfile(os.path.join(folder, "transformer", "config.json")):
        raise SD3ModelError(f"{folder}: not a diffusers SD3 folder (no transformer/config.json)")
    try:
        ref = SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True)
        sai = mmdit_from_diffusers(ref.state_dict(), os.path.join(folder, "transformer"))
        cfg = replace(sd3.config_from_state_dict(sai, folder), sample_size=int(ref.config.sample_size))
        del ref
        mmdit = sd3.build_mmdit(cfg, sai, folder).eval()
        vae = AutoencoderKL.from_pretrained(folder, subfolder="vae", local_files_only=True).eval()
        clip_l = CLIPTextModelWithProjection.from_pretrained(folder, subfolder="text_encoder",
                                                             local_files_only=True).eval()
        clip_g = CLIPTextModelWithProjection.from_pretrained(folder, subfolder="text_encoder_2",
                                                             local_files_only=True).eval()
    except SD3ModelError:
        raise
    except (OSError, ValueError, RuntimeError) as e:
        raise SD3ModelError(f"{folder}: cannot load the diffusers SD3 folder: {first_line(e)}") from None
    # vocab.json (the released folders) or tokenizer.json alone (transformers 5's save_pretrained)
    if any(os.path.isfile(os.path.join(folder, "tokenizer", f)) for f in ("vocab.json", "tokenizer.json")):
        tok_l = CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer")
        tok_g = CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer_2", pad_token="!")
    else:
        tok_l, tok_g = sd3_text.shipped_tokenizers()
    model = SD3Model(mmdit, clip_l, clip_g, vae, tok_l, tok_g, source=folder, layout=LAYOUT_DIFFUSERS,
                     in_source=frozenset({"mmdit", "clip_l", "clip_g", "vae"}))
    t5_dir = os.path.join(folder, "text_encoder_3")
    if os.path.isdir(t5_dir) and t5_loader is not None:
        model.t5xxl = t5_loader(_folder_state_dict(t5_dir), t5_dir)
    if os.path.isdir(os.path.join(folder, "tokenizer_3")):
        model.tokenizer_t5 = T5Tokenizer.from_pretrained(folder, subfolder="tokenizer_3")
    return model


# --- saving ---------------------------------------------------------------------------------------

def _cast(sd: dict, dtype) -> dict:
    return {k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach())
            .contiguous().cpu() for k, v in sd.items()}


def single_file_state_dict(model: SD3Model, components=None) -> dict:
    """The model's weights in SAI's single-file layout; ``components`` (default: what the source
    file held) from mmdit, clip_l, clip_g, t5xxl, vae."""
    components = model.in_source if components is None else frozenset(components)
    out = {sd3.PREFIX + k: v for k, v in model.mmdit.state_dict().items()} if "mmdit" in components else {}
    for which in ("clip_l", "clip_g"):
        enc = getattr(model, which)
        if which in components and enc is not None:
            sd = _hf_keys(enc)
            proj = sd.get("text_projection.weight")
            if which == "clip_l" and proj is not None and torch.equal(proj, torch.eye(proj.shape[0], dtype=proj.dtype)):
                del sd["text_projection.weight"]  # SAI's CLIP-L has none (the loader restores the identity)
            out.update({TE_PREFIX[which] + k: v for k, v in sd.items()})
    if "t5xxl" in components:
        t5_sd = model.t5xxl.state_dict() if model.t5xxl is not None else dict(model.t5xxl_state_dict or {})
        tied = t5_sd.get("encoder.embed_tokens.weight")
        if tied is not None and "shared.weight" in t5_sd and tied.data_ptr() == t5_sd["shared.weight"].data_ptr():
            # one tensor under two names: both written (diffusers' single-file T5 loader reads
            # encoder.embed_tokens, ComfyUI's shared), as a copy (safetensors refuses shared memory)
            t5_sd["encoder.embed_tokens.weight"] = tied.detach().clone()
        out.update({TE_PREFIX["t5xxl"] + k: v for k, v in t5_sd.items()})
    if "vae" in components and model.vae is not None:
        out.update(sd3_vae.to_original(model.vae))
    return out


def save_sd3(model: SD3Model, path: str, *, dtype=None, metadata: dict | None = None, embed_config: bool = True,
             components=None) -> None:
    """Save in the layout the model came from: a single file (the components its source file held,
    or ``components``, e.g. with trained text encoders: sd-scripts' save_clip / save_t5xxl) or a
    diffusers folder. Atomic: a crash leaves the previous file or folder as it was."""
    if model.layout == LAYOUT_DIFFUSERS:
        with atomic_dir(path) as tmp, quiet_progress():
            _write_diffusers(model, tmp, dtype)
        return

    sd = _cast(single_file_state_dict(model, components), dtype)
    meta = {k: str(v) for k, v in {**model.extra_metadata, **(metadata or {})}.items()}
    if embed_config:
        meta.setdefault(META_KEY, json.dumps(config_record(model)))
    with atomic_path(path) as tmp:
        if path.endswith(".safetensors"):
            safetensors_file.save(sd, tmp, metadata=meta)
        else:
            torch.save({"state_dict": sd, "sdtk_metadata": meta}, tmp)


def _write_diffusers(model: SD3Model, out: str, dtype) -> None:
    def save(module, name):
        m = torch.nn.Module.to(copy.deepcopy(module), dtype) if dtype is not None else module
        m.save_pretrained(os.path.join(out, name), safe_serialization=True)

    save(mmdit_to_diffusers(model.mmdit), "transformer")
    save(model.vae, "vae")
    save(model.clip_l, "text_encoder")
    save(model.clip_g, "text_encoder_2")
    model.tokenizer_l.save_pretrained(os.path.join(out, "tokenizer"))
    model.tokenizer_g.save_pretrained(os.path.join(out, "tokenizer_2"))
    os.makedirs(os.path.join(out, "scheduler"))
    with open(os.path.join(out, "scheduler", "scheduler_config.json"), "w") as f:
        json.dump(SCHEDULER_CONFIG, f)
    index = {"_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3Transformer2DModel"],
             "vae": ["diffusers", "AutoencoderKL"], "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
             "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
             "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
             "text_encoder_3": [None, None], "tokenizer_3": [None, None]}
    if model.t5xxl is not None and hasattr(model.t5xxl, "save_pretrained"):
        save(model.t5xxl, "text_encoder_3")
        index["text_encoder_3"] = ["transformers", type(model.t5xxl).__name__]
    elif os.path.isdir(os.path.join(model.source, "text_encoder_3")):
        # no T5 module here: the source folder's T5 (and tokenizer) unchanged
        shutil.copytree(os.path.join(model.source, "text_encoder_3"), os.path.join(out, "text_encoder_3"))
        index["text_encoder_3"] = ["transformers", "T5EncoderModel"]
    if model.tokenizer_t5 is not None:
        model.tokenizer_t5.save_pretrained(os.path.join(out, "tokenizer_3"))
        index["tokenizer_3"] = ["transformers", type(model.tokenizer_t5).__name__]
    elif os.path.isdir(os.path.join(model.source, "tokenizer_3")):
        shutil.copytree(os.path.join(model.source, "tokenizer_3"), os.path.join(out, "tokenizer_3"))
        index["tokenizer_3"] = ["transformers", "T5TokenizerFast"]
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)
