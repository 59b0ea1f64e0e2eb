"""Which paths a job may touch (``--allowed_paths``) and which files of a job the server sends.

    outside_allowed(opts, allowed) -> [{"option", "message"}]   every path option of the parsed
                                     run (schema types path / path_list, the model when it is a
                                     local path, resume, the dataset config's folders and files)
                                     that is not inside one of ``allowed``
    job_file(output_dir, name) -> path   a regular file inside the job's output folder, reached
                                     without "..", an absolute name or any symlink; else FileRefused
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from library.config.options import OPTIONS
from library.models.families.sd_common.tiny_models import TINY_NAMES

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

# built-in models selected by name (library/models/loading.py): no path to check
_BUILTIN = set(TINY_NAMES) | {"sd15-arch", "sdxl-arch"}
_DATASET_PATH_KEYS = ("image_dir", "metadata_file", "conditioning_data_dir", "cache_dir")
# set by the runner inside the job's own folder, or the parsed config itself
_NOT_CHECKED = ("config", "progress_file", "control_file")


class FileRefused(Exception):
    pass


def _inside(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _run_paths(opts: Options) -> list[tuple[str, str]]:
    out = []
    for o in OPTIONS:
        if o.name in _NOT_CHECKED or o.type not in ("path", "path_list"):
            continue
        v = getattr(opts, o.name)
        for p in (v if isinstance(v, (list, tuple)) else [v]):
            if p:
                out.append((o.name, str(p)))
    model = opts.pretrained_model_name_or_path
    if model and not (model in _BUILTIN and not os.path.exists(model)):
        if os.path.exists(model) or model.startswith((".", os.sep, "~")):
            out.append(("pretrained_model_name_or_path", model))
    if opts.resume and opts.resume != "latest":
        out.append(("resume", opts.resume))
    ds = opts.dataset_config or {}
    tables = [ds.get("general", {})]
    for d in ds.get("datasets", []):
        tables.append(d)
        tables += d.get("subsets", [])
    for t in tables:
        for k in _DATASET_PATH_KEYS:
            if isinstance(t.get(k), str) and t[k]:
                out.append((k, t[k]))
    if opts.dataset_config_path:
        out.append(("dataset_config", opts.dataset_config_path))
    return out


def outside_allowed(opts: Options, allowed: list[str] | None) -> list[dict]:
    if not allowed:
        return []
    roots = [os.path.realpath(a) for a in allowed]
    return [{"option": name, "message": f"{name}: {path} is outside the allowed paths "
                                        f"({', '.join(allowed)})", "suggestion": None}
            for name, path in _run_paths(opts) if not _inside(os.path.expanduser(path), roots)]


def job_file(output_dir: str, name: str) -> str:
    if not name or name.startswith(("/", "\\")) or os.path.isabs(name) or "\\" in name:
        raise FileRefused("an absolute name")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise FileRefused("a relative name without '..' or '.' parts is required")
    path = output_dir
    for p in parts:  # no symlink anywhere below the output folder
        path = os.path.join(path, p)
        if os.path.islink(path):
            raise FileRefused("a symlink")
    if not os.path.isfile(path):
        raise FileNotFoundError(name)
    if not _inside(path, [os.path.realpath(output_dir)]):
        raise FileRefused("outside the job's output folder")
    return path
