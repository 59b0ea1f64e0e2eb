"""Anima's hooks (docs/FAMILIES.md "The hooks a home provides"): detection before loading, the
model bundle (train_lora only: sd-scripts' anima_train.py is not built here), the family model,
metadata and the memory estimate's fakes.

The bundle's slots: ``unet`` the MiniTrainDiT with its LLM adapter, ``vae`` the Qwen-Image VAE
behind family_model.LatentVAE (latents already normalised per channel), ``text_encoders``
[Qwen3], ``tokenizers`` [Qwen3, T5 (the adapter's ids)], ``flow`` the AnimaModel.
"""
from __future__ import annotations

import os

import torch
from transformers import Qwen3Config, Qwen3Model

from library.errors import UserError
from library.models import fake_parts, loading
from library.models.fake_parts import Counted, Unavailable
from library.models.families.anima.family_model import (QWEN3_MAX_LENGTH, T5_MAX_LENGTH, AnimaFamilyModel,
                                                       AnimaTextConditioning, LatentVAE, is_source, load_anima)
from library.models.families.anima import parts, tiny, weights
from library.models.families.anima.model import Anima, AnimaModelError
from library.models.modelspec import IMPL_STABILITY_AI

BUILTIN_NAMES = (tiny.NAME,)


# --- detection and loading ---------------------------------------------------------------------

def claims(path: str) -> bool:
    """Whether an existing ``path`` is an Anima DiT file, from its header's keys (no weight read);
    an unreadable file is not claimed (the SD loader names the problem)."""
    try:
        return is_source(path)
    except UserError:
        return False


def load(opts) -> loading.ModelBundle:
    src = opts.pretrained_model_name_or_path
    if opts.script != "train_lora":
        raise AnimaModelError(f"{src} is an Anima model: train_lora trains it; {opts.script} (sd-scripts' "
                              "anima_train.py) does not train Anima here yet")
    m = load_anima(src, qwen3=opts.qwen3, vae=opts.vae, llm_adapter_path=opts.llm_adapter_path,
                                      t5_tokenizer_path=opts.t5_tokenizer_path)
    return loading.ModelBundle(family="anima", unet=m.dit, vae=LatentVAE(m.vae),
                               text_encoders=[m.qwen3], tokenizers=[m.qwen3_tokenizer, m.t5_tokenizer],
                               noise_scheduler=None, v_parameterization=False, source=str(src),
                               identity=m.identity, vae_identity=m.vae_identity, flow=m)


def save_full(bundle, path: str, dtype, metadata: dict, trained_encoders: tuple[str, ...] = ()) -> None:
    """No full fine-tune of Anima here (``load`` refuses every script but train_lora)."""
    raise AnimaModelError(f"{path}: Anima trains as a LoRA here; a full save (sd-scripts' anima_train.py) "
                          "is not built")


def metadata_fields(variant: str, adapter: str | None) -> dict[str, str]:
    """What sd-scripts writes for Anima: its get_sai_model_spec gets no model type for Anima, so an
    Anima LoRA says SD1's architecture, Stability AI's implementation and "epsilon"; the base
    model version is the trainer's model type, "anima"."""
    arch = "stable-diffusion-v1"
    return {"ss_base_model_version": "anima", "modelspec.implementation": IMPL_STABILITY_AI,
            "modelspec.prediction_type": "epsilon", "modelspec.architecture": f"{arch}/{adapter}" if adapter else arch}


# --- the family model ----------------------------------------------------------------------------

def family_model(bundle, opts, rewrite=None) -> AnimaFamilyModel:
    return AnimaFamilyModel(bundle.unet, bundle.text_encoders, bundle.tokenizers,
                                               qwen3_max_length=opts.qwen3_max_token_length,
                                               t5_max_length=opts.t5_max_token_length, rewrite=rewrite)


# --- the memory estimate's fakes (library/training/flow_memory.py) ----------------------------

def _qwen3(path: str) -> torch.nn.Module:
    """Qwen3 as parts.load_qwen3 builds it: a folder's config.json, else (one file) Qwen3-0.6B's."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        cfg = Qwen3Config.from_pretrained(path, local_files_only=True)
    else:
        cfg = Qwen3Config(**parts.QWEN3_06B)
    cfg.use_cache = False
    return Qwen3Model(cfg)


def _vae_numel(path: str, header) -> int:
    """The Qwen-Image VAE's parameters, from its .safetensors header, a folder's headers or a
    .pth file's tensor shapes (memory-mapped: no tensor read)."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        return fake_parts.folder_numel(path, header)
    if path.endswith(".safetensors"):
        return fake_parts.header_numel(path, "vae", header, "Anima")
    sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return fake_parts.numel({k: tuple(v.shape) for k, v in sd.items()})


def memory_parts(opts, header) -> dict:
    """{unet, vae, text_encoder} on fake tensors: tiny-anima built whole; a DiT file built from its
    header's shapes (and llm_adapter_path's), with Qwen3 from its folder's config or Qwen3-0.6B's
    and the VAE counted from its header; a qwen3 / vae given replaces tiny-anima's as in the loader."""
    src = opts.pretrained_model_name_or_path
    path = os.path.expanduser(str(src))
    if not os.path.exists(path) and src == tiny.NAME:
        m = tiny.build()
        comps = {"unet": m["dit"], "vae": m["vae"], "text_encoder": m["qwen3"]}
    elif os.path.isfile(path) and path.endswith(".safetensors"):
        for option in ("qwen3", "vae"):
            if not getattr(opts, option):
                raise Unavailable(f"{option}: required with an Anima DiT file ({src})")
        comps = {"unet": Anima(weights.read_config(path, opts.llm_adapter_path))}
    else:
        raise Unavailable(f"{src}: only Anima .safetensors DiT files and tiny-anima are estimated")
    if opts.qwen3:
        comps["text_encoder"] = _qwen3(opts.qwen3)
    if opts.vae:
        comps["vae"] = Counted(_vae_numel(opts.vae, header), "vae")
    return comps


def memory_text_tokens(opts, comps: dict) -> tuple[int, int, int]:
    """(tokens, token width, pooled width 0) of the DiT's text input: Qwen3's states, which the
    LLM adapter inside the DiT maps to the cross-attention context."""
    return opts.qwen3_max_token_length or QWEN3_MAX_LENGTH, comps["unet"].config.adapter.source_dim, 0


def memory_family_model(opts, comps: dict, text_encoders: list) -> AnimaFamilyModel:
    return AnimaFamilyModel(comps["unet"], text_encoders, [], qwen3_max_length=opts.qwen3_max_token_length,
                            t5_max_length=opts.t5_max_token_length)


def memory_conditioning(opts, comps: dict, batch: int, dtype) -> AnimaTextConditioning:
    """One micro-step's text input: Qwen3's states of zeros and T5 ids, every token real (the most
    attention in the adapter)."""
    tokens, width, _ = memory_text_tokens(opts, comps)
    t5_tokens = opts.t5_max_token_length or T5_MAX_LENGTH
    ones = torch.ones(batch, tokens, dtype=torch.long)
    return AnimaTextConditioning(torch.zeros(batch, tokens, width, dtype=dtype), None, ones,
                                 torch.zeros(batch, t5_tokens, dtype=torch.long),
                                 torch.ones(batch, t5_tokens, dtype=torch.long))


def memory_text_entry_bytes(opts, comps: dict, text_dtype_bytes: int, partial: bool) -> int:
    """One caption's text-cache entry, as ``encode`` makes it: Qwen3's states (in its norm weight's
    dtype, which its output takes) and mask, the T5 ids and mask (int64)."""
    tokens, width, _ = memory_text_tokens(opts, comps)
    t5_tokens = opts.t5_max_token_length or T5_MAX_LENGTH
    return tokens * width * comps["text_encoder"].norm.weight.element_size() + 8 * (tokens + 2 * t5_tokens)
