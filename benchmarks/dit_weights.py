"""Random-weight Anima and Lumina 2 files for benchmarks/gpu.py, in layouts the trainer and
sd-scripts' anima_train_network.py / lumina_train_network.py both read (gpu.sd_scripts_files; the
tokenizer folders in the format transformers 4 and 5 both load, sd_scripts_launch.write_tokenizer),
so that the rows run at full size with nothing downloaded:

- Anima: the DiT with its LLM adapter (``net.``-prefixed keys, the released file's layout; the RoPE
  tables left out, as the loader rebuilds them), a Qwen3-0.6B folder (config.json, the offline tiny
  Qwen3 tokenizer, the weights), the Qwen-Image VAE as a diffusers folder, and the tiny T5
  tokenizer's folder for ``t5_tokenizer_path`` (its ids stay below T5's 32128);
- Lumina 2: the Next-DiT 2B in the original layout (with this toolkit's config record), Gemma-2 2B
  (``model.``-prefixed, carrying the tiny Gemma tokenizer and its config in its metadata) and
  FLUX.1's autoencoder in BFL names.

Weights are N(0, 0.02) from fixed seeds (benchmarks/flux_weights.py's values), bf16; the Anima
files take about 5.7 GB, Lumina's about 10.6 GB.

    paths(work, family)                       {option: path} under work
    write_files(work, family, configs=None)   writes the missing ones (full size unless configs say)
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from diffusers import AutoencoderKL, AutoencoderKLQwenImage  # noqa: E402
from transformers import Gemma2Config, Gemma2Model, Qwen3Config, Qwen3Model  # noqa: E402

from benchmarks import sd_scripts_launch  # noqa: E402
from benchmarks.flux_weights import _cast, _random_values, _save  # noqa: E402
from library.models import t5  # noqa: E402
from library.models.families.flux import flux_ae  # noqa: E402
from library.models.families.anima import model, parts, tiny  # noqa: E402
from library.models.families.lumina import loading, nextdit, text  # noqa: E402

# the option each file or folder goes to, and its name under the working folder
NAMES = {"anima": {"pretrained_model_name_or_path": "anima-random.safetensors", "qwen3": "qwen3-random",
                   "vae": "qwen-image-vae-random", "t5_tokenizer_path": "t5-tokenizer"},
         "lumina": {"pretrained_model_name_or_path": "lumina2-random.safetensors",
                    "gemma2": "gemma2-random.safetensors", "ae": "lumina-ae-random.safetensors"}}
SEEDS = {"pretrained_model_name_or_path": 11, "qwen3": 12, "vae": 13, "gemma2": 14, "ae": 15}
# full size: Anima's DiT (2B, its adapter), Qwen3-0.6B, the Qwen-Image VAE; Lumina 2's 2B Next-DiT,
# Gemma-2 2B, FLUX.1's autoencoder
FULL = {"anima": {"dit": model.FULL, "qwen3": parts.QWEN3_06B, "vae": {}},
        "lumina": {"transformer": nextdit.LUMINA2_2B, "gemma2": text.GEMMA2_2B, "ae": flux_ae.FLUX_AE_CONFIG}}


def paths(work: str, family: str) -> dict:
    return {k: os.path.join(work, name) for k, name in NAMES[family].items()}


def _states(family: str, configs: dict, dtype: torch.dtype) -> dict:
    """{option: tensors on the meta device, as the file holds them}."""
    with torch.device("meta"):
        if family == "anima":
            dit = model.Anima(configs["dit"]).state_dict()
            return {"pretrained_model_name_or_path": _cast({model.PREFIX + k: v for k, v in dit.items()
                                                             if k not in model.ROPE_BUFFERS}, dtype),
                    "qwen3": _cast(Qwen3Model(Qwen3Config(**configs["qwen3"])).state_dict(), dtype),
                    "vae": _cast(AutoencoderKLQwenImage(**configs["vae"]).state_dict(), dtype)}
        gemma = Gemma2Model(Gemma2Config(**configs["gemma2"])).state_dict()
        return {"pretrained_model_name_or_path": _cast(nextdit.NextDiT(configs["transformer"]).state_dict(), dtype),
                "gemma2": _cast({"model." + k: v for k, v in gemma.items()}, dtype),
                "ae": _cast(flux_ae.ae_state_dict(AutoencoderKL(**configs["ae"])), dtype)}


def write_files(work: str, family: str, configs: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The files of ``paths(work, family)`` (written once: an existing one is kept); ``configs``
    as FULL[family] (tests: tiny widths). Returns paths(work, family)."""
    configs = configs or FULL[family]
    os.makedirs(work, exist_ok=True)
    out = paths(work, family)
    states = _states(family, configs, dtype)
    for option, path in out.items():
        if os.path.exists(path):
            continue
        if option == "t5_tokenizer_path":
            sd_scripts_launch.write_t5_tokenizer(t5.build_tiny_tokenizer(), path)
            continue
        meta = None
        with torch.device("meta"):
            if option == "gemma2":  # the tiny Gemma tokenizer and the config ride in the file
                meta = text.gemma2_file_metadata(Gemma2Model(Gemma2Config(**configs["gemma2"])),
                                                 text.build_tiny_tokenizer())
            elif option == "ae":  # its config (FLUX.1's unless a test's)
                meta = flux_ae.ae_file_metadata(AutoencoderKL(**configs["ae"]))
        values = _random_values(states[option], SEEDS[option])
        if option in ("qwen3", "vae"):  # folders: the config (Qwen3: and the tiny tokenizer), the weights
            os.makedirs(path + ".tmp", exist_ok=True)
            if option == "qwen3":
                Qwen3Config(**configs["qwen3"]).save_pretrained(path + ".tmp")
                tok = tiny.build_qwen3_tokenizer()  # a folder sd-scripts' transformers 4 reads too
                sd_scripts_launch.write_tokenizer(tok, path + ".tmp", {
                    "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token,
                    "pad_token": tok.pad_token, "model_max_length": tok.model_max_length})
                _save(values, os.path.join(path + ".tmp", "model.safetensors"), None)
            else:
                with torch.device("meta"):
                    AutoencoderKLQwenImage(**configs["vae"]).save_config(path + ".tmp")
                _save(values, os.path.join(path + ".tmp", "diffusion_pytorch_model.safetensors"), None)
            os.replace(path + ".tmp", path)
        elif family == "lumina" and option == "pretrained_model_name_or_path":  # with its config record
            record = loading.LuminaModel("original", configs["transformer"], None, None, None, None, "", "")
            loading.save_transformer(path, record, values, {})
        else:
            _save(values, path, meta)
        del values
    return out
