"""Our WD tagger side by side with sd-scripts' own finetune/tag_images_by_wd14_tagger.py
(docs/DATASET_TOOLS.md "Checked side by side").

    python benchmarks/sd_scripts_tagger_check.py --sd_scripts /path/to/sd-scripts [--work DIR]

The tiny taggers of tools/make_tiny_tagger.py (both layouts) tag the same images (every
preprocessing path) with the same flags, once by each script, each in a fresh copy of the folder;
per case the table says whether every caption file (and the --frequency_tags output, and the
--output_path file with the folder's name normalised) is byte for byte the same. sd-scripts runs
as a subprocess in its checkout through benchmarks/sd_scripts_tools_check.py's prelude (its
torchvision stand-in), with HF_HUB_OFFLINE; it needs opencv-python-headless, imagesize and
voluptuous. Cases where sd-scripts is known to be broken are marked and expected to differ (or
to fail, for character tags of the SmilingWolf layout). Exit status 0 when every case is as
expected.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make the repository root importable
    sys.path.insert(0, ROOT)

from benchmarks.sd_scripts_tools_check import PRELUDE, last_error_line, run  # noqa: E402
from tools.make_tiny_tagger import build_smilingwolf, build_tag_mapping, make_images  # noqa: E402

SW, TM = "SmilingWolf/wd-v1-4-convnext-tagger-v2", "someone/tagger/v1"
NO_CHARS = ["--character_threshold", "1.1"]
# (case, repo id, flags, expected: "same", "differs" or "sd-scripts fails")
CASES = [
    ("SmilingWolf, defaults (character tags)", SW, [], "sd-scripts fails"),
    ("SmilingWolf, no character tags", SW, NO_CHARS, "same"),
    ("SmilingWolf, rating first, underscores, undesired, frequencies, recursive", SW,
     NO_CHARS + ["--use_rating_tags", "--remove_underscore", "--undesired_tags", "solo, smile",
                 "--frequency_tags", "--recursive"], "same"),
    ("SmilingWolf, rating last, always first, general threshold, batch 3, workers 2", SW,
     NO_CHARS + ["--use_rating_tags_as_last_tag", "--always_first_tags", "smile,1girl",
                 "--general_threshold", "0.6", "--batch_size", "3", "--max_data_loader_n_workers", "2"],
     "same"),
    ("SmilingWolf, append tags", SW, NO_CHARS + ["--append_tags"], "same"),
    ("SmilingWolf, tag replacement", SW, NO_CHARS + ["--tag_replacement", "1girl,1woman"], "differs"),
    ("tag_mapping, defaults", TM, [], "same"),
    ("tag_mapping, rating / quality first, character tags first, frequencies", TM,
     ["--use_rating_tags", "--use_quality_tags", "--character_tags_first", "--frequency_tags"], "same"),
    ("tag_mapping, per-category thresholds, rating / quality last", TM,
     ["--thresh", "0.4", "--general_threshold", "0.5", "--copyright_threshold", "0.9",
      "--meta_threshold", "0.2", "--model_threshold", "0.3", "--artist_threshold", "0.7",
      "--use_rating_tags_as_last_tag", "--use_quality_tags_as_last_tag"], "same"),
    ("tag_mapping, separator, undesired, always first, batches, workers", TM,
     ["--caption_separator", "; ", "--undesired_tags", "solo;smile", "--always_first_tags",
      "highres;1girl", "--batch_size", "3", "--max_data_loader_n_workers", "2"], "same"),
    ("tag_mapping, character expansion", TM, ["--character_tag_expand", "--character_tags_first"],
     "same"),
    ("tag_mapping, append tags, other separator", TM, ["--append_tags", "--caption_separator", ","],
     "same"),
    ("tag_mapping, --output_path JSON", TM, ["--output_path", "{out}/meta.json"], "same"),
    ("tag_mapping, --output_path JSONL", TM, ["--output_path", "{out}/meta.jsonl"], "same"),
    ("tag_mapping, expansion after underscores", TM, ["--character_tag_expand", "--remove_underscore"],
     "differs"),
    ("tag_mapping, tag replacement", TM, ["--tag_replacement", "1girl,1woman;solo,alone"], "differs"),
]


def outputs(folder: str, out: str) -> dict[str, str]:
    """Every caption and metadata file under ``folder`` / ``out``, the folder's name replaced."""
    found = {}
    for base in (folder, out):
        for dirpath, _, files in os.walk(base):
            for f in files:
                if f.endswith((".txt", ".json", ".jsonl", ".stdout")):
                    path = os.path.join(dirpath, f)
                    with open(path, encoding="utf-8") as fh:
                        found[os.path.relpath(path, base)] = fh.read().replace(folder, "IMAGES")
    return found


def one_side(cmd: list[str], cwd: str, env: dict, images: str, folder: str, timeout: int):
    shutil.copytree(images, os.path.join(folder, "images"))
    os.makedirs(os.path.join(folder, "out"))
    cmd = [c.replace("{out}", os.path.join(folder, "out")) for c in cmd]
    code, stdout, stderr = run(cmd + [os.path.join(folder, "images")], cwd, env, timeout)
    with open(os.path.join(folder, "out", "run.stdout"), "w", encoding="utf-8") as f:
        f.write(stdout)
    return code, stderr, outputs(os.path.join(folder, "images"), os.path.join(folder, "out"))


def check(sd_scripts: str, work: str, timeout: int) -> int:
    models, images = os.path.join(work, "models"), os.path.join(work, "images")
    build_smilingwolf(os.path.join(models, SW.replace("/", "_")))
    build_tag_mapping(os.path.join(models, "someone_tagger", "v1"))
    make_images(images)
    with open(os.path.join(images, "a.txt"), "w", encoding="utf-8", newline="") as f:
        f.write("my_token, 1girl,bar\r\n")  # an existing caption (for --append_tags)
    with open(os.path.join(work, "prelude.py"), "w", encoding="utf-8") as f:
        f.write(PRELUDE)
    theirs = [sys.executable, os.path.join(work, "prelude.py"),
              os.path.join(sd_scripts, "finetune", "tag_images_by_wd14_tagger.py")]
    ours = [sys.executable, os.path.join(ROOT, "finetune", "tag_images_by_wd14_tagger.py")]
    bad = 0
    print("| case | expected | result |\n|---|---|---|")
    for n, (name, repo, flags, expected) in enumerate(CASES):
        common = ["--model_dir", models, "--repo_id", repo, "--onnx", *flags]
        case = os.path.join(work, f"case{n}")
        c1, err1, got1 = one_side(theirs + common, sd_scripts, {"PYTHONPATH": sd_scripts}, images,
                                  os.path.join(case, "sd"), timeout)
        c2, err2, got2 = one_side(ours + common, ROOT, {"PYTHONPATH": ROOT}, images,
                                  os.path.join(case, "ours"), timeout)
        if c2 != 0:
            result = f"ours failed: {last_error_line(err2)}"
        elif c1 != 0:
            result = f"sd-scripts failed: {last_error_line(err1)}"
        else:
            diff = sorted(k for k in set(got1) | set(got2) if got1.get(k) != got2.get(k))
            result = (f"same ({len(got1)} files)" if not diff
                      else f"differs in {len(diff)} of {len(got1)} files, e.g. {diff[0]}")
        ok = (result.startswith("same") if expected == "same"
              else result.startswith("differs") if expected == "differs"
              else result.startswith("sd-scripts failed"))
        bad += not ok
        print(f"| {name} | {expected} | {result}{'' if ok else ' **unexpected**'} |", flush=True)
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sd_scripts", required=True, help="path of a kohya-ss/sd-scripts checkout")
    p.add_argument("--work", default=None, help="folder for inputs and outputs (default: a temporary one)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per subprocess")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.sd_scripts, "finetune", "tag_images_by_wd14_tagger.py")):
        print(f"error: --sd_scripts {args.sd_scripts}: no finetune/tag_images_by_wd14_tagger.py",
              file=sys.stderr)
        return 2
    if args.work:
        os.makedirs(args.work, exist_ok=True)
        return check(args.sd_scripts, args.work, args.timeout)
    with tempfile.TemporaryDirectory() as work:
        return check(args.sd_scripts, work, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
