"""Training metadata written into saved files: sd-scripts' ``ss_*`` keys and SAI ``modelspec.*``.

All values are strings (safetensors metadata is str -> str).
"""
from __future__ import annotations

import base64
import datetime
import json
import mimetypes
import os
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from library.config.parse import required
from library.errors import UserError
from library.models.families import registry

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options


@dataclass(frozen=True)
class ModelKind:
    """What a saved file's model is, as its metadata names it: the family, its prediction
    (``v_parameterization``), the method's adapter (None: the full model) and a flow family's
    model variant (its home's ``metadata_fields``; "" for the SD families, whose homes take the
    prediction type instead)."""
    family: str
    v_parameterization: bool
    adapter: str | None
    variant: str = ""


def tag_frequency(items) -> dict:
    """{folder name: {tag: count}} over the unique training images, as sd-scripts records it."""
    freq: dict[str, Counter] = {}
    for it in items:
        folder = os.path.basename(os.path.dirname(it.path))
        c = freq.setdefault(folder, Counter())
        for tag in (t.strip() for t in it.caption.split(",")):
            if tag:
                c[tag] += 1
    return {k: dict(v) for k, v in freq.items()}


def build_metadata(*, opts: Options, model: ModelKind, num_train_images: int, num_reg_images: int,
                   train_items, started_at: float, network_info: dict | None = None) -> dict:
    """Static metadata for every save; ``step_metadata`` adds the per-save values."""
    w, h = required(opts.resolution, "resolution")
    names = _family_fields(model)
    md = _run_fields(opts, model.family, started_at, names)
    md.update({
        "ss_text_encoder_lr": str(opts.text_encoder_lr),
        "ss_num_train_images": str(num_train_images),
        "ss_num_reg_images": str(num_reg_images),
        "ss_lr_warmup_steps": str(opts.lr_warmup_steps),
        "ss_optimizer": str(opts.optimizer_type) + (
            "(" + ",".join(f"{k}={v}" for k, v in opts.optimizer_args.items()) + ")"
            if opts.optimizer_args else ""),
        "ss_gradient_checkpointing": str(opts.gradient_checkpointing),
        "ss_gradient_accumulation_steps": str(opts.gradient_accumulation_steps),
        "ss_max_grad_norm": str(opts.max_grad_norm),
        "ss_clip_skip": str(opts.clip_skip),
        "ss_max_token_length": str(opts.max_token_length),
        "ss_resolution": str((w, h)),
        "ss_tag_frequency": json.dumps(tag_frequency(train_items)),
        "ss_caption_extension": str(opts.caption_extension),
        "ss_enable_bucket": str(opts.enable_bucket),
        "ss_prior_loss_weight": str(opts.prior_loss_weight),
    })
    md.update(_modelspec(opts, names, started_at, f"{w}x{h}"))
    # sd-scripts records the noise and loss settings under these names.
    for key, name in (("ss_noise_offset", "noise_offset"),
                      ("ss_noise_offset_random_strength", "noise_offset_random_strength"),
                      ("ss_adaptive_noise_scale", "adaptive_noise_scale"),
                      ("ss_multires_noise_iterations", "multires_noise_iterations"),
                      ("ss_multires_noise_discount", "multires_noise_discount"),
                      ("ss_ip_noise_gamma", "ip_noise_gamma"),
                      ("ss_ip_noise_gamma_random_strength", "ip_noise_gamma_random_strength"),
                      ("ss_zero_terminal_snr", "zero_terminal_snr"),
                      ("ss_min_snr_gamma", "min_snr_gamma"),
                      ("ss_debiased_estimation", "debiased_estimation_loss"),
                      ("ss_loss_type", "loss_type"), ("ss_huber_schedule", "huber_schedule"),
                      ("ss_huber_c", "huber_c"), ("ss_huber_scale", "huber_scale")):
        md[key] = str(getattr(opts, name))
    md.update({k: v for k, v in names.items() if k not in md})  # a family's own keys (Chroma's ss_model_type)
    flow = registry.get(model.family).flow
    if flow is not None:
        # the flow-matching settings sd-scripts' flux_train_network.py / sd3_train_network.py
        # record (update_metadata), each as ss_<option>
        md.update({f"ss_{name}": str(registry.flow_option(opts, model.family, name))
                   for name in flow.metadata_options})
    if model.adapter is not None:  # sd-scripts' train_network records its fp8 base settings
        md["ss_fp8_base"] = str(opts.fp8_base)
        md["ss_fp8_base_unet"] = str(opts.fp8_base_unet)
    return _user_fields(md, opts, network_info)


def leco_metadata(opts: Options, *, model: ModelKind, network_info: dict, settings: list,
                  started_at: float) -> dict:
    """train_leco's static metadata: train_lora's run keys and modelspec fields (a U-Net LoRA),
    and sd-scripts' ss_leco_* keys for the prompt ``settings`` (library/config/leco_prompts.py)."""
    h, w = settings[0].resolution
    names = _family_fields(model)
    md = _run_fields(opts, model.family, started_at, names)
    md.update({
        "ss_optimizer": str(opts.optimizer_type),
        "ss_leco_prompt_count": str(len(settings)),
        "ss_leco_prompts_file": os.path.basename(required(opts.prompts_file, "prompts_file")),
        "ss_leco_max_denoising_steps": str(opts.max_denoising_steps),
        "ss_leco_denoise_guidance_scale": str(opts.leco_denoise_guidance_scale),
        "ss_leco_preview": json.dumps(
            [{"target": p.target, "positive": p.positive, "unconditional": p.unconditional,
              "neutral": p.neutral, "action": p.action, "multiplier": p.multiplier,
              "weight": p.weight} for p in settings[:16]], ensure_ascii=False),
    })
    md.update(_modelspec(opts, names, started_at, f"{w}x{h}"))
    return _user_fields(md, opts, network_info)


def _family_fields(model: ModelKind) -> dict:
    """ss_base_model_version and modelspec architecture / implementation / prediction_type (absent:
    the family writes none, as FLUX.1), and a family's own keys (Chroma's ss_model_type)."""
    # sd-scripts' values, from its home; a DDPM model's "variant" is its prediction type
    variant = model.variant
    if registry.get(model.family).flow is None:
        variant = "v" if model.v_parameterization else "epsilon"
    return registry.home(model.family).metadata_fields(variant, model.adapter)


def _run_fields(opts: Options, family: str, started_at: float, names: dict) -> dict:
    """The run's keys every training script writes (``names``: _family_fields)."""
    return {
        "ss_training_started_at": str(started_at),
        "ss_output_name": opts.output_name,
        "ss_learning_rate": str(opts.learning_rate),
        "ss_unet_lr": str(opts.unet_lr),
        "ss_max_train_steps": str(opts.max_train_steps),
        "ss_lr_scheduler": str(opts.lr_scheduler),
        "ss_mixed_precision": str(opts.mixed_precision),
        "ss_seed": str(opts.seed),
        "ss_v2": str(registry.get(family).v2_metadata),
        "ss_base_model_version": names["ss_base_model_version"],
        "ss_sd_model_name": os.path.basename(str(opts.pretrained_model_name_or_path)),
    }


def _modelspec(opts: Options, names: dict, started_at: float, resolution: str) -> dict:
    """SAI's modelspec.* fields of a run's file (``names``: _family_fields; ``resolution``: "WxH")."""
    md = {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": names["modelspec.architecture"],
        "modelspec.implementation": names["modelspec.implementation"],
        "modelspec.title": opts.metadata_title if opts.metadata_title is not None else opts.output_name,
        "modelspec.resolution": resolution,
        "modelspec.date": datetime.datetime.fromtimestamp(started_at).isoformat(timespec="seconds"),
    }
    if "modelspec.prediction_type" in names:
        md["modelspec.prediction_type"] = names["modelspec.prediction_type"]
    return md


def _user_fields(md: dict, opts: Options, network_info: dict | None) -> dict:
    """The metadata_* options' modelspec fields, training_comment and the network's own keys."""
    md.update(model_spec_fields(opts))
    if opts.training_comment is not None:
        md["ss_training_comment"] = opts.training_comment
    if network_info:
        md.update({k: str(v) for k, v in network_info.items()})
    return md


# sd-scripts' metadata_* options (library/sai_model_spec.py), each written as modelspec.<field>
MODEL_SPEC_FIELDS = ("author", "description", "license", "tags", "usage_hint", "thumbnail",
                     "merged_from", "trigger_phrase", "preprocessor", "is_negative_embedding")


class MetadataError(UserError, ValueError):
    pass


def check_options(opts: Options) -> None:
    """Before any weight loads: a metadata_thumbnail file must exist (sd-scripts skips a missing
    one with a warning; a silently missing thumbnail is what we avoid)."""
    thumb = opts.metadata_thumbnail
    if thumb and not thumb.startswith("data:") and not os.path.isfile(thumb):
        raise MetadataError(f"metadata_thumbnail: no such file: {thumb}")


def model_spec_fields(opts: Options) -> dict:
    """modelspec.<field> for every metadata_<field> that is set; a thumbnail file becomes a
    data: URL (base64 of the file, MIME type from its name), as sd-scripts embeds it."""
    out = {}
    for name in MODEL_SPEC_FIELDS:
        value = getattr(opts, f"metadata_{name}")
        if value is None:
            continue
        if name == "thumbnail" and not value.startswith("data:"):
            mime = mimetypes.guess_type(value)[0] or "application/octet-stream"
            with open(value, "rb") as f:
                value = f"data:{mime};base64,{base64.b64encode(f.read()).decode('ascii')}"
        out[f"modelspec.{name}"] = value
    return out


def step_metadata(base: dict, *, epoch: int | None, step: int, finished_at: float) -> dict:
    """``base`` with a save's values; ``epoch`` None: a run without epochs (train_leco)."""
    md = dict(base)
    if epoch is not None:
        md["ss_epoch"] = str(epoch)
    md["ss_steps"] = str(step)
    md["ss_training_finished_at"] = str(finished_at)
    return md
