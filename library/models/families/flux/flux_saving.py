"""Writing a whole FLUX.1 model: as sd-scripts' separate files (a BFL transformer file, ``clip_l``,
``t5xxl``, ``ae``) or as a diffusers FLUX folder that diffusers' ``FluxPipeline`` loads.

``parts`` is a dict with transformer (library.models.families.flux.flux.Flux), clip_l (CLIPTextModel), t5
(T5EncoderModel), ae (AutoencoderKL), clip_tokenizer, t5_tokenizer. Files carry the configs of
non-standard (tiny) architectures in their metadata, so they load offline.
"""
from __future__ import annotations

import copy
import json
import os

import torch

from library import safetensors_file
from library.files import atomic_dir, atomic_path
from library.models import clip_l_file, t5
from library.models.families.flux import flux_ae, flux_checkpoint

SINGLE_FILE_NAMES = {"transformer": "flux1.safetensors", "clip_l": "clip_l.safetensors",
                     "t5xxl": "t5xxl.safetensors", "ae": "ae.safetensors"}


def _save(sd: dict, path: str, metadata: dict) -> None:
    sd = {k: v.detach().contiguous().cpu() for k, v in sd.items()}
    with atomic_path(path) as tmp:
        safetensors_file.save(sd, tmp, metadata=metadata)


def save_single_files(parts: dict, out_dir: str) -> dict[str, str]:
    """The four files sd-scripts takes (transformer in the BFL layout); returns their paths by
    role: transformer, clip_l, t5xxl, ae."""
    paths = {role: os.path.join(out_dir, name) for role, name in SINGLE_FILE_NAMES.items()}
    tr = parts["transformer"]
    flux_checkpoint.save_flux_transformer(paths["transformer"], tr.state_dict(), "bfl", tr.config)
    _save(clip_l_file.clip_l_state_dict(parts["clip_l"]), paths["clip_l"],
          clip_l_file.clip_l_file_metadata(parts["clip_l"], parts["clip_tokenizer"]))
    # Both names of the T5 token embedding share one tensor: safetensors refuses shared storage.
    t5_sd = {k: v.clone() for k, v in parts["t5"].state_dict().items()}
    _save(t5_sd, paths["t5xxl"], t5.t5_file_metadata(parts["t5"], parts["t5_tokenizer"]))
    _save(flux_ae.ae_state_dict(parts["ae"]), paths["ae"], flux_ae.ae_file_metadata(parts["ae"]))
    return paths


def scheduler_config(variant: str) -> dict:
    """diffusers' FlowMatchEulerDiscreteScheduler config of the FLUX.1 pipelines: dev shifts the
    schedule with the image size, schnell does not."""
    if variant == "dev":
        return {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
                "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                "base_image_seq_len": 256, "max_image_seq_len": 4096}
    return {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0,
            "use_dynamic_shifting": False, "base_shift": 0.5, "max_shift": 1.15,
            "base_image_seq_len": 256, "max_image_seq_len": 4096}


def save_diffusers_folder(parts: dict, variant: str, out_dir: str, dtype: torch.dtype | None = None) -> None:
    """A diffusers FLUX folder (model_index.json for FluxPipeline); atomic as a whole."""
    with atomic_dir(out_dir) as tmp:
        tr = parts["transformer"]
        flux_checkpoint.save_flux_transformer(os.path.join(tmp, "transformer"), tr.state_dict(), "diffusers",
                                              tr.config, dtype=dtype)
        for name, part in (("text_encoder", parts["clip_l"]), ("text_encoder_2", parts["t5"]),
                           ("vae", parts["ae"])):
            model = part if dtype is None else _cast_copy(part, dtype)
            model.save_pretrained(os.path.join(tmp, name), safe_serialization=True)
        parts["clip_tokenizer"].save_pretrained(os.path.join(tmp, "tokenizer"))
        parts["t5_tokenizer"].save_pretrained(os.path.join(tmp, "tokenizer_2"))
        os.makedirs(os.path.join(tmp, "scheduler"))
        with open(os.path.join(tmp, "scheduler", "scheduler_config.json"), "w", encoding="utf-8") as f:
            json.dump(scheduler_config(variant), f, indent=2)
        index = {"_class_name": "FluxPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                 "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
                 "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5Tokenizer"],
                 "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]}
        with open(os.path.join(tmp, "model_index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)


def _cast_copy(model, dtype):
    return torch.nn.Module.to(copy.deepcopy(model), dtype)
