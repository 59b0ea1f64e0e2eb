"""The flow families as the trainer runs them, through each family home's hooks
(docs/FAMILIES.md "The hooks a home provides"; ``registry.home(name)``): which family a source
is before any weight loads, the checks of the options only the flow families read, the model
bundle, the family model (tokenize / encode / forward) and the full-model save.

    family_before_loading(name_or_path)      the flow family of a built-in name, file or folder
                                             (its home's ``claims``), else None (SD's loader)
    load_from_options(opts)                  ModelBundle (the home's ``load``), else the SD
                                             loader's bundle
    family_model_for(bundle, opts, ...)      the home's ``family_model``
    save_full(bundle, path, dtype, metadata) the home's ``save_full``
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from library.config.options import OPTIONS_BY_NAME
from library.errors import UserError
from library.models import loading
from library.models.families import registry
from library.models.family import FamilyModel

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")

# the options only a flow family's run reads: refused with an SD model (and, where another flow
# family does not read one, by that family's ``unsupported`` table)
FLOW_OPTIONS = ("timestep_sampling", "sigmoid_scale", "discrete_flow_shift", "model_prediction_type",
                "weighting_scheme", "logit_mean", "logit_std", "mode_scale", "guidance_scale",
                "t5xxl_max_token_length", "apply_t5_attn_mask", "clip_l", "clip_g", "t5xxl", "ae",
                "training_shift", "apply_lg_attn_mask", "clip_l_dropout_rate", "clip_g_dropout_rate",
                "t5_dropout_rate", "train_t5xxl", "learning_rate_te3", "pos_emb_random_crop_rate",
                "enable_scaled_pos_embed", "split_mode", "double_blocks_to_swap", "single_blocks_to_swap",
                "use_t5xxl_cache_only", "num_last_block_to_freeze", "qwen3", "llm_adapter_path",
                "t5_tokenizer_path", "qwen3_max_token_length", "t5_max_token_length", "attn_mode", "split_attn",
                "vae_chunk_size", "vae_disable_cache", "llm_adapter_lr", "self_attn_lr", "cross_attn_lr",
                "mlp_lr", "mod_lr", "gemma2",
                "gemma2_max_token_length", "system_prompt", "use_flash_attn", "use_sage_attn", "sample_batch_size")
# options of the SD trainer this family does not honour (yet): name -> why
UNSUPPORTED = {
    "v2": "the model is not SD2",
    "v_parameterization": "FLUX.1 predicts the flow velocity (see model_prediction_type)",
    "zero_terminal_snr": "a change of the DDPM schedule",
    "weighted_captions": "sd-scripts' FLUX.1 / SD3 text encodings have no prompt weighting "
                         "(its strategy_flux / strategy_sd3 tokenize without weights)",
    "no_token_padding": "an SD1/SD2 DreamBooth option",
    "tokenizer_path": "the tokenizers come with the model",
    "train_inpainting": "an SD option",
    "block_lr": "SDXL's U-Net blocks",
}
# huber / smooth_l1 with huber_schedule constant or exponential (at t = 1000 sigma, as sd-scripts);
# its snr schedule needs the DDPM schedule's SNR (flow_loss.check_options)
HUBER_SCHEDULES = ("constant", "exponential")


class FlowFamilyError(UserError, ValueError):
    """An option a FLUX.1 run cannot honour; one line naming it."""


def family_before_loading(name_or_path: str | None) -> str | None:
    """The flow family of a source, told from names, keys or configs (no weights read): a
    family's built-in name (when no such path exists), else the first family whose home
    ``claims`` the path (the SD families' homes claim none); None for the SD families' sources."""
    if not name_or_path:
        return None
    path = os.path.expanduser(str(name_or_path))
    if not os.path.exists(path):
        for fam in registry.FAMILIES.values():
            if fam.flow is not None and name_or_path in (*fam.tiny_models, *fam.arch_models):
                return fam.name
        return None
    for fam in registry.FAMILIES.values():
        if registry.home(fam.name).claims(path):
            return fam.name
    return None


def check_sources(opts: Options, family: str) -> None:
    """The family's own checks of its parts before any weight loads: its home's optional
    ``check_sources(opts)`` (base.OPTIONAL_HOOKS), where it has one."""
    check = getattr(registry.home(family), "check_sources", None)
    if check is not None:
        check(opts)


def full_param_groups(bundle, opts: Options) -> tuple[list[dict], list[str]] | None:
    """A full fine-tune's optimizer groups of the backbone and their names by the family's own rule:
    its home's optional ``param_groups(unet, opts)`` (base.OPTIONAL_HOOKS; Anima's per-part rates);
    None where it has none (one group at learning_rate)."""
    hook = getattr(registry.home(bundle.family), "param_groups", None)
    return None if hook is None else hook(bundle.unet, opts)


def _is_set(opts: Options, name: str) -> bool:
    value = getattr(opts, name)
    return value not in (None, False, 0, 0.0, "", (), []) and value != OPTIONS_BY_NAME[name].default


def load_from_options(opts: Options) -> loading.ModelBundle:
    """The run's model: a flow family's source through its home's ``load``, any other through
    the SD loader (library/models/loading.py)."""
    fam = family_before_loading(opts.pretrained_model_name_or_path)
    if fam is None:
        return loading.load_from_options(opts)
    return registry.home(fam).load(opts)


def family_model_for(bundle, opts: Options, *, rewrite=None) -> FamilyModel:
    """The run's family model (its home's ``family_model``)."""
    return registry.home(bundle.family).family_model(bundle, opts, rewrite)


def enable_scaled_pos_embed(mmdit, resolutions, log) -> None:
    """enable_scaled_pos_embed (SD3): the MMDiT's scaled tables for the datasets' resolutions
    (W, H), each latent size round(sqrt(W x H)) // 8, as sd-scripts' sd3_train.py."""
    sizes = sorted({round((w * h) ** 0.5) // 8 for w, h in resolutions})
    log.info(f"enable_scaled_pos_embed: scaled position embeddings for resolutions {list(resolutions)} "
             f"(latent sizes {sizes})")
    mmdit.enable_scaled_pos_embed(sizes)


def save_full(bundle, path: str, dtype, metadata: dict, trained_encoders: tuple[str, ...] = ()) -> None:
    """The trained model in the layout it was loaded from, atomically (the home's ``save_full``:
    FLUX.1 the transformer alone, SD3 the source's components and the ``trained_encoders``, an SD
    family the whole model as one file or a diffusers folder)."""
    registry.home(bundle.family).save_full(bundle, path, dtype, metadata, trained_encoders)
