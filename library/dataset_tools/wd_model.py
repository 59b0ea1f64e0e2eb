"""The WD tagger's model: where it lives (sd-scripts' ``--model_dir`` + ``--repo_id``), its two
file layouts, the hub download, its labels and the onnxruntime session that scores a batch.

Layouts (as sd-scripts' finetune/tag_images_by_wd14_tagger.py reads them):
- SmilingWolf's: ``model.onnx`` (NHWC float32 BGR 0..255 in, one sigmoid per label out) and
  ``selected_tags.csv`` (``tag_id,name,category,count``; category 9 rating, 0 general, 4 character);
- ``model_optimized.onnx`` (NCHW, BGR scaled to -1..1 in, logits out) and ``tag_mapping.json``
  (``{"<output index>": {"tag": ..., "category": ...}}``), for a ``--repo_id`` with a subfolder
  (``owner/name/subdir``).
"""
from __future__ import annotations

import csv
import io
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from library import text_files
from library.errors import UserError, first_line
from library.log import logger


IMAGE_SIZE = 448  # sd-scripts' size; a model that declares another fixed size gets its own
DEFAULT_REPO_ID = "SmilingWolf/wd-v1-4-convnext-tagger-v2"
CATEGORIES = ("Rating", "General", "Character", "Copyright", "Meta", "Model", "Quality", "Artist")
CSV_CATEGORIES = {"9": "Rating", "0": "General", "4": "Character"}


class TaggerError(UserError):
    """Bad tagger input (model folder, options, files): one line naming it."""


@dataclass(frozen=True)
class Layout:
    name: str
    onnx_file: str
    tags_file: str
    nchw: bool     # input NCHW scaled to -1..1 (else NHWC 0..255)
    logits: bool   # the model outputs logits (sigmoid applied here), else probabilities


SMILINGWOLF = Layout("SmilingWolf", "model.onnx", "selected_tags.csv", nchw=False, logits=False)
TAG_MAPPING = Layout("tag_mapping", "model_optimized.onnx", "tag_mapping.json", nchw=True, logits=True)
LAYOUTS = (SMILINGWOLF, TAG_MAPPING)


@dataclass(frozen=True)
class Labels:
    """Per model output: the tag name and its category (None: an output that is no tag here)."""
    names: tuple[str | None, ...]
    categories: tuple[str | None, ...]

    def renamed(self, names) -> "Labels":
        return Labels(tuple(names), self.categories)


@dataclass(frozen=True)
class Location:
    folder: str
    layout: Layout  # the layout the repo id implies (sd-scripts' rule)
    repo_id: str    # owner/name
    subdir: str | None


def location(model_dir: str, repo_id: str) -> Location:
    """sd-scripts' place: ``<model_dir>/<owner>_<name>`` for ``owner/name`` (SmilingWolf layout),
    ``<model_dir>/<owner>_<name>/<subdir>`` for ``owner/name/subdir`` (tag_mapping layout)."""
    parts = [p for p in repo_id.split("/")]
    if len(parts) < 2 or not all(parts):
        raise TaggerError(f"--repo_id {repo_id!r}: expected owner/name or owner/name/subfolder")
    if any(p in (".", "..") for p in parts):
        raise TaggerError(f"--repo_id {repo_id!r}: '.' and '..' are not repository names")
    repo = "/".join(parts[:2])
    base = os.path.join(model_dir, repo.replace("/", "_"))
    if len(parts) > 2:
        subdir = "/".join(parts[2:])
        return Location(os.path.join(base, subdir), TAG_MAPPING, repo, subdir)
    return Location(base, SMILINGWOLF, repo, None)


def _complete(folder: str, layout: Layout) -> bool:
    return all(os.path.isfile(os.path.join(folder, f)) for f in (layout.onnx_file, layout.tags_file))


def find_layout(folder: str, preferred: Layout) -> Layout:
    """The layout whose two files ``folder`` holds (the repo id's first), else one line saying
    what is missing."""
    for layout in (preferred,) + tuple(lay for lay in LAYOUTS if lay is not preferred):
        if _complete(folder, layout):
            return layout
    if os.path.isfile(os.path.join(folder, "saved_model.pb")):
        raise TaggerError(f"model folder {folder} holds a Keras SavedModel (saved_model.pb): only "
                          "ONNX models run here; get the ONNX files with --force_download")
    missing = [f for f in (preferred.onnx_file, preferred.tags_file)
               if not os.path.isfile(os.path.join(folder, f))]
    other = [lay for lay in LAYOUTS if lay is not preferred][0]
    raise TaggerError(f"model folder {folder} lacks {' and '.join(missing)} (expected "
                      f"{preferred.onnx_file} + {preferred.tags_file}, or {other.onnx_file} + "
                      f"{other.tags_file}); download them with --force_download")


def download(loc: Location, log: logging.Logger = logger) -> None:
    """The layout's two files from the hub into ``loc.folder``. All files are fetched into a
    temporary folder first and then moved in one by one, so a failed download leaves the
    folder as it was, and other files in it (a Keras model, notes) stay."""
    try:
        from huggingface_hub import hf_hub_download  # lazy: only a download needs it
    except ImportError:
        raise TaggerError(f"model folder {loc.folder} not found and huggingface_hub is not "
                          "installed to download it") from None
    files = (loc.layout.onnx_file, loc.layout.tags_file)
    log.info(f"downloading the WD tagger {loc.repo_id}{'/' + loc.subdir if loc.subdir else ''} "
             f"from the Hugging Face hub into {loc.folder}")
    try:
        os.makedirs(loc.folder, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=loc.folder) as tmp:
            got = [hf_hub_download(repo_id=loc.repo_id, filename=f, subfolder=loc.subdir,
                                   local_dir=tmp, force_download=True) for f in files]
            for f, path in zip(files, got):
                os.replace(path, os.path.join(loc.folder, f))
    except Exception as e:  # the hub raises many types (offline, not found, HTTP, disk)
        raise TaggerError(f"cannot download {', '.join(files)} of {loc.repo_id} into "
                          f"{loc.folder}: {first_line(e)}") from None


def model_folder(model_dir: str, repo_id: str, force_download: bool,
                 log: logging.Logger = logger) -> tuple[str, Layout]:
    """The folder to load and its layout: ``<model_dir>/<repo folder>`` (downloaded when missing
    or with ``force_download``, as sd-scripts does), or ``model_dir`` itself when it already
    holds a model and the repo folder does not exist."""
    loc = location(model_dir, repo_id)
    if not os.path.isdir(loc.folder) and not force_download:
        for layout in (loc.layout,) + tuple(lay for lay in LAYOUTS if lay is not loc.layout):
            if _complete(model_dir, layout):
                log.info(f"using the WD tagger model in {model_dir} ({layout.onnx_file})")
                return model_dir, layout
    if force_download or not os.path.isdir(loc.folder):
        download(loc, log)
    else:
        log.info(f"using the existing WD tagger model in {loc.folder}")
    return loc.folder, find_layout(loc.folder, loc.layout)


def read_csv_labels(path: str) -> Labels:
    """selected_tags.csv: one row per output, ``tag_id,name,category,count``."""
    rows = list(csv.reader(io.StringIO(text_files.read(path, TaggerError, "tag file"))))
    if not rows or [h.strip() for h in rows[0][:3]] != ["tag_id", "name", "category"]:
        raise TaggerError(f"tag file {path}: the header is {rows[0] if rows else 'missing'}, "
                          "expected tag_id,name,category,...")
    names, cats = [], []
    for n, row in enumerate(rows[1:], start=2):
        if len(row) < 3:
            raise TaggerError(f"tag file {path}: line {n} has {len(row)} field(s), expected 3 or more")
        names.append(row[1])
        cats.append(CSV_CATEGORIES.get(row[2].strip()))
    return Labels(tuple(names), tuple(cats))


def read_json_labels(path: str) -> Labels:
    """tag_mapping.json: ``{"<output index>": {"tag": name, "category": one of CATEGORIES}}``."""
    try:
        doc = json.loads(text_files.read(path, TaggerError, "tag file"))
    except ValueError as e:
        raise TaggerError(f"tag file {path} is not JSON ({e})") from None
    if not isinstance(doc, dict) or not doc:
        raise TaggerError(f"tag file {path}: expected an object {{\"<index>\": {{\"tag\": ..., "
                          "\"category\": ...}}}}")
    entries = {}
    for key, info in doc.items():
        if not (isinstance(key, str) and key.strip().isdigit()):
            raise TaggerError(f"tag file {path}: key {key!r} is not an output index")
        if not (isinstance(info, dict) and isinstance(info.get("tag"), str)):
            raise TaggerError(f"tag file {path}: entry {key} has no \"tag\" string")
        if info.get("category") not in CATEGORIES:
            raise TaggerError(f"tag file {path}: entry {key} has category {info.get('category')!r}, "
                              f"expected one of {', '.join(CATEGORIES)}")
        entries[int(key)] = (info["tag"], info["category"])
    size = max(entries) + 1
    names = [entries[i][0] if i in entries else None for i in range(size)]
    cats = [entries[i][1] if i in entries else None for i in range(size)]
    return Labels(tuple(names), tuple(cats))


def providers(available: list[str]) -> list[str]:
    """CUDA when onnxruntime has it (then ROCm), with the CPU as the fallback."""
    for gpu in ("CUDAExecutionProvider", "ROCMExecutionProvider"):
        if gpu in available:
            return [gpu, "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


@dataclass
class TaggerModel:
    """A loaded tagger: ``scores(images)`` maps a batch of preprocessed images (N, size, size, 3,
    float32 BGR 0..255) to per-label probabilities (N, labels)."""
    session: Any  # onnxruntime.InferenceSession (imported when a model loads)
    input_name: str
    layout: Layout
    labels: Labels
    size: int
    fixed_batch: int | None  # the model's batch dimension when it is not dynamic
    path: str

    def layout_fits(self, n_out: int) -> bool:
        """A CSV row per output; tag_mapping.json names some outputs (sd-scripts skips the rest)."""
        n = len(self.labels.names)
        return n_out >= n if self.layout is TAG_MAPPING else n_out == n

    def scores(self, images: np.ndarray) -> np.ndarray:
        n = len(images)
        x = images
        if self.fixed_batch and n < self.fixed_batch:  # a short last batch: pad, then drop
            x = np.concatenate([x, np.zeros((self.fixed_batch - n,) + x.shape[1:], x.dtype)])
        if self.layout.nchw:
            x = x.transpose(0, 3, 1, 2) / 127.5 - 1.0
        try:
            out = self.session.run(None, {self.input_name: np.ascontiguousarray(x, np.float32)})[0]
        except Exception as e:  # onnxruntime raises its own types for shape and type mismatches
            raise TaggerError(f"model {self.path} cannot run on a batch of shape {list(x.shape)}: "
                              f"{first_line(e)}") from None
        out = np.asarray(out)[:n]
        if out.ndim != 2 or not self.layout_fits(out.shape[1]):
            raise TaggerError(f"model {self.path} gives {list(out.shape[1:])} scores per image but "
                              f"its tag file lists {len(self.labels.names)} labels: wrong layout")
        out = out[:, :len(self.labels.names)]  # tag_mapping.json may leave trailing outputs out
        if self.layout.logits:
            out = 1 / (1 + np.exp(-out))  # sd-scripts' float32 sigmoid
        return out


def _input_spec(inp, layout: Layout, path: str) -> tuple[int, int | None]:
    """(image size, fixed batch or None) from the model's input, checked against the layout."""
    shape = list(inp.shape)
    want = "[N, 3, H, W]" if layout.nchw else "[N, H, W, 3]"
    if len(shape) != 4:
        raise TaggerError(f"model {path}: input {inp.name} has shape {shape}, expected {want} "
                          f"({layout.name} layout)")
    h, w, c = (shape[2], shape[3], shape[1]) if layout.nchw else (shape[1], shape[2], shape[3])
    if isinstance(c, int) and c != 3:
        raise TaggerError(f"model {path}: input {inp.name} has shape {shape}, expected {want} "
                          f"({layout.name} layout)")
    if inp.type != "tensor(float)":
        raise TaggerError(f"model {path}: input {inp.name} is {inp.type}, expected float32")
    sizes = {s for s in (h, w) if isinstance(s, int) and s > 0}
    if len(sizes) > 1:
        raise TaggerError(f"model {path}: input {inp.name} is not square ({shape})")
    batch = shape[0] if isinstance(shape[0], int) and shape[0] > 0 else None
    return (sizes.pop() if sizes else IMAGE_SIZE), batch


def load(folder: str, layout: Layout, log: logging.Logger = logger) -> TaggerModel:
    """The layout's labels and an onnxruntime session over its model (CUDA when present)."""
    try:
        import onnxruntime as ort  # lazy: an optional dependency (pip install .[tagger])
    except ImportError:
        raise TaggerError("onnxruntime is not installed: pip install onnxruntime "
                          "(or onnxruntime-gpu), or the project's [tagger] extra") from None
    tags_path = os.path.join(folder, layout.tags_file)
    labels = (read_json_labels if layout is TAG_MAPPING else read_csv_labels)(tags_path)
    path = os.path.join(folder, layout.onnx_file)
    chosen = providers(ort.get_available_providers())
    log.info(f"loading {path} with onnxruntime ({', '.join(chosen)})")
    try:
        session = ort.InferenceSession(path, providers=chosen)
    except Exception as e:  # a truncated or foreign file: onnxruntime's own exception types
        raise TaggerError(f"model {path} cannot be loaded by onnxruntime: {first_line(e)}") from None
    inp = session.get_inputs()[0]
    size, batch = _input_spec(inp, layout, path)
    outputs = session.get_outputs()[0].shape
    model = TaggerModel(session, inp.name, layout, labels, size, batch, path)
    n_out = outputs[-1] if outputs and isinstance(outputs[-1], int) else None
    if n_out is not None and not model.layout_fits(n_out):
        raise TaggerError(f"model {path} gives {n_out} scores per image but {tags_path} lists "
                          f"{len(labels.names)} labels: wrong layout")
    return model

