"""Family models: how each model family tokenizes, encodes text and calls its U-Net.

One class per family behind one interface, so the trainer never branches on the family:
    fm = family_model_for(bundle, max_token_length=None)
    ids = fm.tokenize(captions)                      # per tokenizer: (B, 77), or (B, n, 77) chunks
    cond = fm.encode(ids, clip_skip)                 # TextConditioning(hidden_states, pooled)
    pred = fm.unet_forward(noisy, t, cond, size_cond)
Text encoding follows sd-scripts exactly (clip_skip, SDXL's penultimate layers and pooled output).
(A run's ``family_model``; "adapter" is only the metadata's kind of trained file, ``method.adapter``.)

Long captions (``max_token_length`` 150 or 225, sd-scripts' semantics): the caption is tokenized
to max_token_length + 2 tokens, split into n = max_token_length / 75 chunks of 75 tokens, each
wrapped in BOS ... EOS (77 tokens; for a tokenizer that pads with another token than EOS, as
SD2's and SDXL's OpenCLIP one, a full chunk ends with EOS and an empty one starts BOS EOS PAD),
each chunk encoded on its own, and the states concatenated: the first chunk's BOS, each chunk's
75 token states, the last chunk's final state -> n * 75 + 2 states (152 / 227). SDXL's pooled
output is the first chunk's.

``no_token_padding`` (train_dreambooth on SD1/SD2, sd-scripts' train_db.py): training captions are
tokenized without padding (BOS, tokens, EOS, at most 77), so the U-Net cross-attends only to the
caption's own tokens. Captions of different lengths then cannot share a batch: batch 1 only, no
text-encoder cache, no max_token_length, not SDXL (sdxl_train.py has no such option), checked by
``check_token_padding`` before weights load. clip_skip applies as usual (sd-scripts' early return
in get_hidden_states skips it there, which we do not reproduce). Validation and sample prompts
are padded as usual (sd-scripts' sampling pads too).

Weighted captions (``weighted_captions``, library/models/prompt_weights.py): ``tokenize`` returns the ids
followed by one (B, n*75+2) float weight tensor per tokenizer (so every caller that moves the
tokens to the device and hands them to ``encode`` works unchanged), and ``encode`` multiplies each
token's hidden state by its weight (sd-scripts' ``encode_tokens_with_weights``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from library.errors import UserError
from library.models import prompt_weights
from library.models.families import registry

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

MAX_TOKENS = 77  # one CLIP window: BOS + 75 tokens + EOS
CHUNK = MAX_TOKENS - 2
MAX_TOKEN_LENGTHS = (75, 150, 225)  # max_token_length: tokens without BOS/EOS (None = 75)


class FamilyError(UserError, ValueError):
    """Wrong input for a model family (e.g. SDXL without size conditioning); one-line message."""


def chunk_count(max_token_length: int | None) -> int:
    """Number of 77-token windows a caption is encoded in: 1, 2 or 3."""
    if max_token_length is None:
        return 1
    if max_token_length not in MAX_TOKEN_LENGTHS:
        raise FamilyError(f"max_token_length: {max_token_length} is not one of: "
                          f"{', '.join(map(str, MAX_TOKEN_LENGTHS))}")
    return max_token_length // CHUNK


def chunk_ids(ids, tokenizer, n: int):
    """(B, n*75+2) token ids (BOS, tokens, EOS, padding) -> (B, n, 77) windows, sd-scripts'
    ``_get_input_ids``: each window is the first BOS, its 75 tokens and the sequence's last token.
    A tokenizer whose padding is not EOS (OpenCLIP's "!"): a window full of tokens gets EOS as its
    last token, and an empty window (BOS PAD ...) becomes BOS EOS PAD ..."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when chunk_ids()
    # runs
    import torch

    bos, last = ids[:, :1], ids[:, -1:]
    windows = []
    for i in range(n):
        w = torch.cat([bos, ids[:, 1 + i * CHUNK:1 + (i + 1) * CHUNK], last], dim=1)
        if tokenizer.pad_token_id != tokenizer.eos_token_id:
            eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
            w = w.clone()
            full = (w[:, -2] != eos) & (w[:, -2] != pad)
            w[full, -1] = eos
            w[w[:, 1] == pad, 1] = eos
        windows.append(w)
    return torch.stack(windows, dim=1)


def join_chunks(hidden, n: int):
    """(B*n, 77, D) states of the windows -> (B, n*75+2, D): the first window's BOS state, every
    window's 75 token states, the last window's final state (sd-scripts)."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when join_chunks()
    # runs
    import torch

    if n == 1:
        return hidden
    h = hidden.reshape(hidden.shape[0] // n, n * MAX_TOKENS, hidden.shape[-1])
    parts = [h[:, :1]] + [h[:, i:i + CHUNK] for i in range(1, n * MAX_TOKENS, MAX_TOKENS)] + [h[:, -1:]]
    return torch.cat(parts, dim=1)


@dataclass
class TextConditioning:
    hidden_states: Any  # (B, 77, D) U-Net cross-attention context; (B, n*75+2, D) for long captions
    pooled: Any = None  # (B, P) SDXL pooled text embedding, else None

    def to(self, *args, **kwargs) -> "TextConditioning":
        return TextConditioning(self.hidden_states.to(*args, **kwargs),
                                None if self.pooled is None else self.pooled.to(*args, **kwargs))


def _final_layer_norm(text_encoder):
    # transformers >= 5.6 flattened CLIPTextModel; CLIPTextModelWithProjection keeps `text_model`.
    return getattr(text_encoder, "text_model", text_encoder).final_layer_norm


class FamilyModel:
    family = ""
    conditioning_type = TextConditioning  # what encode returns (a text-encoder cache entry's fields)
    # The text encoders (indices) whose outputs a partial text-encoder cache holds while the others
    # train (FLUX.1 / SD3: T5, with encode_frozen_part and encode_with_frozen_part); () = none: the
    # SD families cache all of their outputs or none (sd-scripts' is_partial is FLUX.1 / SD3's)
    partial_cache_encoders: tuple[int, ...] = ()

    def __init__(self, unet, text_encoders: list, tokenizers: list, max_token_length: int | None = None,
                 weighted: bool = False, rewrite=None):
        self.unet = unet
        self.weighted = weighted
        self.text_encoders = list(text_encoders)
        self.tokenizers = list(tokenizers)
        self.n_chunks = chunk_count(max_token_length)
        self.max_token_length = max_token_length if self.n_chunks > 1 else None
        # str -> str applied to every text before tokenization (the method's prompt_rewrite():
        # a multi-vector new token -> its N token strings); None = the text as given
        self.rewrite = rewrite

    def tokenize(self, captions: list[str], pad: bool = True) -> list:
        """One LongTensor per tokenizer: (B, 77) BOS, tokens, EOS, padded, truncated to 77; with
        max_token_length 150/225 the (B, n, 77) windows of the caption truncated to n*75 tokens.
        ``pad=False`` (no_token_padding): one caption, (1, L) with L = its tokens + 2 <= 77."""
        n = self.n_chunks
        if self.rewrite is not None:
            captions = [self.rewrite(c) for c in captions]
        if not pad:
            if not registry.get(self.family).token_padding_option or n > 1 or len(captions) != 1:
                raise FamilyError("no_token_padding: one caption at a time, SD1/SD2, without "
                                  "max_token_length")
            return [tok(list(captions), padding=False, max_length=MAX_TOKENS, truncation=True,
                        return_tensors="pt").input_ids for tok in self.tokenizers]
        if self.weighted:
            pairs = [prompt_weights.tokenize(tok, list(captions), n * CHUNK) for tok in self.tokenizers]
            ids = [i if n == 1 else chunk_ids(i, tok, n) for (i, _), tok in zip(pairs, self.tokenizers)]
            return ids + [w for _, w in pairs]
        out = []
        for tok in self.tokenizers:
            ids = tok(list(captions), padding="max_length", max_length=n * CHUNK + 2, truncation=True,
                      return_tensors="pt").input_ids
            out.append(ids if n == 1 else chunk_ids(ids, tok, n))
        return out

    def _windows(self, ids):
        """Token ids as given by tokenize -> (B*n, 77) for the text encoder, and n."""
        if ids.dim() == 2:
            return ids, 1
        return ids.reshape(-1, ids.shape[-1]), ids.shape[1]

    def encode(self, token_ids: list, clip_skip: int | None) -> TextConditioning:
        raise NotImplementedError

    def _split_weights(self, token_ids: list) -> tuple[list, list | None]:
        """tokenize's output -> (ids per tokenizer, weights per tokenizer or None)."""
        k = len(self.tokenizers)
        if not self.weighted:
            return token_ids, None
        return list(token_ids[:k]), list(token_ids[k:])

    def unet_forward(self, noisy_latents, timesteps, cond: TextConditioning, size_cond=None,
                     sample_seeds=None):
        """The denoiser's prediction. ``sample_seeds``: a training batch's per-sample seeds for
        the forward's own draws (only SD3's pos_emb_random_crop_rate has any); None elsewhere."""
        return self.unet(noisy_latents, timesteps, cond.hidden_states.to(noisy_latents.dtype)).sample

    def cache_identity(self, partial: bool = False) -> dict:
        """What else changes this family's encodings, for the text-encoder cache key (the SD
        families': nothing beyond text_cache.encoder_identity's own parts); ``partial``: of a
        partial cache's part alone."""
        return {}

    def for_negative_prompts(self) -> "FamilyModel":
        """The family model that encodes samples' negative prompts: this one, except where the
        family encodes them differently (Lumina 2: without the system prompt)."""
        return self

    def drop_encoders(self, cond: TextConditioning, seeds: list[int]) -> TextConditioning:
        """A training batch's conditioning with per-sample text-encoder dropout (``seeds``: one
        per sample); only SD3 has one (clip_l / clip_g / t5_dropout_rate)."""
        return cond

    def _device(self, te):
        return next(te.parameters()).device


class SD1Model(FamilyModel):
    """SD1.x / SD2.x: one CLIP text encoder; clip_skip takes hidden_states[-clip_skip] through the
    final layer norm (sd-scripts); None or 1 is the plain last layer."""
    family = "sd1"

    def encode(self, token_ids: list, clip_skip: int | None) -> TextConditioning:
        te = self.text_encoders[0]
        token_ids, weights = self._split_weights(token_ids)
        ids, n = self._windows(token_ids[0].to(self._device(te)))
        if clip_skip is None or clip_skip <= 1:
            hidden = join_chunks(te(ids).last_hidden_state, n)
        else:
            if clip_skip > te.config.num_hidden_layers:
                raise FamilyError(f"clip_skip: {clip_skip} exceeds the text encoder's "
                                  f"{te.config.num_hidden_layers} layers")
            out = te(ids, output_hidden_states=True)
            hidden = join_chunks(_final_layer_norm(te)(out.hidden_states[-clip_skip]), n)
        if weights is not None:  # after clip_skip's final norm, as sd-scripts
            hidden = prompt_weights.apply(hidden, weights[0])
        return TextConditioning(hidden)


class SD2Model(SD1Model):
    family = "sd2"


class SDXLModel(FamilyModel):
    """SDXL: both encoders' penultimate hidden states (no final norm) concatenated; pooled output
    from text_encoder_2's projection; the U-Net also takes (B, 6) size conditioning.
    clip_skip does not apply (the penultimate layer is fixed by the architecture), as in sd-scripts."""
    family = "sdxl"

    def encode(self, token_ids: list, clip_skip: int | None) -> TextConditioning:
        # lazy: the dry run's plan loads this module before torch; torch is imported when encode()
        # runs
        import torch

        te1, te2 = self.text_encoders
        token_ids, weights = self._split_weights(token_ids)
        ids1, n = self._windows(token_ids[0].to(self._device(te1)))
        ids2, _ = self._windows(token_ids[1].to(self._device(te2)))
        out1 = te1(ids1, output_hidden_states=True)
        out2 = te2(ids2, output_hidden_states=True)
        h1 = join_chunks(out1.hidden_states[-2], n)
        h2 = join_chunks(out2.hidden_states[-2].to(h1.dtype), n)
        if weights is not None:  # each encoder's states by its own tokenizer's weights; pooled unweighted
            h1, h2 = prompt_weights.apply(h1, weights[0]), prompt_weights.apply(h2, weights[1])
        hidden = torch.cat([h1, h2], dim=-1)
        # long captions: the pooled output of each caption's first window (sd-scripts pool2[::n])
        return TextConditioning(hidden, out2.text_embeds[::n])

    def unet_forward(self, noisy_latents, timesteps, cond: TextConditioning, size_cond=None,
                     sample_seeds=None):
        if size_cond is None:
            raise FamilyError("SDXL needs size conditioning (original size, crop top-left, target size)")
        if cond.pooled is None:
            raise FamilyError("SDXL needs the pooled text embedding of text_encoder_2")
        if tuple(size_cond.shape) != (noisy_latents.shape[0], 6):
            raise FamilyError(f"size_cond must have shape ({noisy_latents.shape[0]}, 6), got {tuple(size_cond.shape)}")
        dtype = noisy_latents.dtype
        added = {"text_embeds": cond.pooled.to(dtype), "time_ids": size_cond.to(noisy_latents.device, dtype)}
        return self.unet(noisy_latents, timesteps, cond.hidden_states.to(dtype), added_cond_kwargs=added).sample


def check_token_padding(opts: Options, family_before_loading) -> None:
    """no_token_padding's combinations, before any weight loads (``family_before_loading``: the
    model's family from its configuration, or None when only the weights tell)."""
    if not opts.no_token_padding:
        return
    if opts.train_batch_size != 1:
        raise FamilyError(f"no_token_padding needs train_batch_size = 1 (got {opts.train_batch_size}): "
                          "unpadded captions of different lengths cannot share a batch")
    if opts.cache_text_encoder_outputs or opts.cache_text_encoder_outputs_to_disk:
        raise FamilyError("no_token_padding cannot be combined with cache_text_encoder_outputs: "
                          "the cache holds padded 77-token outputs")
    if opts.max_token_length is not None:
        raise FamilyError("no_token_padding cannot be combined with max_token_length: long captions "
                          "are encoded as padded 75-token windows")
    if opts.weighted_captions:
        raise FamilyError("no_token_padding cannot be combined with weighted_captions: weighted "
                          "captions are tokenized padded, with one weight per position")
    family = family_before_loading(opts.pretrained_model_name_or_path)
    if family is not None and not registry.get(family).token_padding_option:
        raise FamilyError(f"no_token_padding is for SD1/SD2 (sd-scripts' train_db.py); {registry.get(family).title} "
                          f"({registry.get(family).gui_script}) has no such option")


_MODELS = {"sd1": SD1Model, "sd2": SD2Model, "sdxl": SDXLModel}


def family_model_for(bundle, max_token_length: int | None = None, weighted: bool = False,
                     rewrite=None) -> FamilyModel:
    """The family model of a ModelBundle (anything with family, unet, text_encoders, tokenizers);
    ``max_token_length`` (None/75, 150, 225) sets how long captions are tokenized and encoded;
    ``weighted``: captions carry A1111-style prompt weights (weighted_captions); ``rewrite``:
    str -> str applied to every text first (a method's ``prompt_rewrite()``), or None."""
    try:
        cls = _MODELS[bundle.family]
    except KeyError:
        raise FamilyError(f"unknown model family {bundle.family!r}; expected one of {sorted(_MODELS)}") from None
    return cls(bundle.unet, bundle.text_encoders, bundle.tokenizers, max_token_length, weighted,
               rewrite)
