"""SD1 / SD2 / SDXL models between a single file (original layout) and a diffusers folder:
the conversion behind sd-scripts' tools/convert_diffusers20_original_sd.py.

The direction is sd-scripts': the source is a single file when it is a file (else a diffusers
folder, or a built-in name), the target is a single file when its name has an extension (else a
diffusers folder). Both sides go through the model loader (library/models/loading.py) and the
writers of library/models/sd_checkpoint.py, so a conversion is the same key mapping a training
run's load and save use: the weights come through bit for bit (in their dtype, or cast once to
the requested one). The family comes from the weights; ``--v1`` / ``--v2`` are checked against it.
"""
from __future__ import annotations

import ast
import logging
import os
from dataclasses import dataclass, field

import torch

from library.errors import ModelError, first_line
from library.models import fp8_storage, loading, sd_checkpoint
from library.models.families import registry

logger = logging.getLogger("sdtk")

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
# the kohya_ss GUI's "Source model type" choices (it passes one as --reference_model) and what
# their schedulers predict: SD2's 768 models v, the base models and SD1 the noise
GUI_REFERENCES = {"runwayml/stable-diffusion-v1-5": "epsilon", "CompVis/stable-diffusion-v1-4": "epsilon",
                  "stabilityai/stable-diffusion-2-1-base": "epsilon", "stabilityai/stable-diffusion-2-base": "epsilon",
                  "stabilityai/stable-diffusion-2-1": "v_prediction", "stabilityai/stable-diffusion-2": "v_prediction"}


@dataclass(frozen=True)
class Request:
    """What one conversion is asked to do (the tool's flags)."""
    model_to_load: str
    model_to_save: str
    v1: bool = False
    v2: bool = False
    unet_use_linear_projection: bool = False
    dtype: torch.dtype | None = None  # None: as loaded (float32)
    epoch: int = 0
    global_step: int = 0
    reference_model: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    allow_pickle: bool = False  # a .ckpt with pickled objects besides tensors (Lightning's)


def save_dtype(fp16: bool, bf16: bool, float_: bool, save_precision_as: str | None) -> torch.dtype | None:
    """sd-scripts' precision flags -> the dtype the model is saved in; one of them at most."""
    given = [f for f, on in (("--fp16", fp16), ("--bf16", bf16), ("--float", float_)) if on]
    if save_precision_as not in (None, "no"):
        given.append(f"--save_precision_as {save_precision_as}")
    if len(given) > 1:
        raise ModelError(f"{' and '.join(given)}: give one save precision")
    if not given:
        return None
    name = given[0].removeprefix("--").removeprefix("save_precision_as ")
    return fp8_storage.SAVE_PRECISIONS[name]


def parse_metadata(text: str | None) -> dict[str, str]:
    """--metadata: a Python / JSON dict literal (sd-scripts evaluates it; we only read literals)."""
    if not text:
        return {}
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ModelError(f"--metadata {text!r}: not a dict literal such as '{{\"name\": \"model\"}}'") from None
    if not isinstance(value, dict):
        raise ModelError(f"--metadata {text!r}: not a dict literal such as '{{\"name\": \"model\"}}'")
    return {str(k): str(v) for k, v in value.items()}


def is_single_file_target(path: str) -> bool:
    """sd-scripts' rule: a target name with an extension is a single file, else a diffusers folder."""
    ext = os.path.splitext(path.rstrip("/\\"))[1]
    if ext and ext.lower() not in SINGLE_FILE_SUFFIXES:
        raise ModelError(f"model_to_save {path}: a single file ends in {', '.join(SINGLE_FILE_SUFFIXES)}; "
                         "a diffusers folder has no extension")
    return bool(ext)


def check_family(family: str, v1: bool, v2: bool, source: str) -> None:
    """--v1 / --v2 name the family the weights must have (sd-scripts needs one to read a file;
    here the weights tell, and a flag that contradicts them is an error)."""
    if v1 and v2:
        raise ModelError("--v1 and --v2: give one of them (or neither: the family is read from the weights)")
    want = "sd1" if v1 else "sd2" if v2 else None
    if want is not None and family != want:
        flag = "--v1" if v1 else "--v2"
        raise ModelError(f"{flag}: {source} holds {registry.get(family).title} weights, not {registry.get(want).title}")


def _load(source: str, allow_pickle: bool):
    if not os.path.exists(source) and source not in loading.TINY_BUILTINS:
        raise ModelError(f"model_to_load {source}: no such file or folder")
    if os.path.isdir(source) and not os.path.isfile(os.path.join(source, "unet", "config.json")):
        raise ModelError(f"model_to_load {source}: not a diffusers model folder (no unet/config.json)")
    return loading.load_model_bundle(source, allow_pickle=allow_pickle)


def with_linear_projection(unet):
    """The U-Net with ``use_linear_projection = True`` (stabilityai's SD2 form): the transformer
    blocks' 1x1-convolution proj_in / proj_out become Linear layers with the same weights."""
    # lazy: diffusers (seconds) only when a conversion asks for it
    from diffusers import UNet2DConditionModel

    if unet.config.use_linear_projection:
        return unet
    config = dict(unet.config) | {"use_linear_projection": True}
    out = UNet2DConditionModel.from_config(config)
    state = {k: v.flatten(1) if k.endswith(("proj_in.weight", "proj_out.weight")) and v.ndim == 4 else v
             for k, v in unet.state_dict().items()}
    out.load_state_dict(state)
    return out.to(unet.dtype).eval()


def _reference_parts(reference: str, family: str) -> dict:
    """Tokenizer(s) and scheduler of a local diffusers folder (sd-scripts' --reference_model)."""
    # lazy: diffusers and transformers (seconds) only when a conversion asks for them
    import diffusers
    from transformers import CLIPTokenizer

    out = {}
    names = ["tokenizer", "tokenizer_2"][:len(registry.get(family).text_encoder_components)]
    try:
        for name in names:
            out[name] = CLIPTokenizer.from_pretrained(reference, subfolder=name, local_files_only=True)
        config = loading.read_json(os.path.join(reference, "scheduler", "scheduler_config.json"))
        cls = getattr(diffusers, str(config.get("_class_name")), None)
        if cls is None:
            raise ModelError(f"--reference_model {reference}: unknown scheduler class {config.get('_class_name')!r}")
        out["scheduler"] = cls.from_config(config)
    except ModelError:
        raise
    except (OSError, ValueError) as e:
        raise ModelError(f"--reference_model {reference}: {first_line(e)}") from None
    return out


def check_reference(reference: str) -> None:
    if not os.path.isdir(reference) and not loading.HUB_ID.match(reference):
        raise ModelError(f"--reference_model {reference}: neither a local diffusers folder nor a hub id")


def _hub_reference(reference: str) -> str:
    """The scheduler and tokenizer files of a hub model (not its weights), downloaded."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ModelError("the hub is offline (HF_HUB_OFFLINE=1)")
    # lazy: huggingface_hub only for a hub reference
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(reference, allow_patterns=["model_index.json", "scheduler/*", "tokenizer*/*"])
    except Exception as e:  # network, auth and not-found errors all end the same way
        raise ModelError(first_line(e)) from None


def reference_parts(reference: str, components: dict, family: str) -> dict:
    """What --reference_model replaces: a local folder's or a hub model's tokenizer(s) and
    scheduler. A hub model that cannot be fetched (offline) leaves the loaded model's own, with
    a warning; the kohya_ss GUI's model ids then still set the scheduler's prediction type."""
    if os.path.isdir(reference):
        return _reference_parts(reference, family)
    try:
        return _reference_parts(_hub_reference(reference), family)
    except ModelError as e:
        logger.warning("--reference_model %s: not available (%s); the loaded model's tokenizer and scheduler "
                       "are written", reference, e)
    prediction = GUI_REFERENCES.get(reference)
    if prediction is None:
        return {}
    scheduler = components["scheduler"]
    return {"scheduler": type(scheduler).from_config(scheduler.config, prediction_type=prediction)}


def convert(req: Request) -> str:
    """Load, convert and write (atomically); returns a one-line summary."""
    to_file = is_single_file_target(req.model_to_save)
    if os.path.isfile(req.model_to_save) and not to_file or os.path.isdir(req.model_to_save) and to_file:
        kind = "a file" if os.path.isfile(req.model_to_save) else "a folder"
        raise ModelError(f"model_to_save {req.model_to_save}: is {kind}; it would be replaced by "
                         f"{'a single file' if to_file else 'a diffusers folder'}")
    if to_file and req.reference_model:
        logger.warning("--reference_model: no effect when saving a single file (it supplies a diffusers "
                       "folder's tokenizer and scheduler)")
    if req.reference_model and not to_file:
        check_reference(req.reference_model)
    bundle = _load(req.model_to_load, req.allow_pickle)
    check_family(bundle.family, req.v1, req.v2, req.model_to_load)
    components = bundle.components()
    name = registry.get(bundle.family).title
    if to_file:
        if req.unet_use_linear_projection:
            logger.warning("--unet_use_linear_projection: no effect when saving a single file (the original "
                           "layout's projections are the family's: SD2 and SDXL Linear, SD1 1x1 convolutions)")
        metadata = dict(req.metadata)
        if req.epoch or req.global_step:
            metadata |= {"epoch": str(req.epoch), "global_step": str(req.global_step)}
        sd_checkpoint.save_single_file(components, bundle.family, req.model_to_save, dtype=req.dtype,
                                       metadata=metadata,
                                       ckpt_extras={"epoch": req.epoch, "global_step": req.global_step})
        return f"saved {req.model_to_save}: {name} single file"
    if req.metadata or req.epoch or req.global_step:
        logger.warning("--metadata / --epoch / --global_step: no effect when saving a diffusers folder")
    if req.reference_model:
        components |= reference_parts(req.reference_model, components, bundle.family)
    if req.unet_use_linear_projection:
        components["unet"] = with_linear_projection(components["unet"])
    sd_checkpoint.save_diffusers(components, bundle.family, req.model_to_save, dtype=req.dtype)
    return f"saved {req.model_to_save}: {name} diffusers folder"
