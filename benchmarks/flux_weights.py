"""Random-weight FLUX.1 files for benchmarks/gpu.py: a BFL-layout transformer (dev: 19 double,
38 single blocks, hidden 3072), CLIP-L, a T5-XXL-sized encoder and the 16-channel autoencoder,
each a single .safetensors file as the trainer loads them (``--pretrained_model_name_or_path``,
``--clip_l``, ``--t5xxl``, ``--ae``). Nothing is downloaded: the T5 file carries the offline
tiny T5 tokenizer and its vocabulary size (the encoder is XXL in every other dimension), the
CLIP-L file uses the shipped CLIP tokenizer and config. Weights are N(0, 0.02) from a fixed
seed, in bf16 (about 34 GB for the four files): what it/s and memory depend on is the shapes.

    paths(work)                               {model, clip_l, t5xxl, ae} under work
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

from library.models import clip_l_file, flux, flux_ae, flux_checkpoint, t5  # noqa: E402
from library.models.loading import SHIPPED_TOKENIZER  # noqa: E402

NAMES = {"model": "flux1-dev-random.safetensors", "clip_l": "clip_l-random.safetensors",
         "t5xxl": "t5xxl-random.safetensors", "ae": "ae-random.safetensors"}


def paths(work: str) -> dict:
    return {k: os.path.join(work, name) for k, name in NAMES.items()}


def _random_state(module: torch.nn.Module, dtype: torch.dtype, seed: int) -> dict:
    """N(0, 0.02) for every tensor of ``module`` (built on the meta device), one at a time."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in module.state_dict().items():
        if name.endswith("position_ids"):  # CLIP's index buffer: not in clip_l files
            continue
        if t.is_floating_point():
            out[name] = (torch.randn(t.shape, generator=g) * 0.02).to(dtype)
        else:
            out[name] = torch.zeros(t.shape, dtype=t.dtype)
    return out


def _save(sd: dict, path: str, metadata: dict | None) -> None:
    tmp = path + ".tmp"
    save_file(sd, tmp, metadata=metadata)
    os.replace(tmp, path)


def write_flux_files(work: str, *, transformer: flux.FluxConfig = flux.FLUX_DEV,
                     clip_config: dict | None = None, t5_config: dict | None = None,
                     ae_config: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The four files under ``work`` (written once: an existing file is kept). ``clip_config``
    None: CLIP-L's (the loader's default, no metadata); ``t5_config`` None: T5-XXL's with the
    tiny tokenizer's vocabulary; ``ae_config`` None: FLUX.1's autoencoder."""
    os.makedirs(work, exist_ok=True)
    out = paths(work)
    if not os.path.exists(out["model"]):
        with torch.device("meta"):
            model = flux.Flux(transformer)
        flux_checkpoint.save_flux_transformer(out["model"], _random_state(model, dtype, 1), "bfl",
                                              transformer, metadata={}, dtype=dtype)
    if not os.path.exists(out["clip_l"]):
        cfg = CLIPTextConfig(**clip_config) if clip_config else CLIPTextConfig.from_json_file(clip_l_file.CLIP_L_CONFIG)
        with torch.device("meta"):
            te = CLIPTextModel(cfg)
        meta = None
        if clip_config:  # not CLIP-L: the file says its config (the shipped tokenizer)
            meta = clip_l_file.clip_l_file_metadata(te, CLIPTokenizer.from_pretrained(SHIPPED_TOKENIZER))
        _save(_random_state(te, dtype, 2), out["clip_l"], meta)
    if not os.path.exists(out["t5xxl"]):
        tok = t5.build_tiny_tokenizer()
        cfg = t5_config or dict(t5.T5XXL_CONFIG, vocab_size=len(tok))
        with torch.device("meta"):
            enc = T5EncoderModel(T5Config(**cfg))
        sd = _random_state(enc, dtype, 3)
        sd.pop("encoder.embed_tokens.weight", None)  # tied to shared.weight: stored once
        _save(sd, out["t5xxl"], t5.t5_file_metadata(enc, tok))
    if not os.path.exists(out["ae"]):
        with torch.device("meta"):
            vae = AutoencoderKL(**(ae_config or flux_ae.FLUX_AE_CONFIG))
        _save(_random_state(vae, dtype, 4), out["ae"], flux_ae.ae_file_metadata(vae) if ae_config else None)
    return out
