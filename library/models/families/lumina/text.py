"""Lumina Image 2.0's text side: Gemma-2 2B (transformers ``Gemma2Model``), its tokenizer, and the
system prompt sd-scripts prepends.

A training caption (and a sample's prompt) becomes ``"<system_prompt> <Prompt Start> <caption>"``
when ``system_prompt`` is set, else the caption alone; a sample's negative prompt gets no system
prompt (sd-scripts' LuminaTokenizeStrategy). It is tokenized with Gemma's BOS, right-padded to
``gemma2_max_token_length`` (256) rounded up to a multiple of 8, truncated there, with the
attention mask (1 = token). The transformer reads the penultimate hidden states
(``hidden_states[-2]``) and the mask.

The tiny tokenizer is built offline: a byte-level-free BPE vocabulary made in code with Gemma's
conventions (pad 0, eos 1, bos 2, unk 3, ``▁`` for spaces, BOS prepended), wrapped in transformers'
``GemmaTokenizer``.

A ``gemma2`` file (``gemma_2_2b_fp16.safetensors``) holds ``Gemma2Model`` keys, with or without the
``model.`` prefix (or Neta-Lumina's ``text_encoders.gemma2_2b.transformer.model.``); its shapes
are checked against Gemma-2 2B (or the config record this toolkit writes) before any weight loads.
"""
from __future__ import annotations

import json
import os
import struct

import accelerate
import torch
from transformers import Gemma2Config, Gemma2Model, GemmaTokenizer

from library.errors import ModelError, first_line
from library.models import embedded_config, fp8_storage
from library.models.sd_checkpoint import read_state_dict
from library.safetensors_file import read_header

PROMPT_START = "<Prompt Start>"
MAX_LENGTH = 256  # sd-scripts' gemma2_max_token_length default
PAD_TO_MULTIPLE = 8
GEMMA_ID = "google/gemma-2-2b"  # the tokenizer sd-scripts loads
META_CONFIG_KEY = "sdtk.gemma2_config"
TINY_SEED = 20250205
_PREFIXES = ("text_encoders.gemma2_2b.transformer.model.", "model.")

# sd-scripts' GEMMA2_CONFIG (google/gemma-2-2b)
GEMMA2_2B = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                 max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False,
                 attention_dropout=0.0, query_pre_attn_scalar=256, sliding_window=4096,
                 final_logit_softcapping=30.0, attn_logit_softcapping=50.0, pad_token_id=0, eos_token_id=1,
                 bos_token_id=2)
_TINY_WORDS = ("a", "photo", "of", "the", "sks", "dog", "cat", "person", "style", "red", "blue",
               "You", "are", "an", "assistant", "<Prompt", "Start>")


def with_system_prompt(caption: str, system_prompt: str | None) -> str:
    """What Gemma-2 reads for a caption (sd-scripts: f"{system_prompt} <Prompt Start> " + caption)."""
    return f"{system_prompt} {PROMPT_START} {caption}" if system_prompt else caption


def padded_length(max_length: int) -> int:
    """The token count every caption is padded (and truncated) to: max_length rounded up to 8."""
    return -(-max_length // PAD_TO_MULTIPLE) * PAD_TO_MULTIPLE


def tokenize(tokenizer, texts: list[str], max_length: int = MAX_LENGTH) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), each (B, padded_length(max_length)): BOS, tokens, right padding. sd-scripts
    asks the tokenizer for max_length with pad_to_multiple_of 8, which transformers refuses for a
    max_length that is not a multiple of 8: here the length is rounded up first."""
    tokenizer.padding_side = "right"
    enc = tokenizer(list(texts), max_length=padded_length(max_length), padding="max_length", truncation=True,
                    return_tensors="pt")
    return enc.input_ids, enc.attention_mask


def encode(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Gemma-2's penultimate hidden states (B, L, hidden) for the tokens."""
    dev = next(model.parameters()).device
    out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=True)
    return out.hidden_states[-2]


# -- the tiny built-in Gemma-2 -------------------------------------------------------------------

def tiny_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of the tiny tokenizer: Gemma's specials, ``▁``, printable ASCII characters,
    and a few words merged from them (each word one token after its merges)."""
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "▁"] + [chr(c) for c in range(33, 127)]
    merges = []
    for w in _TINY_WORDS:
        cur = "▁"
        for ch in w:
            merges.append((cur, ch))
            cur += ch
            if cur not in pieces:
                pieces.append(cur)
    return {p: i for i, p in enumerate(pieces)}, list(dict.fromkeys(merges))


def build_tiny_tokenizer():
    vocab, merges = tiny_vocab()
    tok = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    tok.padding_side = "right"
    return tok


def tiny_config(vocab_size: int, hidden_size: int = 32) -> dict:
    return dict(GEMMA2_2B, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64,
                num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                query_pre_attn_scalar=16, max_position_embeddings=512, sliding_window=64)


def build_tiny_gemma2(hidden_size: int = 32):
    """(Gemma2Model, tokenizer): random weights from a fixed seed."""
    tok = build_tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = Gemma2Model(Gemma2Config(**tiny_config(len(tok), hidden_size))).eval()
    return model, tok


# -- gemma2 files ----------------------------------------------------------------------------------

def _strip(keys) -> tuple[str, dict[str, str]]:
    """(prefix, {Gemma2Model key: file key}) with the first prefix every weight shares removed."""
    keys = list(keys)
    for prefix in _PREFIXES:
        inside = [k for k in keys if k.startswith(prefix)]
        if inside and any(k[len(prefix):] == "embed_tokens.weight" for k in inside):
            return prefix, {k[len(prefix):]: k for k in inside}
    return "", {k: k for k in keys}


def config_of_header(path: str) -> dict:
    """Gemma-2's config for a ``gemma2`` .safetensors file, from its header alone: this toolkit's
    record, else Gemma-2 2B's after checking every shape; one line naming the file otherwise."""
    try:
        _, header = read_header(path)
    except (OSError, ValueError, struct.error) as e:  # (a JSON or Unicode error is a ValueError)
        raise ModelError(f"gemma2: cannot read {path} as safetensors: {first_line(e) or 'too short'}") from None
    meta = header.pop("__metadata__", None) or {}
    record = embedded_config.read_record(meta, META_CONFIG_KEY, path)
    _, names = _strip(header)
    shapes = {k: tuple(header[v]["shape"]) for k, v in names.items()}
    config = record["config"] if record else GEMMA2_2B
    expect = expected_shapes(config)
    for k, shape in expect.items():  # a Gemma-2 of another size first shows in a shape
        if k in shapes and shapes[k] != shape:
            raise ModelError(f"gemma2: {path} is not a Gemma-2 2B text encoder: {k} is {list(shapes[k])}, "
                             f"Gemma-2 2B's is {list(shape)}")
    missing = [k for k in expect if k not in shapes]
    if missing:
        raise ModelError(f"gemma2: {path} is not a Gemma-2 2B text encoder (no {missing[0]}"
                         f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''})")
    return record or {"config": GEMMA2_2B}


def expected_shapes(config: dict) -> dict[str, tuple]:
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    out = {"embed_tokens.weight": (config["vocab_size"], h), "norm.weight": (h,)}
    for n in range(config["num_hidden_layers"]):
        p = f"layers.{n}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i),
                    **{p + norm + ".weight": (h,) for norm in ("input_layernorm", "post_attention_layernorm",
                                                               "pre_feedforward_layernorm", "post_feedforward_layernorm")}})
    return out


def load_gemma2(path: str, dtype: torch.dtype = torch.float32, tokenizer_location: str | None = None):
    """(Gemma2Model, tokenizer or None) from a ``gemma2`` .safetensors file or a transformers folder
    (``Gemma2Model`` / ``Gemma2ForCausalLM``; its tokenizer beside it)."""
    if os.path.isdir(path):
        try:
            model = Gemma2Model.from_pretrained(path, local_files_only=True, torch_dtype=dtype).eval()
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelError(f"gemma2: cannot load {path}: {first_line(e)}") from None
        return model, load_tokenizer(tokenizer_location or path, required=False)
    if not path.endswith((".safetensors", ".sft")):
        raise ModelError(f"gemma2: {path} is not a .safetensors file or a transformers folder")
    record = config_of_header(path)
    sd, _ = read_state_dict(path)
    _, names = _strip(sd)
    sd = fp8_storage.load_dtype({k: sd[v] for k, v in names.items() if k in expected_shapes(record["config"])},
                                dtype, path)
    # the weights on meta, the buffers built (the RoPE tables and the embedding scale are not in the
    # file: on meta they would stay there)
    with accelerate.init_empty_weights(include_buffers=False):
        model = Gemma2Model(Gemma2Config(**record["config"]))
    model.load_state_dict(sd, strict=True, assign=True)
    model = model.to(dtype).eval()
    tok = None
    if record.get("tokenizer"):
        tok = embedded_config.tokenizer_from_files(GemmaTokenizer, record["tokenizer"])
    elif tokenizer_location:
        tok = load_tokenizer(tokenizer_location)
    return model, tok


def gemma2_file_metadata(model, tokenizer) -> dict[str, str]:
    """The record a tiny / custom Gemma-2 file carries so that it reloads offline."""
    cfg = {k: v for k, v in model.config.to_dict().items()
           if not k.startswith("_") and k not in ("transformers_version", "architectures", "dtype", "torch_dtype")}
    return {META_CONFIG_KEY: json.dumps({"config": cfg, "tokenizer": embedded_config.tokenizer_files(tokenizer)})}


def load_tokenizer(location: str | None, required: bool = True):
    """Gemma's tokenizer from a folder (its own, a diffusers folder's ``tokenizer/``) or, with
    None, the hub's google/gemma-2-2b (sd-scripts' choice; cached or online)."""
    # lazy: AutoTokenizer pulls in every tokenizer class; only a real model's load needs it
    from transformers import AutoTokenizer

    source = location or GEMMA_ID
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=location is not None)
    except (OSError, ValueError) as e:
        if not required:
            return None
        raise ModelError(f"gemma2: no Gemma tokenizer at {source} ({first_line(e)}); give a folder with "
                         "Gemma-2's tokenizer files") from None
    tok.padding_side = "right"
    return tok
