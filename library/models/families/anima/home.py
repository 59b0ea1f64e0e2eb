"""Anima's hooks (docs/FAMILIES.md "The hooks a home provides"): detection before loading, the
model bundle, the full save and sd-scripts' per-part learning rates of full fine-tuning
(``param_groups``, anima_train.py), the family model and metadata; the memory estimate is not available for Anima (its hooks say so in one line).

The bundle's slots: ``unet`` the MiniTrainDiT with its LLM adapter, ``vae`` the Qwen-Image VAE
behind family_model.LatentVAE (latents already normalised per channel), ``text_encoders``
[Qwen3], ``tokenizers`` [Qwen3, T5 (the adapter's ids)], ``flow`` the AnimaModel.
"""
from __future__ import annotations

import logging

from library.config import method_kinds
from library.config.options import METHOD_OF_SCRIPT
from library.errors import UserError
from library.models import loading
from library.models.fake_parts import Unavailable
from library.models.families.anima.family_model import AnimaFamilyModel, LatentVAE, is_source, load_anima
from library.models.families.anima import PART_RATES, attention, tiny, vae_memory, weights

BUILTIN_NAMES = (tiny.NAME,)
logger = logging.getLogger("sdtk")
IMPLEMENTATION = "https://huggingface.co/circlestone-labs/Anima"  # sd-scripts' IMPL_ANIMA


# --- detection and loading ---------------------------------------------------------------------

def claims(path: str) -> bool:
    """Whether an existing ``path`` is an Anima DiT file, from its header's keys (no weight read);
    an unreadable file is not claimed (the SD loader names the problem)."""
    try:
        return is_source(path)
    except UserError:
        return False


def check_sources(opts) -> None:
    """Before any weight loads: the attention kernel (attn_mode), and the per-part rates a LoRA
    does not read (sd-scripts' anima_train_network.py parses and ignores them: a warning)."""
    attention.kernel(opts.attn_mode)
    given = [name for name in PART_RATES if getattr(opts, name) is not None]
    if given and method_kinds.get(METHOD_OF_SCRIPT[opts.script]).trains_network:
        logger.warning(f"option {', '.join(given)} has no effect with an Anima network: the per-part learning "
                       "rates are anima_train.py's (full fine-tuning); the network trains at unet_lr / learning_rate")


def load(opts) -> loading.ModelBundle:
    src = opts.pretrained_model_name_or_path
    m = load_anima(src, qwen3=opts.qwen3, vae=opts.vae, llm_adapter_path=opts.llm_adapter_path,
                                      t5_tokenizer_path=opts.t5_tokenizer_path)
    attention.configure(m.dit, attention.kernel(opts.attn_mode), split=opts.split_attn)
    vae_memory.configure(m.vae, chunk_rows=opts.vae_chunk_size or None, cache=not opts.vae_disable_cache)
    return loading.ModelBundle(family="anima", unet=m.dit, vae=LatentVAE(m.vae),
                               text_encoders=[m.qwen3], tokenizers=[m.qwen3_tokenizer, m.t5_tokenizer],
                               noise_scheduler=None, v_parameterization=False, source=str(src),
                               identity=m.identity, vae_identity=m.vae_identity, flow=m)


def save_full(bundle, path: str, dtype, metadata: dict, trained_encoders: tuple[str, ...] = ()) -> None:
    """The trained DiT (with its LLM adapter) in the released layout, keys under ``net.``, as
    sd-scripts' anima_train.py saves it (Qwen3 and the VAE stay frozen and are not written; sd-scripts
    adds ``format = pt`` to the metadata, as the released file has)."""
    weights.save_dit(bundle.unet, path, dtype, {**metadata, "format": "pt"})


# --- full fine-tuning: sd-scripts' per-part learning rates ----------------------------------------

PART_ORDER = ("base", "self_attn", "cross_attn", "mlp", "mod", "llm_adapter")  # sd-scripts' group order


def part_of(name: str) -> str:
    """sd-scripts' get_anima_param_groups rule for a DiT parameter name, first match wins:
    ``llm_adapter`` anywhere, else ``.self_attn``, ``.cross_attn``, ``.mlp``, ``.adaln_modulation``
    (the blocks' and the final layer's), else base."""
    if "llm_adapter" in name:
        return "llm_adapter"
    for part, mark in (("self_attn", ".self_attn"), ("cross_attn", ".cross_attn"), ("mlp", ".mlp"),
                       ("mod", ".adaln_modulation")):
        if mark in name:
            return part
    return "base"


def param_groups(unet, opts) -> tuple[list[dict], list[str]]:
    """(optimizer groups, their names) of a full fine-tune: one group per part in sd-scripts' order,
    at its rate (unset: learning_rate); a part at 0 is frozen (no gradient, no group), an empty
    part has no group."""
    rates = {"base": opts.learning_rate, **{part: opts.learning_rate if getattr(opts, part + "_lr") is None
                                            else getattr(opts, part + "_lr") for part in PART_ORDER[1:]}}
    by_part: dict[str, list] = {part: [] for part in PART_ORDER}
    for name, p in unet.named_parameters():
        by_part[part_of(name)].append(p)
    groups, names = [], []
    for part in PART_ORDER:
        if not rates[part]:
            for p in by_part[part]:
                p.requires_grad_(False)
        elif by_part[part]:
            groups.append({"params": by_part[part], "lr": rates[part]})
            names.append(part)
    if not groups:
        raise weights.AnimaModelError("nothing to train: every part of the Anima DiT has learning rate 0 "
                                      f"(learning_rate and {', '.join(PART_RATES)})")
    return groups, names


def metadata_fields(variant: str, adapter: str | None) -> dict[str, str]:
    """What sd-scripts 48d368fa writes for Anima (sai_model_spec with ``anima="preview"``): the
    architecture ``anima-preview`` (``anima-unknown`` for another variant), circlestone-labs' Anima
    as the implementation, "epsilon" as the prediction type (sd-scripts gives every model but
    FLUX.1 one); the base model version is the trainer's model type, "anima"."""
    arch = "anima-preview" if variant == "preview" else "anima-unknown"
    return {"ss_base_model_version": "anima", "modelspec.implementation": IMPLEMENTATION,
            "modelspec.prediction_type": "epsilon", "modelspec.architecture": f"{arch}/{adapter}" if adapter else arch}


# --- the family model ----------------------------------------------------------------------------

def family_model(bundle, opts, rewrite=None) -> AnimaFamilyModel:
    return AnimaFamilyModel(bundle.unet, bundle.text_encoders, bundle.tokenizers,
                                               qwen3_max_length=opts.qwen3_max_token_length,
                                               t5_max_length=opts.t5_max_token_length, rewrite=rewrite)


# --- the memory estimate: not available for Anima (library/training/flow_memory.py) -------------

_NO_ESTIMATE = "no memory estimate for Anima models yet"


def memory_parts(opts, header) -> dict:
    raise Unavailable(f"{opts.pretrained_model_name_or_path}: {_NO_ESTIMATE}")


def memory_family_model(opts, comps: dict, text_encoders: list):
    raise Unavailable(_NO_ESTIMATE)


def memory_conditioning(opts, comps: dict, batch: int, dtype):
    raise Unavailable(_NO_ESTIMATE)


def memory_text_tokens(opts, comps: dict) -> tuple[int, int, int]:
    raise Unavailable(_NO_ESTIMATE)


def memory_text_entry_bytes(opts, comps: dict, text_dtype_bytes: int, partial: bool) -> int:
    raise Unavailable(_NO_ESTIMATE)
