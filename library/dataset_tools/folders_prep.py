"""The kohya_ss GUI's "Dreambooth/LoRA Folder preparation" and "Dataset balancing" as functions.

``prepare_folders``: a training folder ``OUT/img/<repeats>_<instance prompt> <class prompt>``
(a copy of the images folder, captions and all), ``OUT/reg/<repeats>_<class prompt>`` when
regularisation images are given, and empty ``OUT/log`` and ``OUT/model``; the GUI's refusals
(source and destination the same, one inside the other) are kept. Stronger than the GUI: an
existing concept folder is replaced only when asked (``replace``), and then in one rename, so a
failed copy leaves it as it was.

``balance``: renames the ``N_concept`` folders of a folder so that each concept gets about
``steps`` image draws per epoch: repeats = max(1, round(steps / images x m)), where a folder
named ``{m}N_concept`` weights its concept by m (the GUI's formula, Python's rounding). Images are
counted as the trainer counts them (library/data/folders.py IMAGE_EXTENSIONS, any letter case;
the GUI counts .jpg .jpeg .png .gif .webp in lower case only). Stronger than the GUI: a folder
without images keeps its name (the GUI renames it to ``0_...``, which the trainer then skips),
the ``{m}`` weight works without the GUI's "insecure" switch, and two folders that would get the
same name are refused before anything is renamed."""
from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass

from library import files
from library.data.folders import IMAGE_EXTENSIONS
from library.dataset_tools.captions import JOURNAL_DIR
from library.errors import DataError, first_line

logger = logging.getLogger("sdtk")

# never copied into a prepared folder: the latent cache, and undo journals (which name the files
# of the folder they were written in)
NOT_COPIED = shutil.ignore_patterns(".sdcache", JOURNAL_DIR)


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def _inside(path: str, parent: str) -> bool:
    p, q = _real(path), _real(parent)
    return p != q and os.path.commonpath([p, q]) == q


def _check_pair(src: str, dst: str, option: str) -> None:
    if not os.path.isdir(src):
        raise DataError(f"{option} {src}: no such folder")
    if _real(src) == _real(dst):
        raise DataError(f"{option} {src} is the destination {dst} itself")
    if _inside(dst, src):
        raise DataError(f"{option} {src}: the destination {dst} is inside it")
    if _inside(src, dst):
        raise DataError(f"{option} {src} is inside the destination {dst}")


@dataclass
class Prepared:
    img: str
    reg: str | None
    log: str
    model: str


def prepare_folders(train_images: str, repeats: int, instance_prompt: str, class_prompt: str,
                    out_dir: str, *, reg_images: str | None = None, reg_repeats: int = 1,
                    replace: bool = False, log: logging.Logger = logger) -> Prepared:
    instance_prompt, class_prompt = instance_prompt.strip(), class_prompt.strip()
    for option, value in (("--instance_prompt", instance_prompt), ("--class_prompt", class_prompt)):
        if not value:
            raise DataError(f"{option}: empty")
        if "/" in value or os.sep in value or "\0" in value:
            raise DataError(f"{option} {value!r}: a folder name cannot hold '/'")
    if repeats < 1:
        raise DataError(f"--repeats {repeats}: must be at least 1")
    copies = [(train_images, os.path.join(out_dir, "img", f"{repeats}_{instance_prompt} {class_prompt}"),
               "--train_images")]
    if reg_images:
        if reg_repeats < 1:
            raise DataError(f"--reg_repeats {reg_repeats}: must be at least 1")
        copies.append((reg_images, os.path.join(out_dir, "reg", f"{reg_repeats}_{class_prompt}"),
                       "--reg_images"))
    for src, dst, option in copies:  # every check before anything is written
        _check_pair(src, dst, option)
        if os.path.lexists(dst) and not replace:
            raise DataError(f"{dst} exists (pass --replace to replace it with a copy of {src})")
    for src, dst, _ in copies:
        log.info(f"copying {src} to {dst}")
        with files.atomic_dir(dst) as tmp:
            try:
                shutil.copytree(src, tmp, ignore=NOT_COPIED, dirs_exist_ok=True)
            except (OSError, shutil.Error) as e:
                raise files.SaveError(dst, first_line(e), "folder") from None
    made = Prepared(img=copies[0][1], reg=copies[1][1] if reg_images else None,
                    log=os.path.join(out_dir, "log"), model=os.path.join(out_dir, "model"))
    for folder in (made.log, made.model):
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise DataError(f"{folder}: cannot create it ({e.strerror or e})") from None
    return made


# -- dataset balancing --------------------------------------------------------------------------
WEIGHT = re.compile(r"^\{(\d+\.?\d*)\}")
REPEATS = re.compile(r"^\d+_")
KOHYA_NAME = re.compile(r"^(\{\d+\.?\d*\})?\d+_.+$")


def count_images(folder: str) -> int:
    return sum(1 for n in os.listdir(folder) if os.path.splitext(n)[1].lower() in IMAGE_EXTENSIONS
               and not n.startswith(".") and os.path.isfile(os.path.join(folder, n)))


@dataclass
class Rename:
    old: str
    new: str
    images: int
    repeats: int


def balanced_repeats(steps: float, images: int, weight: float = 1.0) -> int:
    """The GUI's formula: max(1, round(steps / images x weight))."""
    return max(1, round(steps / images * weight))


def plan_balance(folder: str, steps: float, *, insecure: bool = False,
                 log: logging.Logger = logger) -> list[Rename]:
    """The renames that balance ``folder``'s concept folders (nothing is renamed here)."""
    if not steps > 0:
        raise DataError(f"--steps {steps}: must be above 0")
    if not os.path.isdir(folder):
        raise DataError(f"{folder}: no such folder")
    plan = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith(".") or not os.path.isdir(path):
            continue
        if not (KOHYA_NAME.match(name) or insecure):
            log.info(f"skipping {path}: not a <repeats>_<concept> folder (--insecure renames it too)")
            continue
        images = count_images(path)
        if images == 0:
            log.warning(f"skipping {path}: no images ({', '.join(IMAGE_EXTENSIONS)})")
            continue
        m = WEIGHT.match(name)
        rest = name[m.end():] if m else name
        repeats = balanced_repeats(steps, images, float(m.group(1)) if m else 1.0)
        counted = REPEATS.match(rest)
        new = f"{repeats}_{rest[counted.end():] if counted else rest}"
        plan.append(Rename(name, new, images, repeats))
    targets = [r.new for r in plan]
    for r in plan:
        if targets.count(r.new) > 1:
            raise DataError(f"{folder}: several folders would be named {r.new!r}; nothing was renamed")
        if r.new != r.old and os.path.lexists(os.path.join(folder, r.new)) and \
                r.new not in (p.old for p in plan):
            raise DataError(f"{folder}: {r.old!r} would become {r.new!r}, which exists; nothing was renamed")
    return plan


def apply_balance(folder: str, plan: list[Rename]) -> None:
    """Rename as planned, through temporary names (swapped names cannot collide); a failure puts
    every name back."""
    staged, done = [], []
    try:
        for r in (r for r in plan if r.new != r.old):
            tmp = os.path.join(folder, f".{r.old}.sdtk{os.getpid()}.balance.tmp")
            os.rename(os.path.join(folder, r.old), tmp)
            staged.append((r, tmp))
        for r, tmp in staged:
            os.rename(tmp, os.path.join(folder, r.new))
            done.append((r, tmp))
    except OSError as e:
        for r, tmp in reversed(done):
            os.rename(os.path.join(folder, r.new), tmp)
        for r, tmp in staged:
            os.rename(tmp, os.path.join(folder, r.old))
        raise DataError(f"{folder}: cannot rename its folders ({e.strerror or e}); "
                        "the names are as they were") from None
