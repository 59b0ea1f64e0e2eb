"""Random-weight FLUX.1 files for benchmarks/gpu.py: a BFL-layout transformer (dev: 19 double,
38 single blocks, hidden 3072), CLIP-L, T5-XXL and the 16-channel autoencoder, each a single
.safetensors file as the trainer loads them (``--pretrained_model_name_or_path``, ``--clip_l``,
``--t5xxl``, ``--ae``) and as sd-scripts' FLUX.1 loaders (library/flux_utils.py) load them: the
same four files serve both sides of gpu.py's FLUX rows. Their layouts are the released files':
the transformer in BFL names, CLIP-L under ``text_model.``, T5-XXL with its 32128-token
vocabulary (``shared.weight``), the autoencoder in BFL/LDM names (``encoder.down.0.block.0...``).
Nothing is downloaded: the T5 file carries the offline tiny T5 tokenizer in its metadata (its
ids are all below 32128; sd-scripts reads the same tokenizer from gpu.py's tokenizer cache), the
CLIP-L file uses the shipped CLIP tokenizer and config. Weights are N(0, 0.02) from a fixed seed,
in bf16 (about 34 GB for the four files): what it/s and memory depend on is the shapes.

    paths(work)                               {model, clip_l, t5xxl, ae} under work
    file_states(...)                          {name: (meta tensors as the file holds them, metadata)}
    write_flux_files(work, ...)               writes the missing ones (configs default to full size)
"""
from __future__ import annotations

import os
import sys

from diffusers import AutoencoderKL
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from library.models import clip_l_file, t5  # noqa: E402
from library.models.families.flux import flux, flux_ae, flux_checkpoint  # noqa: E402
from library.models.loading import SHIPPED_TOKENIZER  # noqa: E402

NAMES = {"model": "flux1-dev-random.safetensors", "clip_l": "clip_l-random.safetensors",
         "t5xxl": "t5xxl-random.safetensors", "ae": "ae-random.safetensors"}
SEEDS = {"model": 1, "clip_l": 2, "t5xxl": 3, "ae": 4}


def paths(work: str) -> dict:
    return {k: os.path.join(work, name) for k, name in NAMES.items()}


def file_states(*, transformer: flux.FluxConfig = flux.FLUX_DEV, clip_config: dict | None = None,
                t5_config: dict | None = None, ae_config: dict | None = None,
                dtype: torch.dtype = torch.bfloat16) -> dict:
    """{name: (state, metadata)}: each file's tensors as meta tensors (the names, shapes and dtypes
    the file holds; nothing allocated, so the full-size headers can be checked without writing
    34 GB) and the metadata written beside them (the transformer's: save_flux_transformer adds its
    config record). ``clip_config`` None: CLIP-L's (the loader's default, no metadata);
    ``t5_config`` None: T5-XXL's; ``ae_config`` None: FLUX.1's autoencoder."""
    with torch.device("meta"):
        model = flux.Flux(transformer)
        te = CLIPTextModel(CLIPTextConfig(**clip_config) if clip_config
                           else CLIPTextConfig.from_json_file(clip_l_file.CLIP_L_CONFIG))
        enc = T5EncoderModel(T5Config(**(t5_config or t5.T5XXL_CONFIG)))
        vae = AutoencoderKL(**(ae_config or flux_ae.FLUX_AE_CONFIG))
    clip_meta = None
    if clip_config:  # not CLIP-L: the file says its config (the shipped tokenizer)
        clip_meta = clip_l_file.clip_l_file_metadata(te, CLIPTokenizer.from_pretrained(SHIPPED_TOKENIZER))
    t5_state = dict(enc.state_dict())
    t5_state.pop("encoder.embed_tokens.weight", None)  # tied to shared.weight: stored once
    return {"model": (_cast(model.state_dict(), dtype), {}),
            "clip_l": (_cast(clip_l_file.clip_l_state_dict(te), dtype), clip_meta),
            "t5xxl": (_cast(t5_state, dtype), t5.t5_file_metadata(enc, t5.build_tiny_tokenizer())),
            "ae": (_cast(flux_ae.ae_state_dict(vae), dtype), flux_ae.ae_file_metadata(vae) if ae_config else None)}


def _cast(state: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def _random_values(state: dict, seed: int) -> dict:
    """N(0, 0.02) in each floating tensor's dtype (zeros for integer ones), in the state's order."""
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(t.shape, generator=g) * 0.02).to(t.dtype) if t.is_floating_point()
            else torch.zeros(t.shape, dtype=t.dtype) for k, t in state.items()}


def _save(sd: dict, path: str, metadata: dict | None) -> None:
    tmp = path + ".tmp"
    save_file(sd, tmp, metadata=metadata)
    os.replace(tmp, path)


def write_flux_files(work: str, *, transformer: flux.FluxConfig = flux.FLUX_DEV,
                     clip_config: dict | None = None, t5_config: dict | None = None,
                     ae_config: dict | None = None, dtype: torch.dtype = torch.bfloat16,
                     names: tuple = tuple(NAMES)) -> dict:
    """The files ``names`` of ``paths(work)`` (written once: an existing file is kept), with
    file_states' tensors and metadata; returns paths(work)."""
    os.makedirs(work, exist_ok=True)
    out = paths(work)
    states = file_states(transformer=transformer, clip_config=clip_config, t5_config=t5_config,
                         ae_config=ae_config, dtype=dtype)
    for name in names:
        if os.path.exists(out[name]):
            continue
        state, meta = states[name]
        values = _random_values(state, SEEDS[name])
        if name == "model":
            flux_checkpoint.save_flux_transformer(out[name], values, "bfl", transformer, metadata=meta, dtype=dtype)
        else:
            _save(values, out[name], meta)
        del values
    return out
