"""The kohya_ss GUI's folder preparation and dataset balancing, from the command line.

    python tools/dataset_folders.py prepare --train_images PHOTOS --repeats 40 \\
        --instance_prompt sks --class_prompt dog --out_dir TRAIN \\
        [--reg_images REG --reg_repeats 1] [--replace]
    python tools/dataset_folders.py balance TRAIN/img [--steps 1000] [--insecure] [--dry_run]

prepare: TRAIN/img/40_sks dog (a copy of PHOTOS), TRAIN/reg/1_dog, TRAIN/log, TRAIN/model.
balance: each N_concept folder renamed so that repeats x images is about --steps
(library/dataset_tools/folders_prep.py; docs/DATASET_TOOLS.md).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library.dataset_tools import folders_prep  # noqa: E402
from library.errors import run_tool  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="The kohya_ss GUI's folder preparation and dataset balancing.")
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="lay out img/N_instance class, reg/N_class, log, model")
    prep.add_argument("--train_images", required=True, help="folder of the training images (copied)")
    prep.add_argument("--repeats", type=int, default=40, help="repeats of the training images (GUI default 40)")
    prep.add_argument("--instance_prompt", required=True, help="the instance token, e.g. sks")
    prep.add_argument("--class_prompt", required=True, help="the class, e.g. dog")
    prep.add_argument("--out_dir", required=True, help="the training folder to lay out")
    prep.add_argument("--reg_images", default=None, help="folder of regularisation images (copied)")
    prep.add_argument("--reg_repeats", type=int, default=1, help="repeats of the regularisation images")
    prep.add_argument("--replace", action="store_true", help="replace an existing concept folder")
    bal = sub.add_parser("balance", help="set each concept folder's repeats for about --steps per epoch")
    bal.add_argument("folder", help="the folder holding the N_concept folders (e.g. TRAIN/img)")
    bal.add_argument("--steps", type=float, default=1000,
                     help="image draws per concept per epoch (the GUI's 'training steps per concept')")
    bal.add_argument("--insecure", action="store_true", help="also rename folders not named N_concept")
    bal.add_argument("--dry_run", action="store_true", help="print the renames, change nothing")
    return p.parse_args(argv)


def run(a) -> None:
    if a.command == "prepare":
        made = folders_prep.prepare_folders(a.train_images, a.repeats, a.instance_prompt, a.class_prompt,
                                            a.out_dir, reg_images=a.reg_images, reg_repeats=a.reg_repeats,
                                            replace=a.replace)
        for folder in (made.img, made.reg, made.log, made.model):
            if folder:
                print(f"made {folder}")
        return
    plan = folders_prep.plan_balance(a.folder, a.steps, insecure=a.insecure)
    for r in plan:
        print(f"{r.old} -> {r.new}: {r.images} images x {r.repeats} = {r.images * r.repeats} per epoch")
    if not a.dry_run:
        folders_prep.apply_balance(a.folder, plan)


def main(argv=None) -> int:
    return run_tool(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
