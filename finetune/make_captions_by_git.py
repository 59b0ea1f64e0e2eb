"""Caption a folder of images with GIT (sd-scripts' finetune/make_captions_by_git.py, its flags).

    python finetune/make_captions_by_git.py IMAGE_DIR [--model_id microsoft/git-large-textcaps]
        [--max_length 50] [--remove_words] [--caption_extension .txt]

docs/DATASET_TOOLS.md#captioning.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.dataset_tools import caption_cli, caption_models  # noqa: E402
from library.errors import UserError  # noqa: E402


def parser():
    p = caption_cli.parser("Caption images with GIT (sd-scripts' make_captions_by_git.py).")
    p.add_argument("--model_id", default="microsoft/git-large-textcaps",
                   help="a transformers GIT model: local folder or hub id")
    p.add_argument("--max_length", type=caption_cli.whole, default=50, help="longest caption in tokens")
    p.add_argument("--remove_words", action="store_true",
                   help="remove phrases such as 'with the words xxx' and 'that says xxx' (text GIT reads or invents)")
    return p


def build(args) -> caption_models.GitCaptioner:
    if args.max_length < 1:
        raise UserError(f"--max_length {args.max_length}: must be >= 1")
    source = caption_models.model_source(args.model_id, "--model_id")
    caption_models.check_kind(source, "--model_id", "GIT", ("git",),
                              " (BLIP: finetune/make_captions.py; others: finetune/make_captions_vlm.py)")
    loaded = caption_models.load(source, "--model_id", "AutoModelForCausalLM", **caption_cli.placement_args(args))
    return caption_models.GitCaptioner(loaded, max_length=args.max_length, remove_words=args.remove_words)


def main(argv=None) -> int:
    return caption_cli.main(parser(), build, argv)


if __name__ == "__main__":
    sys.exit(main())
