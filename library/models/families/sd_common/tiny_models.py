"""Built-in models selectable by reserved name: tiny random-weight models with the real block
topology of SD1.5, SD2 (v-prediction) and SDXL at small widths, for the quick start, CI and tests.

Every component is built from a fixed seed, so two builds are bit-identical. The CLIP tokenizer
vocabulary is generated locally (byte-level symbols, no download).
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

TINY_NAMES = ("tiny-sd15", "tiny-sd2", "tiny-sdxl",
              "tiny-sd15-inpaint", "tiny-sd2-inpaint", "tiny-sdxl-inpaint")
ARCH_OF_NAME = {"tiny-sd15": "sd15", "tiny-sd2": "sd2", "tiny-sdxl": "sdxl",
                "tiny-sd15-inpaint": "sd15", "tiny-sd2-inpaint": "sd2", "tiny-sdxl-inpaint": "sdxl"}
# An inpainting model's U-Net takes 9 channels: 4 noisy latent, 1 mask, 4 masked-image latent
# (library/models/inpainting.py); everything else is the base architecture's.
INPAINT_SUFFIX = "-inpaint"
FAMILY_OF_ARCH = {"sd15": "sd1", "sd2": "sd2", "sdxl": "sdxl"}
SEED = 20240601


def _bytes_to_unicode() -> dict[int, str]:
    # CLIP's reversible byte -> printable-unicode table (same construction as GPT-2 / CLIP).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


# A handful of merges so that common caption words are not all single characters.
_TINY_WORDS = ("a", "photo", "of", "the", "sks", "dog", "cat", "person", "style", "red", "blue",
               "green", "in", "on", "with", "and", "man", "woman", "picture", "painting")


def tiny_tokenizer_files() -> tuple[dict[str, int], list[str]]:
    """Return (vocab, merges) of a small CLIP-style BPE vocabulary built locally."""
    symbols = list(_bytes_to_unicode().values())
    vocab_list = symbols + [s + "</w>" for s in symbols]
    merges: list[str] = []
    seen = set(vocab_list)
    for word in _TINY_WORDS:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        # Merge left to right: ((p h) o) t ... so every prefix becomes a token.
        while len(parts) > 1:
            a, b = parts[0], parts[1]
            merged = a + b
            if f"{a} {b}" not in merges:
                merges.append(f"{a} {b}")
            if merged not in seen:
                vocab_list.append(merged)
                seen.add(merged)
            parts = [merged] + parts[2:]
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab_list)}, merges


def write_tokenizer(dir_path: str) -> None:
    vocab, merges = tiny_tokenizer_files()
    os.makedirs(dir_path, exist_ok=True)
    with open(os.path.join(dir_path, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(dir_path, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    with open(os.path.join(dir_path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"model_max_length": 77, "tokenizer_class": "CLIPTokenizer",
                   "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
                   "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, f)
    with open(os.path.join(dir_path, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
                   "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, f)


def _vocab_size() -> int:
    return len(tiny_tokenizer_files()[0])


# --- architecture configs (diffusers / transformers config dicts) ---------------------------

def unet_config(arch: str, inpaint: bool = False) -> dict[str, Any]:
    cfg = _unet_config(arch)
    if inpaint:
        cfg["in_channels"] = 9
    return cfg


def _unet_config(arch: str) -> dict[str, Any]:
    if arch == "sd15":
        return dict(sample_size=8, in_channels=4, out_channels=4,
                    down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                    up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
                    block_out_channels=[32, 64, 64, 64], layers_per_block=2,
                    attention_head_dim=8, cross_attention_dim=32, norm_num_groups=32,
                    use_linear_projection=False)
    if arch == "sd2":
        return dict(sample_size=8, in_channels=4, out_channels=4,
                    down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                    up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
                    block_out_channels=[32, 64, 64, 64], layers_per_block=2,
                    attention_head_dim=[2, 4, 4, 4], cross_attention_dim=64, norm_num_groups=32,
                    use_linear_projection=True, upcast_attention=True)
    if arch == "sdxl":
        te1, te2_proj = 32, 64
        return dict(sample_size=8, in_channels=4, out_channels=4,
                    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                    block_out_channels=[32, 64, 64], layers_per_block=2,
                    transformer_layers_per_block=[1, 2, 10], attention_head_dim=[2, 4, 4],
                    cross_attention_dim=te1 + 64, norm_num_groups=32, use_linear_projection=True,
                    addition_embed_type="text_time", addition_time_embed_dim=8,
                    projection_class_embeddings_input_dim=te2_proj + 6 * 8)
    raise ValueError(f"unknown tiny architecture {arch!r}")


def vae_config(arch: str) -> dict[str, Any]:
    return dict(in_channels=3, out_channels=3, latent_channels=4, sample_size=64,
                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                block_out_channels=[32, 32, 64, 64], layers_per_block=1, norm_num_groups=32,
                scaling_factor=0.13025 if arch == "sdxl" else 0.18215)


def text_encoder_configs(arch: str) -> list[dict[str, Any]]:
    common = dict(vocab_size=_vocab_size(), max_position_embeddings=77, bos_token_id=_vocab_size() - 2,
                  eos_token_id=_vocab_size() - 1, pad_token_id=_vocab_size() - 1)
    if arch == "sd15":
        return [dict(common, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, hidden_act="quick_gelu", projection_dim=32)]
    if arch == "sd2":
        return [dict(common, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, hidden_act="gelu", projection_dim=64)]
    if arch == "sdxl":
        return [dict(common, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, hidden_act="quick_gelu", projection_dim=32),
                dict(common, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, hidden_act="gelu", projection_dim=64)]
    raise ValueError(f"unknown tiny architecture {arch!r}")


def scheduler_config(arch: str) -> dict[str, Any]:
    return dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                beta_schedule="scaled_linear", clip_sample=False,
                steps_offset=1, prediction_type="v_prediction" if arch == "sd2" else "epsilon")


def build_tiny_components(arch: str, inpaint: bool = False) -> dict[str, Any]:
    """Build the components of a tiny model: unet, vae, text_encoder(s), tokenizer(s), scheduler;
    ``inpaint``: the U-Net of an inpainting model (9 input channels).

    Keys follow diffusers pipelines: text_encoder / tokenizer, and for SDXL text_encoder_2 /
    tokenizer_2 (a CLIPTextModelWithProjection, whose pooled projection feeds the U-Net).
    """

    # lazy: --help, the dry run's plan and the UI server's start load this module before torch;
    # torch, diffusers and transformers are imported when build_tiny_components() runs
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    if arch not in FAMILY_OF_ARCH:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {sorted(FAMILY_OF_ARCH)}")
    out: dict[str, Any] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        out["unet"] = UNet2DConditionModel(**unet_config(arch, inpaint))
        torch.manual_seed(SEED + 1)
        out["vae"] = AutoencoderKL(**vae_config(arch))
        for i, cfg in enumerate(text_encoder_configs(arch)):
            torch.manual_seed(SEED + 2 + i)
            config = CLIPTextConfig(**cfg)
            cls = CLIPTextModelWithProjection if (arch == "sdxl" and i == 1) else CLIPTextModel
            out["text_encoder" if i == 0 else "text_encoder_2"] = cls(config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(tmp)
        out["tokenizer"] = CLIPTokenizer.from_pretrained(tmp)
        if arch == "sdxl":
            # As the real SDXL: the second (OpenCLIP) tokenizer pads with "!".
            out["tokenizer_2"] = CLIPTokenizer.from_pretrained(tmp, pad_token="!")
    out["scheduler"] = DDPMScheduler(**scheduler_config(arch))
    return out
