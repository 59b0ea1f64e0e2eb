"""Captioning a folder of images, whatever the model: find the images, skip those already
captioned (unless ``overwrite``), load them (in ``workers`` threads), caption them batch by batch
through a ``Captioner`` (library/dataset_tools/caption_models.py), write each caption atomically
beside its image with the trigger-word ``prefix`` / ``suffix``, and report progress.

``run(job, captioner, progress)`` is what finetune/make_captions.py, make_captions_by_git.py and
make_captions_vlm.py call, and what the UI can run as a job: paths and options in, a
``progress(done, total, path)`` callback, a ``Summary`` out. A corrupt image is skipped with one
line and the run continues; a folder that cannot be written is refused before the model loads.
"""
from __future__ import annotations

import os
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from library.data.folders import IMAGE_EXTENSIONS
from library.data.images import load_image
from library.errors import DataError, UserError
from library.files import atomic_path
from library.log import logger


class CaptionError(UserError):
    """A captioning job that cannot run as asked; the message is one line naming the option."""


class Captioner(Protocol):
    def caption(self, images: list) -> list[str]:
        """One caption per PIL image, in order."""
        ...


@dataclass(frozen=True)
class CaptionJob:
    folder: str
    caption_extension: str = ".caption"
    recursive: bool = False
    overwrite: bool = False
    prefix: str = ""
    suffix: str = ""
    batch_size: int = 1
    workers: int | None = None  # image-decoding threads (max_data_loader_n_workers); None: none
    debug: bool = False


@dataclass
class Summary:
    written: list[str] = field(default_factory=list)        # caption files
    existing: list[str] = field(default_factory=list)       # images skipped: already captioned
    unreadable: list[str] = field(default_factory=list)     # images skipped: cannot be decoded

    def line(self) -> str:
        return (f"{len(self.written)} caption(s) written, {len(self.existing)} image(s) already "
                f"captioned (--overwrite to redo them), {len(self.unreadable)} unreadable image(s) skipped")


Progress = Callable[[int, int, str], None]


def find_images(folder: str, recursive: bool = False) -> list[str]:
    """The images of ``folder`` (sd-scripts' extensions, any case), sorted; with ``recursive``
    those of its subfolders too (hidden files and folders, such as .sdcache, left out)."""
    out = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if recursive else []
        out += [os.path.join(root, n) for n in sorted(files)
                if not n.startswith(".") and os.path.splitext(n)[1].lower() in IMAGE_EXTENSIONS]
    return out


def caption_file(image: str, caption_extension: str) -> str:
    return os.path.splitext(image)[0] + caption_extension


def check_job(job: CaptionJob) -> None:
    """The job's options and folder, before any model loads; one CaptionError line each."""
    if not os.path.isdir(job.folder):
        what = "not a folder" if os.path.exists(job.folder) else "no such folder"
        raise CaptionError(f"train_data_dir {job.folder}: {what}")
    if not job.caption_extension.startswith(".") or len(job.caption_extension) < 2:
        raise CaptionError(f"--caption_extension {job.caption_extension!r}: must start with '.' "
                           "(e.g. .txt or .caption)")
    if job.batch_size < 1:
        raise CaptionError(f"--batch_size {job.batch_size}: must be >= 1")
    if job.workers is not None and job.workers < 0:
        raise CaptionError(f"--max_data_loader_n_workers {job.workers}: must be >= 0")
    for folder in sorted({os.path.dirname(p) for p in find_images(job.folder, job.recursive)}
                         | {job.folder}):
        reason = unwritable(folder)
        if reason:
            raise CaptionError(f"{folder}: captions cannot be written beside its images ({reason})")


def unwritable(folder: str) -> str | None:
    """Why no file can be created in ``folder``, or None: found by creating (and removing) one,
    which also catches a read-only mount and holds for root, whom permission bits do not stop."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".sdtk-probe.", dir=folder)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.remove(probe)
    return None


def pending_images(job: CaptionJob, summary: Summary) -> list[str]:
    """The images to caption: all of them with ``overwrite``, else those without a caption file
    (the others are counted in ``summary.existing``)."""
    todo = []
    for image in find_images(job.folder, job.recursive):
        if not job.overwrite and os.path.lexists(caption_file(image, job.caption_extension)):
            summary.existing.append(image)
        else:
            todo.append(image)
    return todo


def nothing_to_do(job: CaptionJob) -> str | None:
    """Why the job has no image to caption (say it, and load no model), or None."""
    summary = Summary()
    if pending_images(job, summary):
        return None
    if summary.existing:
        return (f"all {len(summary.existing)} image(s) in {job.folder} already have a "
                f"{job.caption_extension} file (--overwrite to caption them again)")
    return (f"no images ({' '.join(IMAGE_EXTENSIONS)}) in {job.folder}"
            + ("" if job.recursive else " (--recursive for its subfolders)"))


def _decoded(paths: Sequence[str], workers: int | None, ahead: int) -> Iterator[tuple[str, object]]:
    """(path, RGB image or the DataError saying why not), in order; with ``workers``, decoded in
    that many threads, at most ``ahead`` images ahead of the caller (a folder of ten thousand
    images is not held in memory at once)."""
    def load(path):
        try:
            return path, load_image(path)
        except DataError as e:
            return path, e
    if not workers:
        yield from map(load, paths)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        for path in paths:
            pending.append(pool.submit(load, path))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _batches(decoded, batch_size: int, summary: Summary, on_skip) -> Iterator[list[tuple[str, object]]]:
    batch = []
    for path, image in decoded:
        if isinstance(image, DataError):
            logger.warning(f"skipping {path}: {image}")
            summary.unreadable.append(path)
            on_skip(path)
            continue
        batch.append((path, image))
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def one_line(text: str) -> str:
    """A generated caption on one line, runs of white space as one space: the trainer reads a
    caption file's first line only (library/data/folders.py ``read_caption``), and a VLM's
    reply often spans paragraphs."""
    return " ".join(text.split())


def write_caption(path: str, text: str) -> None:
    """``text`` and a newline (as sd-scripts writes it) into ``path``, atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text + "\n")


def run(job: CaptionJob, captioner: Captioner, progress: Progress | None = None) -> Summary:
    """Caption the job's images with ``captioner``; ``progress(done, total, image)`` after each
    image (captioned or skipped as unreadable)."""
    check_job(job)
    summary = Summary()
    todo = pending_images(job, summary)
    done = 0

    def advance(path):
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(todo), path)

    decoded = _decoded(todo, job.workers, ahead=2 * job.batch_size + (job.workers or 0))
    for batch in _batches(decoded, job.batch_size, summary, advance):
        captions = captioner.caption([image for _, image in batch])
        for (path, _), text in zip(batch, captions, strict=True):
            target = caption_file(path, job.caption_extension)
            text = f"{job.prefix}{one_line(text)}{job.suffix}"
            write_caption(target, text)
            summary.written.append(target)
            if job.debug:
                logger.info(f"{path}: {text}")
            advance(path)
    return summary
