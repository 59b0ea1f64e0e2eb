"""CLIP-L ``clip_l`` single files (FLUX.1, SD3): transformers CLIPTextModel tensors under
``text_model.`` names, as sd-scripts and ComfyUI read and write them.
"""
from __future__ import annotations

import json
import os

import torch
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from library.errors import ModelError, first_line
from library.models import embedded_config, fp8_storage
from library.models.loading import SHIPPED_CONFIGS, SHIPPED_TOKENIZER
from library.models.sd_checkpoint import read_state_dict

CLIP_META_KEY = "sdtk.clip_config"  # config and tokenizer of clip_l files this toolkit writes
# The CLIP-L text encoder FLUX.1 uses is SD1.5's (ViT-L/14's text tower): the shipped config.
CLIP_L_CONFIG = os.path.join(SHIPPED_CONFIGS, "sd15", "text_encoder", "config.json")
# Tensors of a clip_l file that CLIPTextModel does not hold (the projection and logit scale of
# the full CLIP model, the position-id buffer of older transformers).
_CLIP_EXTRAS = ("text_projection.weight", "logit_scale", "embeddings.position_ids")


def load_clip_l(path: str, dtype: torch.dtype = torch.float32):
    """(CLIPTextModel, CLIPTokenizer) from a ``clip_l`` single file (transformers key names, with
    or without the ``text_model.`` prefix; fp8-stored up-cast). Its config and tokenizer are
    CLIP-L's (shipped), or the ones in the metadata of files this toolkit writes."""
    sd, meta = read_state_dict(path)
    sd = fp8_storage.load_dtype(sd, dtype, path)
    record = embedded_config.read_record(meta, CLIP_META_KEY, path)
    config = clip_l_config(meta, path)
    with torch.device("meta"):
        model = CLIPTextModel(config)
    wrapped = hasattr(model, "text_model")  # transformers < 5.6 nests the model under text_model.
    fixed = {}
    for k, v in sd.items():
        k = k.removeprefix("text_model.")
        if k in _CLIP_EXTRAS or k.endswith("position_ids"):
            continue
        fixed[("text_model." + k) if wrapped else k] = v
    try:
        missing, unexpected = model.load_state_dict(fixed, strict=False, assign=True)
    except RuntimeError as e:
        raise ModelError(f"{path}: the weights are not CLIP-L's ({first_line(e)})") from None
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise ModelError(f"{path}: not a CLIP-L text encoder ({'missing' if missing else 'unexpected'} tensor {name})")
    _reset_position_ids(model)
    if record and record.get("tokenizer"):
        tok = embedded_config.tokenizer_from_files(CLIPTokenizer, record["tokenizer"])
    else:
        tok = CLIPTokenizer.from_pretrained(SHIPPED_TOKENIZER, local_files_only=True)
    return model.eval(), tok


def clip_l_config(meta: dict, path: str) -> CLIPTextConfig:
    """A clip_l file's config: the one in its metadata (files this toolkit writes), else CLIP-L's."""
    record = embedded_config.read_record(meta, CLIP_META_KEY, path)
    return CLIPTextConfig(**record["config"]) if record else CLIPTextConfig.from_json_file(CLIP_L_CONFIG)


def _reset_position_ids(model) -> None:
    # The position-id buffer is not in clip_l files: built on the meta device it has no values.
    for name, buf in list(model.named_buffers()):
        if name.endswith("position_ids") and buf.device.type == "meta":
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            owner.register_buffer("position_ids", torch.arange(buf.shape[-1]).expand(buf.shape), persistent=False)


def clip_l_state_dict(model) -> dict:
    """The CLIP-L tensors as clip_l files hold them (``text_model.`` names)."""
    return {(k if k.startswith("text_model.") else "text_model." + k): v
            for k, v in model.state_dict().items() if not k.endswith("position_ids")}


def clip_l_file_metadata(model, tokenizer) -> dict[str, str]:
    """Metadata that lets load_clip_l rebuild a non-standard (tiny) CLIP and its tokenizer offline."""
    cfg = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_")}
    return {CLIP_META_KEY: json.dumps({"config": cfg, "tokenizer": embedded_config.tokenizer_files(tokenizer)})}
