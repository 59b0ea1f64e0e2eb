"""New tokens and their embeddings: textual inversion (train_textual_inversion.py) and pivotal
tuning (train_lora.py with pivotal_tokens).

How the frozen rows stay frozen: neither a gradient mask nor a restore after each step. Each
text encoder's token embedding is replaced by ``TokenEmbedding``, which keeps the loaded matrix
as its frozen ``weight`` (the same tensor, requires_grad False, never in an optimizer) and holds
only the new rows as the trained parameter ``new``. Ids below the loaded vocabulary size read the
frozen matrix, the new ids read ``new``; so optimizer state, weight decay and gradient clipping
see only the new rows, and every other row is bit-identical by construction.

Files, in the formats the clients read (A1111, ComfyUI, diffusers' load_textual_inversion):
SD1/SD2 ``{"emb_params": [n, width]}``, SDXL ``{"clip_l": [n, 768], "clip_g": [n, 1280]}``.
Bundled in a LoRA file (A1111's extensions-builtin/Lora/networks.py): ``bundle_emb.<token>.
string_to_param.*`` (SD1/SD2), ``bundle_emb.<token>.clip_l`` / ``.clip_g`` (SDXL).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from library.errors import UserError

# sd-scripts' train_textual_inversion.py template captions ({} = the token)
OBJECT_TEMPLATES = (
    "a photo of a {}", "a rendering of a {}", "a cropped photo of the {}", "the photo of a {}",
    "a photo of a clean {}", "a photo of a dirty {}", "a dark photo of the {}", "a photo of my {}",
    "a photo of the cool {}", "a close-up photo of a {}", "a bright photo of the {}",
    "a cropped photo of a {}", "a photo of the {}", "a good photo of the {}", "a photo of one {}",
    "a close-up photo of the {}", "a rendition of the {}", "a photo of the clean {}",
    "a rendition of a {}", "a photo of a nice {}", "a good photo of a {}", "a photo of the nice {}",
    "a photo of the small {}", "a photo of the weird {}", "a photo of the large {}",
    "a photo of a cool {}", "a photo of a small {}",
)
STYLE_TEMPLATES = (
    "a painting in the style of {}", "a rendering in the style of {}",
    "a cropped painting in the style of {}", "the painting in the style of {}",
    "a clean painting in the style of {}", "a dirty painting in the style of {}",
    "a dark painting in the style of {}", "a picture in the style of {}",
    "a cool painting in the style of {}", "a close-up painting in the style of {}",
    "a bright painting in the style of {}", "a cropped painting in the style of {}",
    "a good painting in the style of {}", "a close-up painting in the style of {}",
    "a rendition in the style of {}", "a nice painting in the style of {}",
    "a small painting in the style of {}", "a weird painting in the style of {}",
    "a large painting in the style of {}",
)

# the file keys per text encoder, in the bundle's order
SDXL_KEYS = ("clip_l", "clip_g")
SD_KEY = "emb_params"


class EmbeddingError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class TokenSpec:
    """One new token: the string in captions, its initial word, its vector count."""
    token: str
    init_word: str | None
    num_vectors: int

    def strings(self) -> list[str]:
        """sd-scripts' names of the added tokens: tok, tok1, tok2, ..."""
        return [self.token] + [f"{self.token}{i}" for i in range(1, self.num_vectors)]


_TOKEN_RE = re.compile(r"^[A-Za-z0-9_\-]+$")


def check_specs(specs: list[TokenSpec], option: str) -> None:
    """Before loading: the tokens are usable as file-name parts and A1111 bundle names, distinct,
    and none is another's generated name (tok vs tok1)."""
    seen = set()
    for s in specs:
        if not _TOKEN_RE.match(s.token):
            raise EmbeddingError(f"{option} {s.token!r}: use letters, digits, '_' or '-' only (it "
                                 "names the embedding file and A1111's bundle_emb key)")
        for t in s.strings():
            if t in seen:
                raise EmbeddingError(f"{option}: the token {t!r} is given twice (a token with N "
                                     "vectors also uses <token>1 ... <token><N-1>)")
            seen.add(t)


def prompt_rewriter(specs: list[TokenSpec]):
    """str -> str replacing each multi-vector token (a whole word) by its N token strings, as
    sd-scripts' caption and prompt replacement; None when every token has one vector. Applied at
    tokenization, after caption shuffling and tag dropout, so the token is one tag there."""
    multi = [s for s in specs if s.num_vectors > 1]
    if not multi:
        return None
    pats = [(re.compile(rf"(?<![\w]){re.escape(s.token)}(?![\w])"), " ".join(s.strings())) for s in multi]

    def rewrite(text: str) -> str:
        for pat, rep in pats:
            text = pat.sub(rep, text)
        return text

    return rewrite


class TokenEmbedding(torch.nn.Module):
    """A CLIP token embedding with trained rows appended: ids < ``n_base`` read the frozen loaded
    matrix ``weight``, the others the trained ``new`` (see the module doc)."""

    def __init__(self, base: torch.nn.Embedding, new_rows: torch.Tensor):
        super().__init__()
        self.weight = base.weight  # the loaded Parameter itself, frozen
        self.weight.requires_grad_(False)
        self.n_base = int(base.weight.shape[0])
        self.embedding_dim = int(base.weight.shape[1])
        self.new = torch.nn.Parameter(new_rows)

    @property
    def num_embeddings(self) -> int:
        return self.n_base + int(self.new.shape[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = self.n_base
        old = F.embedding(ids.clamp(max=n - 1), self.weight)
        new = F.embedding((ids - n).clamp(min=0), self.new).to(old.dtype)
        return torch.where((ids >= n).unsqueeze(-1), new, old)

    def full_rows(self) -> torch.Tensor:
        """(n_base + n_new, width): what the matrix of a resized nn.Embedding would hold."""
        return torch.cat([self.weight.detach(), self.new.detach().to(self.weight.dtype)])


def _embedding_owner(text_encoder) -> tuple[torch.nn.Module, str, torch.nn.Module]:
    emb = text_encoder.get_input_embeddings()
    for name, m in text_encoder.named_modules():
        for child_name, child in m.named_children():
            if child is emb:
                return m, child_name, emb
    raise EmbeddingError(f"{type(text_encoder).__name__}: its token embedding was not found")


class NewTokens:
    """The new tokens of a run in every tokenizer / text encoder of a bundle.

    ``install`` adds the token strings to each tokenizer (after its vocabulary: ids n_base ...),
    replaces each text encoder's token embedding by a ``TokenEmbedding`` and sets the new rows'
    initial values; ``rows(k, spec)`` is the trained (n, width) block of one token in encoder k.
    """

    def __init__(self, specs: list[TokenSpec], option: str):
        self.specs = list(specs)
        self.option = option
        self.modules: list[TokenEmbedding] = []
        self.offsets: dict[str, int] = {}

    def install(self, tokenizers: list, text_encoders: list, seed: int, dtype: torch.dtype) -> None:
        strings = [t for s in self.specs for t in s.strings()]
        off = 0
        for s in self.specs:
            self.offsets[s.token] = off
            off += s.num_vectors
        for k, (tok, te) in enumerate(zip(tokenizers, text_encoders)):
            owner, name, base = _embedding_owner(te)
            if isinstance(base, TokenEmbedding):
                raise EmbeddingError(f"{self.option}: the text encoder already has new tokens")
            n_base = int(base.weight.shape[0])
            if len(tok) != n_base:
                raise EmbeddingError(f"tokenizer {k + 1} has {len(tok)} tokens but its text encoder "
                                     f"{n_base} embedding rows: new tokens cannot be appended")
            vocab = tok.get_vocab()
            for t in strings:
                if t in vocab:  # as sd-scripts and diffusers (a BPE word "t</w>" does not clash)
                    raise EmbeddingError(f"{self.option} {t!r}: the tokenizer already has this "
                                         "token; choose another string")
            added = tok.add_tokens(strings)
            ids = tok.convert_tokens_to_ids(strings)
            if added != len(strings) or ids != list(range(n_base, n_base + len(strings))):
                raise EmbeddingError(f"{self.option}: tokenizer {k + 1} did not add "
                                     f"{', '.join(strings)} as new tokens")
            for s in self.specs:  # the caption's word must come out as exactly that token
                got = tok(s.token, add_special_tokens=False).input_ids
                if got != [ids[strings.index(s.token)]]:
                    raise EmbeddingError(f"{self.option} {s.token!r}: tokenizer {k + 1} does not keep "
                                         "it as one token (CLIP lowercases: use lowercase)")
            rows = self._initial_rows(tok, base.weight.detach(), seed, k)
            module = TokenEmbedding(base, rows.to(base.weight.device, dtype))
            setattr(owner, name, module)
            self.modules.append(module)

    def _initial_rows(self, tok, matrix: torch.Tensor, seed: int, k: int) -> torch.Tensor:
        out = []
        m = matrix.float()
        for i, s in enumerate(self.specs):
            if s.init_word:
                init = tok(s.init_word, add_special_tokens=False).input_ids
                if not init:
                    raise EmbeddingError(f"init word {s.init_word!r} of {s.token!r} gives no token")
                # sd-scripts: the init tokens cycled (or cut) to the vector count
                out.append(torch.stack([m[init[j % len(init)]] for j in range(s.num_vectors)]))
            else:
                g = torch.Generator().manual_seed(seed * 1000 + 10 * i + k)
                noise = torch.randn((s.num_vectors, m.shape[1]), generator=g)
                out.append(m.mean(0) + noise * m.std(0))
        return torch.cat(out)

    def parameters(self) -> list:
        return [m.new for m in self.modules]

    def rows(self, k: int, spec: TokenSpec) -> torch.Tensor:
        o = self.offsets[spec.token]
        return self.modules[k].new[o:o + spec.num_vectors]

    def load_rows(self, spec: TokenSpec, tensors: list[torch.Tensor], source: str) -> None:
        """Set one token's rows in every encoder from a file's tensors (``weights``)."""
        with torch.no_grad():
            for k, t in enumerate(tensors):
                dst = self.rows(k, spec)
                if tuple(t.shape) != tuple(dst.shape):
                    raise EmbeddingError(f"weights {source}: {tuple(t.shape)} vectors for text encoder "
                                         f"{k + 1}, this run needs {tuple(dst.shape)} "
                                         "(num_vectors_per_token x width)")
                dst.copy_(t.to(dst.dtype))

    def file_tensors(self, spec: TokenSpec, family: str) -> dict[str, torch.Tensor]:
        """One token's embedding file content (detached CPU float tensors)."""
        rows = [self.rows(k, spec).detach().float().cpu().contiguous() for k in range(len(self.modules))]
        if family == "sdxl":
            return dict(zip(SDXL_KEYS, rows))
        return {SD_KEY: rows[0]}


def bundle_keys(token: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An embedding's tensors under A1111's bundled-embedding keys in a LoRA file."""
    if SD_KEY in tensors:
        return {f"bundle_emb.{token}.string_to_param.*": tensors[SD_KEY]}
    return {f"bundle_emb.{token}.{k}": v for k, v in tensors.items()}


def read_embedding_file(path: str, family: str) -> list[torch.Tensor]:
    """The vectors of an embedding file, one (n, width) tensor per text encoder of ``family``:
    ours / sd-scripts' (emb_params; clip_l, clip_g), an A1111 .pt (string_to_param) or a
    diffusers one-key file."""
    if not os.path.isfile(path):
        raise EmbeddingError(f"weights {path}: file not found")
    try:
        if path.lower().endswith(".safetensors"):
            # lazy: imported in a try: read_embedding_file() answers its absence or failure
            from safetensors.torch import load_file

            data = load_file(path)
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file
        raise EmbeddingError(f"weights {path}: cannot read it ({type(e).__name__})") from None
    if isinstance(data, dict) and "string_to_param" in data:
        data = dict(data["string_to_param"])
    if not isinstance(data, dict):
        raise EmbeddingError(f"weights {path}: not an embedding file (no tensor dictionary)")
    if family == "sdxl":
        missing = [k for k in SDXL_KEYS if k not in data]
        if missing:
            raise EmbeddingError(f"weights {path}: an SDXL embedding needs clip_l and clip_g "
                                 f"(missing {', '.join(missing)})")
        return [_2d(data[k], path) for k in SDXL_KEYS]
    if SD_KEY in data:
        return [_2d(data[SD_KEY], path)]
    tensors = [v for v in data.values() if isinstance(v, torch.Tensor)]
    if len(tensors) != 1:
        raise EmbeddingError(f"weights {path}: expected emb_params (SD1/SD2) or one tensor, found "
                             f"keys {', '.join(map(str, data))}")
    return [_2d(tensors[0], path)]


def _2d(t, path: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() not in (1, 2):
        raise EmbeddingError(f"weights {path}: the embedding is not a (vectors, width) tensor")
    return (t.unsqueeze(0) if t.dim() == 1 else t).float()


