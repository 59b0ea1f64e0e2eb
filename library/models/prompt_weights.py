"""A1111-style prompt weights in captions (``weighted_captions``), as sd-scripts reads them.

Syntax (sd-scripts' ``parse_prompt_attention``, from A1111):
    (text)        weight x 1.1            [text]   weight / 1.1
    (text:1.3)    weight x 1.3            nesting multiplies: ((text)) = 1.21
    \\( \\) \\[ \\] \\\\  literal characters
An unclosed ``(`` or ``[`` applies its multiplier to the rest of the caption; a stray ``)`` or
``]`` is kept as text. Runs of equal weight are merged.

Tokens: each parsed piece is tokenized on its own (BOS/EOS dropped), the pieces are concatenated
and truncated to ``n_chunks * 75`` tokens, then wrapped BOS ... EOS PAD ...; every token carries
the weight of its piece, BOS/EOS/padding 1.0. The text encoder runs on the plain ids; its hidden
states (after clip_skip; SDXL: both encoders' penultimate states) are multiplied per token by the
weight. As sd-scripts' strategy code (train_network.py, train_db.py, fine_tune.py, sdxl_train.py)
there is no mean renormalisation afterwards (the older ``get_weighted_text_embeddings`` had one),
and SDXL's pooled output is not weighted.
"""
from __future__ import annotations

import re

# sd-scripts' / A1111's tokenizer for the attention syntax
_RE_ATTENTION = re.compile(r"""
\\\(|\\\)|\\\[|\\]|\\\\|\\|
\(|\[|
:([+-]?[.\d]+)\)|
\)|]|
[^\\()\[\]:]+|
:
""", re.X)

ROUND = 1.1
SQUARE = 1 / 1.1


def parse(text: str) -> list[tuple[str, float]]:
    """Caption -> [(text, weight), ...]; ``"a (b) c"`` -> [("a ", 1.0), ("b", 1.1), (" c", 1.0)]."""
    res: list[list] = []
    round_open: list[int] = []
    square_open: list[int] = []

    def multiply(start: int, m: float) -> None:
        for p in range(start, len(res)):
            res[p][1] *= m

    for m in _RE_ATTENTION.finditer(text):
        piece, weight = m.group(0), m.group(1)
        if piece.startswith("\\"):
            res.append([piece[1:], 1.0])
        elif piece == "(":
            round_open.append(len(res))
        elif piece == "[":
            square_open.append(len(res))
        elif weight is not None and round_open:
            multiply(round_open.pop(), float(weight))
        elif piece == ")" and round_open:
            multiply(round_open.pop(), ROUND)
        elif piece == "]" and square_open:
            multiply(square_open.pop(), SQUARE)
        else:
            res.append([piece, 1.0])
    for pos in round_open:
        multiply(pos, ROUND)
    for pos in square_open:
        multiply(pos, SQUARE)
    if not res:
        res = [["", 1.0]]
    merged = [res[0]]
    for piece, w in res[1:]:
        if w == merged[-1][1]:
            merged[-1][0] += piece
        else:
            merged.append([piece, w])
    return [(p, w) for p, w in merged]


def tokenize(tokenizer, captions: list[str], n_tokens: int):
    """-> (ids (B, n_tokens + 2) long, weights (B, n_tokens + 2) float32): BOS, the weighted
    caption's tokens truncated to ``n_tokens``, EOS, padding; weight 1.0 outside the caption."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when tokenize()
    # runs
    import torch

    all_ids, all_w = [], []
    for caption in captions:
        ids: list[int] = []
        ws: list[float] = []
        for piece, w in parse(caption):
            t = tokenizer(piece).input_ids[1:-1]
            ids += t
            ws += [w] * len(t)
        ids, ws = ids[:n_tokens], ws[:n_tokens]
        pad = n_tokens - len(ids)
        all_ids.append([tokenizer.bos_token_id] + ids + [tokenizer.eos_token_id] + [tokenizer.pad_token_id] * pad)
        all_w.append([1.0] + ws + [1.0] * (pad + 1))
    return torch.tensor(all_ids, dtype=torch.long), torch.tensor(all_w, dtype=torch.float32)


def apply(hidden, weights):
    """(B, T, D) hidden states x (B, T) per-token weights (in the hidden states' dtype)."""
    return hidden * weights.to(hidden.device, hidden.dtype).unsqueeze(-1)
