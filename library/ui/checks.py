"""What the UI asks of a config before it runs: the same checks, messages, step plan and memory
estimate as ``--dry_run`` (library/run/trainer.py), with no weight loaded.

    check_config(script, text, processes=1, memory=True) -> dict
        {"ok", "errors": [{"option", "message"}], "warnings": [...], "plan": {...} | None,
         "plans": {"1": {...}, "2": ..., "4": ..., "8": ...}, "memory": {...} | None,
         "dataset": {...} | None}
    parse_config(script, text) -> Options      the strict parser, or a UserError

The TOML text is written to a temporary file and parsed as ``--config`` (relative paths are
relative to the server's working folder, as for a command line started there); in messages the
temporary file's name reads ``config``.
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
from typing import TYPE_CHECKING, Any
import threading
import tomllib

import toml

from library.config.options import IMAGE_SCRIPTS, METHOD_OF_SCRIPT, OPTIONS_BY_NAME, SECRET_OPTIONS
from library.config.parse import parse_args, required
from library.distributed import deepspeed_zero
from library.errors import UserError
from library.models import prompt_weights
from library.outputs import output_checks, train_state
from library.run import run_checks
from library.training import memory_estimate
from library.training.plan import plan_for, plan_run

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

PROCESS_COUNTS = (1, 2, 4, 8)
CONFIG_NAME = "config"
_LOCK = threading.Lock()  # the parser warns through the shared "sdtk" logger: one check at a time
_MEMORY_LOCK = threading.Lock()
_MEMORY: dict = {}  # (script, text, processes) -> (memory dict or None, note)
MEMORY_CACHE = 16
_WHERE = re.compile(r"^config(?::\d+)?: ([A-Za-z0-9_.\-]+)[:\s]")
_HINT = re.compile(r"did you mean ([A-Za-z0-9_]+)\?")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _error(msg: str) -> dict:
    """{"option": the key as written where the message names one (an unknown key too), else the
    first option the message names; "suggestion": the closest valid name, if any}."""
    m = _WHERE.match(msg) or re.match(r"^--([A-Za-z0-9_]+)", msg)
    option = m.group(1) if m else next((w for w in _WORD.findall(msg) if w in OPTIONS_BY_NAME), None)
    hint = _HINT.search(msg)
    return {"option": option, "message": msg, "suggestion": hint.group(1) if hint else None}


def parse_config(script: str, text: str, extra: list | None = None):
    """The Options of ``text`` for ``script`` (UserError when invalid; temp file name -> config)."""
    if script not in IMAGE_SCRIPTS:
        raise UserError(f"script: unknown script {script!r} (expected one of: {', '.join(IMAGE_SCRIPTS)}; train_leco runs from the command line)")
    with tempfile.TemporaryDirectory(prefix="sdtk-ui-") as d:
        path = os.path.join(d, CONFIG_NAME + ".toml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            return parse_args(script, ["--config", path, *(extra or [])])
        except UserError as e:
            raise type(e)(str(e).replace(path, CONFIG_NAME)) from None


def snapshot(text: str, opts: Options) -> str:
    """The TOML a job keeps: ``text`` itself, or, when it names a ``dataset_config`` file, the
    same run with that file's [general] / [[datasets]] tables in place of the key, so that editing
    the file later does not change a queued job; never a secret (``secrets``: SECRET_OPTIONS reach
    the run through its environment, not through the stored snapshot)."""
    bundled = opts.dataset_config_path and "dataset_config" in opts.given
    if not bundled and not secrets(opts):
        return text
    data = tomllib.loads(text)
    for table in [data] + [v for v in data.values() if isinstance(v, dict)]:
        for name in SECRET_OPTIONS:
            table.pop(name, None)
        if bundled:
            table.pop("dataset_config", None)
    if bundled:
        with open(required(opts.dataset_config_path, "dataset_config"), "rb") as f:
            data.update(tomllib.load(f))
    return toml.dumps(data)


def secrets(opts) -> dict[str, str]:
    """The secret options (SECRET_OPTIONS: the Hub token, the wandb key) a config sets."""
    return {name: getattr(opts, name) for name in SECRET_OPTIONS if getattr(opts, name)}


def plan_dict(p) -> dict:
    return {"total_steps": p.total_steps, "global_batch": p.global_batch,
            "steps_per_epoch": p.steps_per_epoch, "epochs": p.epochs, "processes": p.processes,
            "train_batch_size": p.train_batch_size,
            "gradient_accumulation_steps": p.gradient_accumulation_steps, "images": p.images,
            "repeats_total": p.repeats_total, "reg_images": p.reg_images,
            "samples_per_epoch": p.samples_per_epoch, "warmup_steps": p.warmup_steps,
            "lines": p.lines()}


def memory_dict(est) -> dict:
    gib = 1024 ** 3
    return {"total_gib": est.total / gib, "peak_phase": est.peak_phase,
            "parameters_gib": est.resident_params / gib, "gradients_gib": est.gradients / gib,
            "optimizer_gib": est.optimizer / gib, "activations_gib": est.activations / gib,
            "lines": est.lines()}


def dataset_dict(tset, weighted: bool = False, captions: int = 6) -> dict:
    """Per subset (concept folder) images x repeats, the bucket histogram, and the first
    captions of epoch 1 as they will be trained (shuffle, tag dropout, caption dropout applied);
    ``weighted`` (weighted_captions): each caption's pieces with their weights, as the text
    encoder's output is scaled (library/models/prompt_weights.py)."""
    subsets: dict = {}
    for it in list(tset.train_items) + list(tset.reg_items):
        s = subsets.setdefault(it.image_dir, {"folder": it.image_dir, "images": 0,
                                              "repeats": it.num_repeats, "is_reg": it.is_reg})
        s["images"] += 1
    buckets = sorted(tset.bucket_sizes().items())
    n = min(captions, len(tset.samples))
    return {"subsets": list(subsets.values()),
            "buckets": [{"width": b[0], "height": b[1], "samples": k} for b, k in buckets],
            "captions": [_caption(os.path.basename(tset.samples[i].path), tset.caption(i, 1), weighted)
                         for i in range(n)],
            "validation_images": len(tset.val_items)}


def _caption(image: str, caption: str, weighted: bool) -> dict:
    out: dict[str, object] = {"image": image, "caption": caption}
    if weighted:
        out["weights"] = [[piece, weight] for piece, weight in prompt_weights.parse(caption)]
    return out


def check_config(script: str, text: str, processes: int = 1, memory: bool = True) -> dict:
    out: dict[str, Any] = {"ok": False, "errors": [], "warnings": [], "plan": None, "plans": {},
                           "memory": None, "dataset": None}  # the page's JSON
    handler = _Collect()
    logger = logging.getLogger("sdtk")
    with _LOCK:
        logger.addHandler(handler)
        try:
            opts = parse_config(script, text)
            method = METHOD_OF_SCRIPT[script]
            opts = deepspeed_zero.resolve_options(opts)
            opts, tset, plan = plan_run(opts, processes)
            out["plan"] = plan_dict(plan)
            out["plans"] = {str(n): plan_dict(plan_for(opts, tset, n)) for n in PROCESS_COUNTS}
            out["dataset"] = dataset_dict(tset, opts.weighted_captions)
            if opts.resume:
                train_state.check_resume(opts, method, plan, tset, None)
            output_checks.check_name(opts.output_name)
            opts = run_checks.resolve_options(opts, method)
            run_checks.check_before_loading(opts, method, plan)
            out["ok"] = True
        except UserError as e:
            out["errors"].append(_error(str(e)))
        finally:
            logger.removeHandler(handler)
    out["warnings"] = handler.lines
    if memory and out["ok"]:
        # seconds, not milliseconds: under its own lock, so that the quick checks of the next
        # edits do not wait for it (fake-tensor modes are per thread); the last few are kept
        key = (script, text, processes)
        with _MEMORY_LOCK:
            if key not in _MEMORY:
                try:
                    _MEMORY[key] = memory_dict(memory_estimate.estimate(opts, method, tset, processes)), None
                except Exception as e:  # noqa: BLE001 - advice, never a reason to refuse (as --dry_run)
                    first = (str(e).strip().splitlines() or [""])[0]
                    _MEMORY[key] = None, f"memory estimate: not available ({first})"
                while len(_MEMORY) > MEMORY_CACHE:
                    _MEMORY.pop(next(iter(_MEMORY)))
            out["memory"], note = _MEMORY[key]
        if note:
            out["warnings"].append(note)
    return out
