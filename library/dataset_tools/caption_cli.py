"""What the captioning scripts share (finetune/make_captions.py, make_captions_by_git.py,
make_captions_vlm.py): their common flags (sd-scripts' names, and ours for what sd-scripts lacks),
the job they make, and the main that runs it with a progress bar and answers a user error in one
line (exit 2)."""
from __future__ import annotations

import argparse
from collections.abc import Callable

from tqdm.auto import tqdm

from library.dataset_tools import captioning
from library.errors import run_tool
from library.log import logger


def whole(text: str) -> int:
    """An integer flag's value; "2.0" is 2: the kohya_ss GUI's GIT tab passes its number fields
    as Gradio floats (str(2.0)), which sd-scripts' type=int refuses."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def parser(description: str, caption_extension: str = ".caption") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("train_data_dir", help="the folder of images to caption")
    p.add_argument("--caption_extension", default=caption_extension,
                   help=f"extension of the caption files written beside the images (default {caption_extension})")
    p.add_argument("--batch_size", type=whole, default=1, help="images per generate call")
    p.add_argument("--max_data_loader_n_workers", type=whole, default=None,
                   help="decode images ahead in this many threads")
    p.add_argument("--pin_memory", action="store_true",
                   help="pin each batch in page-locked memory before its copy to the GPU")
    p.add_argument("--recursive", action="store_true", help="caption the images of subfolders too")
    p.add_argument("--debug", action="store_true", help="print each caption as it is written")
    p.add_argument("--overwrite", action="store_true",
                   help="caption images that already have a caption file (default: skip them)")
    p.add_argument("--prefix", default="",
                   help="text written before each caption, as is (a trigger word: \"sks, \")")
    p.add_argument("--suffix", default="", help="text written after each caption, as is")
    p.add_argument("--device", default=None, help="torch device (default: cuda when present, else cpu)")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "fp16", "bf16"),
                   help="the weights' dtype (auto: bf16 on CUDA, fp16 where the GPU lacks bf16; fp32 on the CPU)")
    return p


def job(args: argparse.Namespace) -> captioning.CaptionJob:
    # make_captions.py keeps sd-scripts' misspelt --caption_extention, which wins when given
    extension = getattr(args, "caption_extention", None) or args.caption_extension
    return captioning.CaptionJob(
        folder=args.train_data_dir, caption_extension=extension,
        recursive=args.recursive, overwrite=args.overwrite, prefix=args.prefix, suffix=args.suffix,
        batch_size=args.batch_size, workers=args.max_data_loader_n_workers, debug=args.debug)


def placement_args(args: argparse.Namespace) -> dict:
    return dict(device=args.device, precision=args.precision, pin_memory=args.pin_memory)


def main(p: argparse.ArgumentParser, build: Callable[[argparse.Namespace], captioning.Captioner],
         argv=None) -> int:
    """Parse, check the job (before the model loads), ``build(args)`` the captioner unless there
    is nothing to caption, run."""
    args = p.parse_args(argv)
    bar = None

    def progress(done, total, path):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="image", smoothing=0.0)
        bar.update(1)

    def work():
        the_job = job(args)
        captioning.check_job(the_job)
        idle = captioning.nothing_to_do(the_job)
        if idle:
            logger.warning(idle)
            return
        summary = captioning.run(the_job, build(args), progress)
        if bar is not None:
            bar.close()
        logger.info(summary.line())

    try:
        return run_tool(work)
    finally:
        if bar is not None:
            bar.close()
