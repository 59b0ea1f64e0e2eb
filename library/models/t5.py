"""The T5 text encoder of FLUX.1 / SD3: a transformers ``T5EncoderModel``, its tokenizer, the
tiny built-in one, and ``t5xxl`` single files.

The tiny tokenizer is built offline: a Unigram vocabulary made in code with T5's conventions
(pad = 0, eos ``</s>`` = 1, unk = 2, SentencePiece's ``▁`` word marker, ``</s>`` appended), wrapped
in transformers' ``T5Tokenizer`` (tokenizers-backed). Prompts are padded to
``t5xxl_max_token_length`` (FLUX.1 dev 512, schnell 256, as sd-scripts) and come with the
attention mask that ``apply_t5_attn_mask`` uses.

A ``t5xxl`` single file (``t5xxl_fp16.safetensors``, ``t5xxl_fp8_e4m3fn.safetensors``) holds
transformers ``T5EncoderModel`` keys; the token embedding is ``shared.weight``,
``encoder.embed_tokens.weight`` or both (the same tensor). The config comes from the shapes.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from transformers import T5Config, T5EncoderModel, T5Tokenizer

from library.errors import ModelError, first_line
from library.models import embedded_config, fp8_storage
from library.models.sd_checkpoint import read_state_dict

logger = logging.getLogger("sdtk")

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
T5_MAX_LENGTH = {"dev": 512, "schnell": 256}  # sd-scripts' t5xxl_max_token_length defaults
T5XXL_TOKENIZER_ID = "google/t5-v1_1-xxl"  # the tokenizer FLUX.1 and SD3 use (sd-scripts' choice)
META_CONFIG_KEY = "sdtk.t5_config"  # config and tokenizer of t5 files this toolkit writes
TINY_SEED = 20240603

# T5 v1.1 XXL (the encoder FLUX.1 and SD3 ship as t5xxl_*.safetensors).
T5XXL_CONFIG: dict[str, Any] = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                    relative_attention_num_buckets=32, relative_attention_max_distance=128,
                    feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0,
                    pad_token_id=PAD_ID, eos_token_id=EOS_ID, tie_word_embeddings=False, is_encoder_decoder=False)

_TINY_WORDS = ("a", "photo", "of", "the", "sks", "dog", "cat", "person", "style", "red", "blue",
               "green", "in", "on", "with", "and", "man", "woman", "picture", "painting")


def tiny_vocab() -> list[tuple[str, float]]:
    """(piece, log-probability) of the tiny Unigram vocabulary: T5's three specials, the word
    marker, printable ASCII characters alone and word-initial, and a few whole words (more
    likely than their spelling, so they come out as one token)."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    chars = [chr(c) for c in range(33, 127)]
    vocab += [(c, -5.0) for c in chars] + [("▁" + c, -5.5) for c in chars]
    vocab += [("▁" + w, -2.0) for w in _TINY_WORDS if len(w) > 1]
    return vocab


def build_tiny_tokenizer(max_length: int = 512):
    """The tiny T5 tokenizer (offline; a fixed vocabulary, so every build is the same)."""
    return T5Tokenizer(vocab=tiny_vocab(), extra_ids=0, model_max_length=max_length)


def tiny_config(vocab_size: int, d_model: int = 32) -> dict:
    return dict(T5XXL_CONFIG, vocab_size=vocab_size, d_model=d_model, d_kv=16, d_ff=64, num_layers=2, num_heads=2)


def build_tiny_t5(d_model: int = 32):
    """(T5EncoderModel, tokenizer) of the tiny built-in T5: random weights from a fixed seed;
    ``d_model`` its output width (tiny-flux 32; tiny-sd3 the MMDiT's context width, as T5-XXL's
    4096 is SD3's)."""
    tok = build_tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = T5EncoderModel(T5Config(**tiny_config(len(tok), d_model))).eval()
    return model, tok


def tokenize(tokenizer, texts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, max_length): padded with pad (0), truncated to
    max_length with </s> kept last, mask 1 on the real tokens and the </s>."""
    out = tokenizer(list(texts), max_length=max_length, padding="max_length", truncation=True,
                    return_tensors="pt")
    return out["input_ids"], out["attention_mask"]


def encode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
           apply_t5_attn_mask: bool) -> torch.Tensor:
    """The T5 hidden states (B, L, d_model); with apply_t5_attn_mask the encoder's attention skips
    the padding (sd-scripts passes the mask to T5 only then)."""
    dev = model.device
    mask = attention_mask.to(dev) if (apply_t5_attn_mask and attention_mask is not None) else None
    return model(input_ids.to(dev), attention_mask=mask).last_hidden_state


# --- files -----------------------------------------------------------------------------------

def config_from_state_dict(sd: dict, path: str) -> dict:
    """A T5 encoder config from the weights' shapes (T5 v1.1: gated-GELU when wi_0 is present)."""
    emb = sd.get("shared.weight", sd.get("encoder.embed_tokens.weight"))
    rel = sd.get("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    q = sd.get("encoder.block.0.layer.0.SelfAttention.q.weight")
    if emb is None or rel is None or q is None:
        raise ModelError(f"{path}: not a T5 encoder (no shared.weight / encoder.embed_tokens.weight or "
                         "encoder.block.0 attention)")
    layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("encoder.block."))
    heads = rel.shape[1]
    gated = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in sd
    ff = sd["encoder.block.0.layer.1.DenseReluDense." + ("wi_0" if gated else "wi") + ".weight"]
    return dict(T5XXL_CONFIG, vocab_size=emb.shape[0], d_model=emb.shape[1], d_kv=q.shape[0] // heads,
                d_ff=ff.shape[0], num_layers=layers, num_heads=heads,
                relative_attention_num_buckets=rel.shape[0],
                feed_forward_proj="gated-gelu" if gated else "relu")


def load_t5(path: str, dtype: torch.dtype = torch.float32):
    """A T5EncoderModel from a ``t5xxl`` single file (fp16 / bf16 / fp32, or fp8-stored: up-cast
    to ``dtype``). Returns (model, tokenizer or None): files this toolkit writes carry their
    tokenizer; others use T5-XXL's (load_t5_tokenizer)."""
    sd, meta = read_state_dict(path)
    record = embedded_config.read_record(meta, META_CONFIG_KEY, path)
    return model_from_state_dict(sd, path, dtype, (record or {}).get("config")), tokenizer_of_record(record)


def tokenizer_of_record(record: dict | None):
    """The tokenizer a file this toolkit wrote carries (t5_file_metadata's record), else None."""
    if record and record.get("tokenizer"):
        return embedded_config.tokenizer_from_files(T5Tokenizer, record["tokenizer"])
    return None


def model_from_state_dict(sd: dict, path: str, dtype: torch.dtype = torch.float32, config: dict | None = None):
    """A T5EncoderModel from transformers-layout weights (``config`` None: read from the shapes);
    fp8-stored weights are up-cast to ``dtype``. One line naming ``path`` when they do not fit."""
    sd = fp8_storage.load_dtype(dict(sd), dtype, path)
    cfg = config or config_from_state_dict(sd, path)
    # Either name of the token embedding may be missing: both are the same tensor.
    emb = sd.get("shared.weight", sd.get("encoder.embed_tokens.weight"))
    if emb is None:
        raise ModelError(f"{path}: not a T5 encoder (no shared.weight / encoder.embed_tokens.weight)")
    sd["shared.weight"] = sd["encoder.embed_tokens.weight"] = emb
    with torch.device("meta"):
        model = T5EncoderModel(T5Config(**cfg))
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    except RuntimeError as e:
        raise ModelError(f"{path}: the T5 weights do not fit their inferred config ({first_line(e)})") from None
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise ModelError(f"{path}: T5 encoder {'missing' if missing else 'unexpected'} tensor {name}")
    model.tie_weights()
    return model.eval()


def load_t5_tokenizer(location: str | None):
    """The T5 tokenizer: a folder with tokenizer files, or (``location`` None) T5-XXL's from the
    hub cache (downloaded only when online)."""
    local_only = location is not None or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        return T5Tokenizer.from_pretrained(location or T5XXL_TOKENIZER_ID, local_files_only=local_only)
    except Exception as e:  # noqa: BLE001 - network, missing files and parse errors end the same way
        raise ModelError(f"T5 tokenizer: cannot load {location or T5XXL_TOKENIZER_ID} ({first_line(e)}); "
                         "give a folder with its tokenizer files") from None


def t5_file_metadata(model, tokenizer) -> dict[str, str]:
    """Metadata that lets load_t5 rebuild a non-standard (tiny) T5 and its tokenizer offline."""
    cfg = {k: v for k, v in model.config.to_dict().items() if k in T5XXL_CONFIG}
    return {META_CONFIG_KEY: json.dumps({"config": cfg, "tokenizer": embedded_config.tokenizer_files(tokenizer)})}
