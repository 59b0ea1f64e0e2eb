"""SD3 text conditioning (library/models/families/sd3/sd3_text.py) against the encoders called directly and the
layout sd-scripts' strategy_sd3 builds (CLIP-L | CLIP-G | zero padding, then T5 tokens; pooled
CLIP-L | CLIP-G), with a small stand-in for T5."""
from __future__ import annotations

import pytest
import torch

from library.models.families.sd3 import sd3_builtins, sd3_text

CAPTIONS = ["a photo of a sks dog", "red cat"]
T5_LEN = 12
WIDTH = 128  # the tiny MMDiT's context width


class T5StandIn(torch.nn.Module):
    """Token embeddings as 'T5 states'; remembers the mask it was given."""

    def __init__(self, vocab: int):
        super().__init__()
        torch.manual_seed(5)
        self.emb = torch.nn.Embedding(vocab, WIDTH)
        self.masks = []

    def forward(self, ids, mask):
        self.masks.append(mask)
        return (self.emb(ids),)  # a tuple, as transformers' return_dict=False


@pytest.fixture(scope="module")
def parts():
    return sd3_builtins.build_builtin("tiny-sd3")


def _tokens(parts, captions=CAPTIONS, t5=True):
    return sd3_text.tokenize(captions, parts["tokenizer_l"], parts["tokenizer_g"],
                             parts["tokenizer_l"] if t5 else None, t5_max_length=T5_LEN)


def _direct(model, ids, mask=None):
    with torch.no_grad():
        out = model(ids, mask, output_hidden_states=True)
    return out.hidden_states[-2], out.text_embeds


def test_context_and_pooled_layout(parts):
    tokens = _tokens(parts)
    assert tokens.l_ids.shape == tokens.g_ids.shape == (2, 77) and tokens.t5_ids.shape == (2, T5_LEN)
    # CLIP-L pads with its end token, CLIP-G with id 0 ("!"), as sd-scripts' tokenizers
    assert tokens.l_ids[1, -1] == parts["tokenizer_l"].eos_token_id and tokens.g_ids[1, -1] == 0
    t5 = T5StandIn(len(parts["tokenizer_l"]))
    with torch.no_grad():
        enc = sd3_text.encode(tokens, parts["clip_l"], parts["clip_g"], t5)
        ctx, pooled = sd3_text.condition(enc, WIDTH)
    l_states, l_pooled = _direct(parts["clip_l"], tokens.l_ids)
    g_states, g_pooled = _direct(parts["clip_g"], tokens.g_ids)
    assert ctx.shape == (2, 77 + T5_LEN, WIDTH) and pooled.shape == (2, 32 + 64)
    assert torch.equal(ctx[:, :77, :32], l_states) and torch.equal(ctx[:, :77, 32:96], g_states)
    assert torch.count_nonzero(ctx[:, :77, 96:]) == 0
    assert torch.equal(ctx[:, 77:], t5.emb(tokens.t5_ids).detach())
    assert torch.equal(pooled, torch.cat([l_pooled, g_pooled], dim=-1))
    assert t5.masks == [None]  # apply_t5_attn_mask off
    # the tiny MMDiT takes them as they are
    mmdit = parts["mmdit"]
    with torch.no_grad():
        out = mmdit(torch.randn(2, 16, 4, 4), torch.tensor([10.0, 900.0]), pooled, ctx)
    assert out.shape == (2, 16, 4, 4)


def test_without_t5_77_zero_tokens(parts):
    with torch.no_grad():
        enc = sd3_text.encode(_tokens(parts, t5=False), parts["clip_l"], parts["clip_g"], None)
        ctx, _ = sd3_text.condition(enc, WIDTH)
    assert enc.t5_out is None and ctx.shape == (2, 154, WIDTH)
    assert torch.count_nonzero(ctx[:, 77:]) == 0
    with pytest.raises(ValueError, match="T5 states are 7 wide"):
        sd3_text.condition(sd3_text.SD3TextEncoding(enc.lg_out, enc.lg_pooled, 32, torch.zeros(2, 3, 7)), WIDTH)


def test_attention_masks_go_to_the_encoders(parts):
    tokens = _tokens(parts)
    t5 = T5StandIn(len(parts["tokenizer_l"]))
    with torch.no_grad():
        masked = sd3_text.encode(tokens, parts["clip_l"], parts["clip_g"], t5, apply_lg_attn_mask=True,
                                 apply_t5_attn_mask=True)
        plain = sd3_text.encode(tokens, parts["clip_l"], parts["clip_g"], t5)
    l_states, _ = _direct(parts["clip_l"], tokens.l_ids, tokens.l_mask)
    g_states, _ = _direct(parts["clip_g"], tokens.g_ids, tokens.g_mask)
    assert torch.equal(masked.lg_out, torch.cat([l_states, g_states], dim=-1))
    assert torch.equal(t5.masks[0], tokens.t5_mask) and t5.masks[1] is None
    # CLIP is causal: real tokens never see the padding after them; only the padding's states change
    real = tokens.l_mask[1].bool()
    assert torch.allclose(masked.lg_out[1, real], plain.lg_out[1, real], atol=1e-6)
    assert not torch.allclose(masked.lg_out[1, ~real], plain.lg_out[1, ~real], atol=1e-3)


def test_drop_one_encoder_zeros_or_empty_caption(parts):
    t5 = T5StandIn(len(parts["tokenizer_l"]))
    with torch.no_grad():
        enc = sd3_text.encode(_tokens(parts), parts["clip_l"], parts["clip_g"], t5)
        empty = sd3_text.encode(_tokens(parts, [""]), parts["clip_l"], parts["clip_g"], t5)
    dropped = sd3_text.drop_encoder(enc, "clip_l", [1])
    assert torch.count_nonzero(dropped.lg_out[1, :, :32]) == 0 and torch.count_nonzero(dropped.lg_pooled[1, :32]) == 0
    assert torch.count_nonzero(dropped.l_mask[1]) == 0
    assert torch.equal(dropped.lg_out[1, :, 32:], enc.lg_out[1, :, 32:])  # CLIP-G kept
    assert torch.equal(dropped.lg_out[0], enc.lg_out[0]) and torch.equal(dropped.l_mask[0], enc.l_mask[0])
    assert torch.count_nonzero(enc.lg_out[1, :, :32]) > 0  # the input is not changed

    g = sd3_text.drop_encoder(enc, "clip_g", torch.tensor([True, False]), empty=empty)
    assert torch.equal(g.lg_out[0, :, 32:], empty.lg_out[0, :, 32:]) and torch.equal(g.lg_pooled[0, 32:], empty.lg_pooled[0, 32:])
    assert torch.equal(g.lg_out[0, :, :32], enc.lg_out[0, :, :32]) and torch.equal(g.g_mask[0], empty.g_mask[0])
    assert torch.equal(g.lg_out[1], enc.lg_out[1])

    t = sd3_text.drop_encoder(enc, "t5", [0, 1])
    assert torch.count_nonzero(t.t5_out) == 0 and torch.count_nonzero(t.t5_mask) == 0
    assert torch.equal(t.lg_out, enc.lg_out)
    with pytest.raises(ValueError, match="which"):
        sd3_text.drop_encoder(enc, "clip_x", [0])


def test_matches_diffusers_sd3_pipeline_encode_prompt(tmp_path):
    # diffusers' StableDiffusion3Pipeline, loaded from our diffusers-layout save of tiny-sd3, builds
    # the same context and pooled vector (no T5: 77 zero tokens of the context width)
    from diffusers import StableDiffusion3Pipeline

    from library.models.families.sd3 import sd3_checkpoint

    model = sd3_checkpoint.load_sd3("tiny-sd3")
    model.layout = sd3_checkpoint.LAYOUT_DIFFUSERS
    sd3_checkpoint.save_sd3(model, str(tmp_path / "pipe"))
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "pipe"), text_encoder_3=None, tokenizer_3=None,
                                                    local_files_only=True)
    with torch.no_grad():
        # (diffusers pads with max_sequence_length zero tokens, 256 by default; sd-scripts with 77)
        ref_ctx, _, ref_pooled, _ = pipe.encode_prompt(CAPTIONS, CAPTIONS, CAPTIONS, do_classifier_free_guidance=False,
                                                       max_sequence_length=77)
        tokens = sd3_text.tokenize(CAPTIONS, model.tokenizer_l, model.tokenizer_g)
        ctx, pooled = sd3_text.condition(sd3_text.encode(tokens, model.clip_l, model.clip_g), WIDTH)
    assert ctx.shape == ref_ctx.shape == (2, 154, WIDTH)
    assert torch.allclose(ctx, ref_ctx, atol=1e-6) and torch.allclose(pooled, ref_pooled, atol=1e-6)
