"""Regenerate the shipped CLIP tokenizer files (configs/tokenizers/clip/) from CLIP's BPE merges.

CLIP's vocabulary is not a separate download: it is derived from the BPE merge list that CLIP
ships (`bpe_simple_vocab_16e6.txt.gz`, also carried by the `open_clip_torch` wheel on PyPI)
exactly as CLIP's SimpleTokenizer builds it: 256 byte symbols, the same with '</w>', one token
per merge for the first 49152-256-2 merges, then <|startoftext|> and <|endoftext|> (49408 ids).

Usage:
    pip download open_clip_torch --no-deps -d /tmp/oc
    python tools/build_clip_tokenizer.py --source /tmp/oc/open_clip_torch-*.whl
(--source may also be the .txt.gz itself.)
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.models.families.sd_common.tiny_models import _bytes_to_unicode

BPE_MEMBER = "open_clip/bpe_simple_vocab_16e6.txt.gz"
# The sentence and ids the result must reproduce (CLIP ViT-L/14 tokenizer).
CHECK_TEXT = "a photo of a cat"
CHECK_IDS = [49406, 320, 1125, 539, 320, 2368, 49407]


def read_merges(source: str) -> list[str]:
    if source.endswith(".whl"):
        with zipfile.ZipFile(source) as zf:
            raw = zf.read(BPE_MEMBER)
    else:
        with open(source, "rb") as f:
            raw = f.read()
    lines = gzip.decompress(raw).decode("utf-8").split("\n")
    # Line 0 is a version header; CLIP uses exactly the next 49152-256-2 merges.
    return lines[1:49152 - 256 - 2 + 1]


def build_vocab(merges: list[str]) -> dict[str, int]:
    symbols = list(_bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols]
    vocab += ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab)}


def write_files(out_dir: str, merges: list[str]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(build_vocab(merges), f, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
               "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(special, model_max_length=77, tokenizer_class="CLIPTokenizer"), f, indent=1)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(special, f, indent=1)


def check(out_dir: str) -> None:
    # lazy: --help loads this module before torch; transformers is imported when check() runs
    from transformers import CLIPTokenizer

    ids = CLIPTokenizer.from_pretrained(out_dir)(CHECK_TEXT).input_ids
    if ids != CHECK_IDS:
        raise SystemExit(f"check failed: {CHECK_TEXT!r} -> {ids}, expected {CHECK_IDS}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True, help="open_clip_torch wheel or bpe_simple_vocab_16e6.txt.gz")
    ap.add_argument("--out", default=os.path.join(ROOT, "configs", "tokenizers", "clip"))
    args = ap.parse_args()
    write_files(args.out, read_merges(args.source))
    check(args.out)
    print(f"wrote {args.out} (checked: {CHECK_TEXT!r} -> {CHECK_IDS})")


if __name__ == "__main__":
    main()
