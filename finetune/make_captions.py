"""Caption a folder of images with BLIP (sd-scripts' finetune/make_captions.py, its flags).

    python finetune/make_captions.py IMAGE_DIR [--caption_weights Salesforce/blip-image-captioning-large]
        [--beam_search --num_beams 3] [--max_length 75 --min_length 5] [--caption_extension .txt]

--caption_weights is a transformers BLIP captioning model (a local folder or a hub id). sd-scripts
took a .pth of Salesforce's BLIP repository: its two published URLs (the kohya_ss GUI passes the
large one) are read as the hub conversions of the same weights; any other .pth is refused.
docs/DATASET_TOOLS.md#captioning.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library.dataset_tools import caption_cli, caption_models  # noqa: E402
from library.errors import UserError  # noqa: E402


def parser():
    p = caption_cli.parser("Caption images with BLIP (sd-scripts' make_captions.py).")
    p.add_argument("--caption_weights", default="Salesforce/blip-image-captioning-large",
                   help="a transformers BLIP captioning model: local folder or hub id (sd-scripts' "
                        "model_large_caption.pth URL is read as Salesforce/blip-image-captioning-large)")
    p.add_argument("--caption_extention", default=None,
                   help="sd-scripts' misspelt --caption_extension, kept for old command lines (it wins when given)")
    p.add_argument("--beam_search", action="store_true",
                   help="beam search with --num_beams beams (default: nucleus sampling with --top_p)")
    whole = caption_cli.whole
    p.add_argument("--num_beams", type=whole, default=1, help="beams of --beam_search")
    p.add_argument("--top_p", type=float, default=0.9, help="nucleus sampling's top_p (without --beam_search)")
    p.add_argument("--max_length", type=whole, default=75, help="longest caption in tokens, with the prompt's")
    p.add_argument("--min_length", type=whole, default=5, help="shortest caption in tokens, with the prompt's")
    p.add_argument("--seed", type=whole, default=42, help="seed of the sampling (set once, before the first image)")
    return p


def build(args) -> caption_models.BlipCaptioner:
    check_generation(args)
    source = caption_models.model_source(args.caption_weights, "--caption_weights")
    caption_models.check_kind(source, "--caption_weights", "BLIP captioning", ("blip",),
                              " (GIT: finetune/make_captions_by_git.py; others: finetune/make_captions_vlm.py)")
    loaded = caption_models.load(source, "--caption_weights", "BlipForConditionalGeneration",
                                 **caption_cli.placement_args(args))
    torch.manual_seed(args.seed)
    return caption_models.BlipCaptioner(loaded, beam_search=args.beam_search, num_beams=args.num_beams,
                                        top_p=args.top_p, max_length=args.max_length,
                                        min_length=args.min_length)


def check_generation(args) -> None:
    if args.num_beams < 1:
        raise UserError(f"--num_beams {args.num_beams}: must be >= 1")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top_p {args.top_p}: must be in (0, 1]")
    if args.min_length < 0 or args.max_length < 1:
        raise UserError(f"--min_length {args.min_length} / --max_length {args.max_length}: must be >= 0 / >= 1")
    if args.min_length > args.max_length:
        raise UserError(f"--min_length {args.min_length} is above --max_length {args.max_length}")


def main(argv=None) -> int:
    return caption_cli.main(parser(), build, argv)


if __name__ == "__main__":
    sys.exit(main())
