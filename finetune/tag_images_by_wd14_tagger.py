"""Tag images with a WD tagger (SmilingWolf's wd-v1-4 / v3 family and tag_mapping.json models)
through onnxruntime, writing one caption file per image, as sd-scripts' script of the same name.

    python finetune/tag_images_by_wd14_tagger.py IMAGE_DIR --onnx \\
        [--repo_id SmilingWolf/wd-v1-4-convnext-tagger-v2] [--model_dir wd14_tagger_model] \\
        [--thresh 0.35] [--batch_size 4] [--caption_extension .txt] [--recursive] ...

Every flag of sd-scripts' script is taken; ONNX is the only backend, so ``--onnx`` is required
(sd-scripts runs a Keras / TensorFlow model without it). docs/DATASET_TOOLS.md has the details
and the differences from sd-scripts.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqdm import tqdm  # noqa: E402

from library.dataset_tools import wd_model, wd_tagger  # noqa: E402
from library.dataset_tools.wd_tags import TagOptions  # noqa: E402
from library.errors import tool_main  # noqa: E402
from library.log import logger, setup_logging  # noqa: E402

def setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Tag images with a WD tagger (ONNX).")
    p.add_argument("train_data_dir", help="folder of the images to tag")
    p.add_argument("--repo_id", default=wd_model.DEFAULT_REPO_ID,
                   help="the tagger on the Hugging Face hub: owner/name (model.onnx + "
                        "selected_tags.csv) or owner/name/subfolder (model_optimized.onnx + "
                        "tag_mapping.json)")
    p.add_argument("--model_dir", default="wd14_tagger_model",
                   help="folder of the models: the tagger is in <model_dir>/<owner>_<name>[/subfolder], "
                        "downloaded there when missing (or model_dir itself when it holds one)")
    p.add_argument("--force_download", action="store_true", help="download the model again")
    p.add_argument("--batch_size", type=int, default=1, help="images per model call")
    p.add_argument("--max_data_loader_n_workers", type=int, default=None,
                   help="read and preprocess images in this many threads ahead of the model")
    p.add_argument("--output_path", default=None,
                   help="write one metadata file (.json; .jsonl for JSON Lines) instead of caption files")
    p.add_argument("--caption_extention", default=None, help="old spelling of --caption_extension")
    p.add_argument("--caption_extension", default=".txt", help="extension of the caption files")
    p.add_argument("--thresh", type=float, default=0.35, help="score from which a tag is written")
    for cat, note in (("general", ""), ("character", ""), ("meta", " (tag_mapping layout)"),
                      ("model", " (tag_mapping layout)"), ("copyright", " (tag_mapping layout)"),
                      ("artist", " (tag_mapping layout)")):
        p.add_argument(f"--{cat}_threshold", type=float, default=None,
                       help=f"threshold of {cat} tags{note}; --thresh when omitted; above 1: none")
    p.add_argument("--recursive", action="store_true", help="tag the images of subfolders too")
    p.add_argument("--remove_underscore", action="store_true",
                   help="underscores in tags become spaces (tags of 3 characters or less are kept)")
    p.add_argument("--debug", action="store_true", help="log each image's tags by category")
    p.add_argument("--undesired_tags", default="", help="tags never written, separated as captions")
    p.add_argument("--frequency_tags", action="store_true", help="print how often each tag was written")
    p.add_argument("--onnx", action="store_true", help="run the ONNX model (the only backend here)")
    p.add_argument("--append_tags", action="store_true",
                   help="add the new tags after those of an existing caption instead of replacing it")
    p.add_argument("--use_rating_tags", action="store_true", help="the rating tag first")
    p.add_argument("--use_rating_tags_as_last_tag", action="store_true", help="the rating tag last")
    p.add_argument("--use_quality_tags", action="store_true",
                   help="the quality tag first (tag_mapping layout)")
    p.add_argument("--use_quality_tags_as_last_tag", action="store_true",
                   help="the quality tag last (tag_mapping layout)")
    p.add_argument("--character_tags_first", action="store_true",
                   help="character tags before the general tags")
    p.add_argument("--always_first_tags", default=None,
                   help="tags put first when present, e.g. 1girl,1boy")
    p.add_argument("--caption_separator", default=", ", help="between tags, spaces included")
    p.add_argument("--tag_replacement", default=None,
                   help="source1,target1;source2,target2 (escape , and ; in tags as \\, \\;)")
    p.add_argument("--character_tag_expand", action="store_true",
                   help="chara_name_(series) becomes chara_name, series")
    return p


def tag_options(args: argparse.Namespace) -> TagOptions:
    return TagOptions(
        thresh=args.thresh, general_threshold=args.general_threshold,
        character_threshold=args.character_threshold, copyright_threshold=args.copyright_threshold,
        meta_threshold=args.meta_threshold, model_threshold=args.model_threshold,
        artist_threshold=args.artist_threshold, caption_separator=args.caption_separator,
        undesired_tags=args.undesired_tags, always_first_tags=args.always_first_tags,
        tag_replacement=args.tag_replacement, remove_underscore=args.remove_underscore,
        character_tag_expand=args.character_tag_expand,
        character_tags_first=args.character_tags_first, use_rating_tags=args.use_rating_tags,
        use_rating_tags_as_last_tag=args.use_rating_tags_as_last_tag,
        use_quality_tags=args.use_quality_tags,
        use_quality_tags_as_last_tag=args.use_quality_tags_as_last_tag)


def output_options(args: argparse.Namespace) -> wd_tagger.OutputOptions:
    return wd_tagger.OutputOptions(
        caption_extension=args.caption_extention or args.caption_extension,
        append_tags=args.append_tags, output_path=args.output_path, recursive=args.recursive,
        batch_size=args.batch_size, max_data_loader_n_workers=args.max_data_loader_n_workers,
        debug=args.debug)


def run(args: argparse.Namespace) -> wd_tagger.Summary:
    setup_logging(True)
    if not args.onnx:
        raise wd_model.TaggerError("--onnx is required: without it sd-scripts runs the Keras / "
                                   "TensorFlow model, which this toolkit does not; add --onnx")
    tags, out = tag_options(args), output_options(args)  # option errors before the model loads
    wd_tagger.list_images(args.train_data_dir, out.recursive)  # a missing folder, likewise
    folder, layout = wd_model.model_folder(args.model_dir, args.repo_id, args.force_download)
    model = wd_model.load(folder, layout)
    with tqdm(total=None, smoothing=0.0, disable=None) as bar:
        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)

        summary = wd_tagger.tag_folder(args.train_data_dir, model, tags, out, progress)
    if args.frequency_tags:
        print("Tag frequencies:")
        for tag, freq in summary.sorted_frequencies():
            print(f"{tag}: {freq}")
    if summary.failed:
        logger.warning(f"tagged {summary.images - len(summary.failed)} of {summary.images} images; "
                       f"{len(summary.failed)} skipped (see above)")
    logger.info("done!")
    return summary


def main(argv=None) -> int:
    return tool_main(setup_parser().parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
