"""The built-in ``tiny-anima``: Anima's topology at small widths, every part from a fixed seed (two
builds are bit-identical), tokenizers made offline.

- DiT: model.TINY (2 blocks, width 64, 2 heads of 32, AdaLN-LoRA 16, cross-attention width 32)
  with a 2-layer LLM adapter (width 32) over the tiny T5 vocabulary (t5.build_tiny_tokenizer).
- Qwen3: transformers' ``Qwen3Model`` (2 layers, hidden 32, 2 query / 1 key-value heads of 16)
  with a byte-level BPE tokenizer built here (the 256 byte symbols and Qwen's special tokens; no
  merges), padding with ``<|endoftext|>`` as Qwen3's.
- VAE: diffusers' ``AutoencoderKLQwenImage`` (16 latent channels, 8x down) at base width 16.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from diffusers import AutoencoderKLQwenImage
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

from library.models import t5
from library.models.families.anima import model

NAME = "tiny-anima"
SEED = 20260207
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def build_qwen3_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    for tok in QWEN_SPECIAL:
        vocab[tok] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(QWEN_SPECIAL))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=512)


def qwen3_config(vocab_size: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                       tie_word_embeddings=True, use_cache=False)


def tiny_config(t5_vocab: int) -> model.AnimaConfig:
    return replace(model.TINY, adapter=replace(model.TINY_ADAPTER, vocab_size=t5_vocab))


def vae_config() -> dict:
    return {"base_dim": 16, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
            "temperal_downsample": [False, True, True]}


def randomise(dit: model.Anima) -> model.Anima:
    """Every weight of ``dit`` drawn from torch's generator: sd-scripts zero-initialises the
    modulation outputs; random ones make the blocks matter in tests (a zero gate would hide every
    sub-layer)."""
    with torch.no_grad():
        for name, p in dit.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif p.ndim == 1:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return dit


def build() -> dict:
    """{dit, qwen3, vae, qwen3_tokenizer, t5_tokenizer} of tiny-anima."""
    t5_tok = t5.build_tiny_tokenizer()
    q_tok = build_qwen3_tokenizer()
    out = {"qwen3_tokenizer": q_tok, "t5_tokenizer": t5_tok}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        out["dit"] = randomise(model.Anima(tiny_config(len(t5_tok)))).eval()
        torch.manual_seed(SEED + 1)
        out["qwen3"] = Qwen3Model(qwen3_config(len(q_tok))).eval()
        torch.manual_seed(SEED + 2)
        out["vae"] = AutoencoderKLQwenImage(**vae_config()).eval()
    return out
