"""The built-in ``tiny-lumina``: the Next-DiT of nextdit.TINY (1 refiner block each, 2 joint
blocks, hidden 64, 4 query / 2 key-value heads, RoPE axes 4/6/6), a tiny Gemma-2 (width 32, 3
layers, offline tokenizer; text.build_tiny_gemma2) and FLUX.1's tiny 16-channel autoencoder. Every
part comes from a fixed seed, so two builds are bit-identical; the zero-initialised projections of
the real model are random here, so that every path carries signal."""
from __future__ import annotations

import torch

from library.models.families.flux import flux_ae
from library.models.families.lumina import nextdit, text

TINY_NAMES = ("tiny-lumina",)
SEED = 20250204


def build_tiny_lumina() -> dict:
    """transformer, gemma2, tokenizer, ae."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = nextdit.NextDiT(nextdit.TINY).eval()
    gemma2, tok = text.build_tiny_gemma2(nextdit.TINY.cap_feat_dim)
    return {"transformer": transformer, "gemma2": gemma2, "tokenizer": tok,
            "ae": flux_ae.build_ae(flux_ae.TINY_AE_CONFIG, seed=SEED + 1)}
