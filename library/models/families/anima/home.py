"""Anima's hooks (docs/FAMILIES.md "The hooks a home provides"): detection before loading, the
model bundle (train_lora only: sd-scripts' anima_train.py is not built here), the family model
and metadata; the memory estimate is not available for Anima (its hooks say so in one line).

The bundle's slots: ``unet`` the MiniTrainDiT with its LLM adapter, ``vae`` the Qwen-Image VAE
behind family_model.LatentVAE (latents already normalised per channel), ``text_encoders``
[Qwen3], ``tokenizers`` [Qwen3, T5 (the adapter's ids)], ``flow`` the AnimaModel.
"""
from __future__ import annotations

from library.errors import UserError
from library.models import loading
from library.models.fake_parts import Unavailable
from library.models.families.anima.family_model import AnimaFamilyModel, LatentVAE, is_source, load_anima
from library.models.families.anima import tiny
from library.models.families.anima.model import AnimaModelError
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
