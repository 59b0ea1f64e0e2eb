"""Caption a folder of images with today's captioners: Florence-2 (a caption task) or an
image-text-to-text chat model (Qwen2.5-VL, Qwen3-VL, JoyCaption's LLaVA, Gemma 3, ...) with a prompt.

    python finetune/make_captions_vlm.py IMAGE_DIR --model florence-community/Florence-2-large
        [--task "<DETAILED_CAPTION>"]
    python finetune/make_captions_vlm.py IMAGE_DIR --model Qwen/Qwen2.5-VL-7B-Instruct
        [--prompt "Describe this image in one sentence."] [--system_prompt ...] [--temperature 0.6]

Not an sd-scripts script (sd-scripts has no such captioner); its common flags are the other
captioning scripts'. docs/DATASET_TOOLS.md#captioning.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library.dataset_tools import caption_cli, caption_models  # noqa: E402
from library.errors import UserError  # noqa: E402

DEFAULT_PROMPT = "Write a descriptive caption for this image."


def parser():
    p = caption_cli.parser("Caption images with Florence-2 or a chat VLM (transformers).",
                           caption_extension=".txt")
    p.add_argument("--model", required=True,
                   help="a transformers image-text-to-text model: local folder or hub id")
    p.add_argument("--task", default=None, choices=caption_models.FLORENCE_TASKS,
                   help="Florence-2's caption task (default <CAPTION>)")
    p.add_argument("--prompt", default=None, help=f"a chat model's instruction (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--system_prompt", default=None, help="a chat model's system message (default: none)")
    p.add_argument("--max_new_tokens", type=caption_cli.whole, default=512, help="longest reply in tokens")
    p.add_argument("--num_beams", type=caption_cli.whole, default=None,
                   help="beam search with this many beams (default: 3 for Florence-2, 1 for a chat model)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0: greedy or beam search)")
    p.add_argument("--top_p", type=float, default=0.9, help="nucleus sampling's top_p (with --temperature)")
    p.add_argument("--seed", type=caption_cli.whole, default=42,
                   help="seed of the sampling (set once, before the first image)")
    return p


def check_generation(args) -> None:
    if args.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens {args.max_new_tokens}: must be >= 1")
    if args.num_beams is not None and args.num_beams < 1:
        raise UserError(f"--num_beams {args.num_beams}: must be >= 1")
    if args.temperature < 0:
        raise UserError(f"--temperature {args.temperature}: must be >= 0")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top_p {args.top_p}: must be in (0, 1]")


def build(args):
    check_generation(args)
    source = caption_models.model_source(args.model, "--model")
    florence = caption_models.is_florence(source, "--model")
    wrong = ["--task"] if args.task is not None and not florence else \
        [f"--{f}" for f in ("prompt", "system_prompt") if florence and getattr(args, f) is not None]
    if wrong:
        takes = "a caption --task, not a prompt" if florence else "a --prompt, not a Florence-2 --task"
        raise UserError(f"{wrong[0]}: {args.model} is {'Florence-2' if florence else 'a chat model'}: it takes {takes}")
    loaded = caption_models.load_vlm(source, "--model", florence, **caption_cli.placement_args(args))
    sampling = caption_models.Sampling(max_new_tokens=args.max_new_tokens,
                                       num_beams=args.num_beams or (3 if florence else 1),
                                       temperature=args.temperature, top_p=args.top_p)
    torch.manual_seed(args.seed)
    if florence:
        return caption_models.FlorenceCaptioner(loaded, task=args.task or "<CAPTION>", sampling=sampling)
    return caption_models.ChatCaptioner(loaded, prompt=args.prompt or DEFAULT_PROMPT,
                                        system=args.system_prompt, sampling=sampling)


def main(argv=None) -> int:
    return caption_cli.main(parser(), build, argv)


if __name__ == "__main__":
    sys.exit(main())
