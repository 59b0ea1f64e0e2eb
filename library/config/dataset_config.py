"""The dataset config (``[general]``, ``[[datasets]]``, ``[[datasets.subsets]]``), sd-scripts' schema.

``library.config.parse`` keeps the tables raw on ``opts.dataset_config`` (from the run TOML or a
separate ``dataset_config`` file); this module validates them and resolves every key:

- a subset key: subset -> its dataset -> ``[general]`` -> the run option of the same name ->
  the default;
- a dataset key (``resolution``, ``batch_size``, bucket settings): dataset -> ``[general]`` ->
  the run option (``batch_size`` falls back to ``train_batch_size``) -> the default.

A subset with ``metadata_file`` (sd-scripts' fine-tuning subset) takes its images and captions from
that JSON/JSONL file (``library.data.folders.scan_metadata``); its ``image_dir`` is then optional (where
the file's keys are looked up).

Subset keys may therefore appear at any level except ``image_dir``, ``is_reg``,
``metadata_file`` and ``conditioning_data_dir`` (subset only; the run option
``conditioning_data_dir`` applies to the subsets without is_reg),
dataset keys not in a subset (as sd-scripts' voluptuous schema). Errors are one line naming the file, the table (``datasets[0].subsets[1]``)
and the key, with a close match for an unknown key.

No torch import: ``--dry_run`` resolves the config without loading model code.
"""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from library.config.parse import _Bad, _to_resolution
from library.errors import DataError

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

# key -> (type, default when no level and no run option sets it)
SUBSET_KEYS: dict[str, tuple[str, object]] = {
    "image_dir": ("str", None),
    "metadata_file": ("str", None),
    "num_repeats": ("int", 1),
    "caption_extension": ("str", ".caption"),
    "class_tokens": ("str", None),
    "is_reg": ("bool", False),
    "keep_tokens": ("int", 0),
    "keep_tokens_separator": ("str", ""),
    "shuffle_caption": ("bool", False),
    "caption_separator": ("str", ","),
    "caption_prefix": ("str", None),
    "caption_suffix": ("str", None),
    "caption_dropout_rate": ("rate", 0.0),
    "caption_dropout_every_n_epochs": ("int", 0),
    "caption_tag_dropout_rate": ("rate", 0.0),
    "flip_aug": ("bool", False),
    "random_crop": ("bool", False),
    "color_aug": ("bool", False),
    "alpha_mask": ("bool", False),
    "conditioning_data_dir": ("str", None),
    "enable_wildcard": ("bool", False),
    "secondary_separator": ("str", None),
    "token_warmup_min": ("int", 1),
    "token_warmup_step": ("number", 0),
    "custom_attributes": ("table", None),
}
DATASET_KEYS: dict[str, tuple[str, object]] = {
    "resolution": ("resolution", None),
    "batch_size": ("int", 1),
    "enable_bucket": ("bool", False),
    "min_bucket_reso": ("int", 256),
    "max_bucket_reso": ("int", 1024),
    "bucket_reso_steps": ("int", 64),
    "bucket_no_upscale": ("bool", False),
    "network_multiplier": ("number", 1.0),
}
ALIASES = {"caption_extention": "caption_extension"}  # sd-scripts' old spelling
SUBSET_ONLY = ("image_dir", "is_reg", "metadata_file", "conditioning_data_dir")  # sd-scripts' "distinct" subset keys: not inherited
RUN_OPTION = {"batch_size": "train_batch_size"}  # dataset key -> run option, where the names differ
# keys with a lower bound (the rates are checked by their type)
MINIMUM = {"num_repeats": 1, "keep_tokens": 0, "caption_dropout_every_n_epochs": 0, "batch_size": 1,
           "min_bucket_reso": 8, "max_bucket_reso": 8, "bucket_reso_steps": 1,
           "token_warmup_min": 0, "token_warmup_step": 0}
# custom_attributes keys sd-scripts reads (train_network.py: diff_output_preservation), with
# their types; any other key is an error naming it (sd-scripts would carry it and never read it)
CUSTOM_ATTRIBUTES = {"diff_output_preservation": "bool"}

# sd-scripts dataset keys this toolkit does not implement: accepted only at their "off" value
UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "face_crop_aug_range": ("face crop augmentation is not supported yet", (None,)),
    "cache_info": ("cache_info is not supported", (False,)),
    "validation_seed": ("validation is not supported yet", (None,)),
    "validation_split": ("validation splits are not supported yet", (0, 0.0)),
    "system_prompt": ("system prompts are not supported", (None, "")),
    "resize_interpolation": ("resize_interpolation is not supported yet", (None, "")),
}

@dataclass(frozen=True)
class CaptionOptions:
    """sd-scripts' caption processing settings of one subset (train_util.BaseSubset)."""
    shuffle_caption: bool = False
    caption_separator: str = ","
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    caption_prefix: str | None = None
    caption_suffix: str | None = None
    caption_dropout_rate: float = 0.0
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0
    # sd-scripts' {a|b} wildcards (drawn per sample and epoch; a caption file's lines are then
    # alternatives, one drawn), joined-tag separator, and token warmup (the first
    # token_warmup_min flexible tags, growing to all of them by token_warmup_step: a step count,
    # or a fraction of the run's steps when below 1)
    enable_wildcard: bool = False
    secondary_separator: str | None = None
    token_warmup_min: int = 1
    token_warmup_step: float = 0

    @property
    def is_identity(self) -> bool:
        return self == CaptionOptions(caption_separator=self.caption_separator,
                                      keep_tokens=self.keep_tokens,
                                      keep_tokens_separator=self.keep_tokens_separator,
                                      token_warmup_min=self.token_warmup_min)

    @property
    def draws(self) -> bool:
        """Whether the processed caption varies between draws (beyond caption dropout)."""
        return self.shuffle_caption or self.caption_tag_dropout_rate > 0 or self.enable_wildcard


CAPTION_FIELDS = ("shuffle_caption", "caption_separator", "keep_tokens", "keep_tokens_separator",
                  "caption_prefix", "caption_suffix", "caption_dropout_rate",
                  "caption_dropout_every_n_epochs", "caption_tag_dropout_rate", "enable_wildcard",
                  "secondary_separator", "token_warmup_min", "token_warmup_step")


class DatasetConfigError(DataError):
    """A bad dataset config: one line naming the file, the table and the key."""


@dataclass
class SubsetConfig:
    where: str                 # e.g. "datasets[0].subsets[1]"
    image_dir: str
    num_repeats: int
    caption_extension: str
    class_tokens: str | None
    is_reg: bool
    flip_aug: bool
    random_crop: bool
    captions: CaptionOptions
    color_aug: bool = False
    metadata_file: str | None = None  # a fine-tuning subset: images and captions from this file
    alpha_mask: bool = False  # masked loss from the images' alpha channel
    conditioning_data_dir: str | None = None  # masked loss from mask images of the same stem
    # sd-scripts' custom_attributes: {"diff_output_preservation": True} trains this subset toward
    # the model's own prediction with the network disabled (library/training/batch_loss.py)
    custom_attributes: dict = field(default_factory=dict)


@dataclass
class DatasetConfig:
    where: str                 # e.g. "datasets[0]"
    resolution: tuple[int, int]
    batch_size: int
    enable_bucket: bool
    min_bucket_reso: int
    max_bucket_reso: int
    bucket_reso_steps: int
    bucket_no_upscale: bool
    subsets: list[SubsetConfig]
    network_multiplier: float = 1.0  # the network's multiplier while this dataset's samples train


def _desc(v) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(v), type(v).__name__)
    return f"{kind} ({v!r})" if not isinstance(v, (dict, list)) else kind


def _convert(kind: str, v):
    """-> the value, or raises ValueError with the reason."""
    if kind == "bool":
        if isinstance(v, bool):
            return v
        raise ValueError(f"expected a boolean (true/false), got {_desc(v)}")
    if kind == "int":
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise ValueError(f"expected an integer, got {_desc(v)}")
    if kind == "rate":
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= 1:
            return float(v)
        raise ValueError(f"expected a number in [0, 1], got {_desc(v)}")
    if kind == "number":
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return v
        raise ValueError(f"expected a number, got {_desc(v)}")
    if kind == "table":
        if isinstance(v, dict):
            return dict(v)
        raise ValueError(f"expected a table (e.g. {{diff_output_preservation = true}}), got {_desc(v)}")
    if kind == "str":
        if isinstance(v, str):
            return v
        raise ValueError(f"expected a string, got {_desc(v)}")
    if kind == "resolution":
        try:
            return _to_resolution(v, False)
        except _Bad as e:
            raise ValueError(str(e)) from None
    raise AssertionError(kind)


class _Resolver:
    def __init__(self, path: str, opts: Options):
        self.path = path
        self.opts = opts

    def error(self, table: str, key: str | None, msg: str) -> DatasetConfigError:
        where = f"{table}.{key}" if key else table
        return DatasetConfigError(f"{self.path}: {where}: {msg}")

    def check_table(self, table: dict, where: str, allowed: set, *, level: str) -> dict:
        """Validate one table's keys and types; -> {canonical key: converted value}."""
        out = {}
        for raw_key, v in table.items():
            key = ALIASES.get(raw_key, raw_key)
            if key in ("subsets",) and level == "dataset":
                continue
            if key in UNSUPPORTED:
                why, off = UNSUPPORTED[key]
                if any(v is o or (type(v) is type(o) and v == o) for o in off):
                    continue  # set to its sd-scripts default: nothing to implement
                raise self.error(where, raw_key, f"not supported yet ({why})")
            if level != "subset" and key in SUBSET_ONLY:
                raise self.error(where, raw_key, "is a subset key: put it in a [[datasets.subsets]] table")
            if key not in allowed:
                if level == "subset" and key in DATASET_KEYS:
                    raise self.error(where, raw_key, "is a dataset key: put it in its [[datasets]] "
                                     "table or in [general]")
                if level != "subset" and key == "subsets":
                    raise self.error(where, raw_key, "subsets belong in a [[datasets]] table")
                known = list(SUBSET_KEYS) + list(DATASET_KEYS) + list(ALIASES)
                hint = difflib.get_close_matches(raw_key, known, n=1, cutoff=0.6)
                raise self.error(where, None, f"unknown key {raw_key!r}"
                                 + (f"; did you mean {hint[0]}?" if hint else ""))
            if key in out:
                raise self.error(where, raw_key, "given twice (also under its other spelling)")
            kind = (SUBSET_KEYS.get(key) or DATASET_KEYS[key])[0]
            try:
                val = _convert(kind, v)
            except ValueError as e:
                raise self.error(where, raw_key, str(e)) from None
            if key in MINIMUM and val < MINIMUM[key]:
                raise self.error(where, raw_key, f"{val} is out of range: must be >= {MINIMUM[key]}")
            if key == "custom_attributes":
                val = self.check_attributes(val, where)
            out[key] = val
        return out

    def check_attributes(self, attrs: dict, where: str) -> dict:
        """custom_attributes: the keys sd-scripts reads, each of its type; others are errors."""
        for k, v in attrs.items():
            if k not in CUSTOM_ATTRIBUTES:
                known = ", ".join(CUSTOM_ATTRIBUTES)
                raise self.error(where, f"custom_attributes.{k}", f"unknown attribute (sd-scripts "
                                 f"reads only {known}; another key would have no effect)")
            try:
                attrs[k] = _convert(CUSTOM_ATTRIBUTES[k], v)
            except ValueError as e:
                raise self.error(where, f"custom_attributes.{k}", str(e)) from None
        return attrs

    def run_value(self, key: str):
        name = RUN_OPTION.get(key, key)
        return getattr(self.opts, name) if self.opts is not None and name in vars(self.opts) else None

    def resolve(self, key: str, *levels: dict):
        for level in levels:
            if key in level:
                return level[key]
        v = self.run_value(key)
        if v is not None:
            return v
        return (SUBSET_KEYS.get(key) or DATASET_KEYS[key])[1]


def resolve_dataset_config(raw: dict, path: str | None, opts: Options) -> list[DatasetConfig]:
    """Validate ``opts.dataset_config`` (raw {"general", "datasets"}) and resolve every key."""
    path = path or "the run config"
    r = _Resolver(path, opts)
    all_keys = set(SUBSET_KEYS) | set(DATASET_KEYS)
    general = r.check_table(raw.get("general") or {}, "general", all_keys, level="general")
    datasets = raw.get("datasets") or []
    if not datasets:
        raise DatasetConfigError(f"{path}: the dataset config has no [[datasets]] table")
    out = []
    for di, ds in enumerate(datasets):
        dwhere = f"datasets[{di}]"
        dvals = r.check_table(ds, dwhere, all_keys, level="dataset")
        subsets = ds.get("subsets")
        if subsets is None or subsets == []:
            raise r.error(dwhere, None, "has no [[datasets.subsets]] table (each subset names an image_dir)")
        if not isinstance(subsets, list) or not all(isinstance(s, dict) for s in subsets):
            raise r.error(dwhere, "subsets", "must be an array of tables ([[datasets.subsets]])")
        res = {k: r.resolve(k, dvals, general) for k in DATASET_KEYS}
        if res["resolution"] is None:
            raise r.error(dwhere, "resolution", "is not set (in this dataset, in [general] or as the "
                          "run option resolution)")
        subs = []
        for si, sub in enumerate(subsets):
            swhere = f"{dwhere}.subsets[{si}]"
            svals = r.check_table(sub, swhere, set(SUBSET_KEYS), level="subset")
            v = {k: r.resolve(k, svals, dvals, general) for k in SUBSET_KEYS}
            if svals.get("metadata_file"):
                if not os.path.isfile(svals["metadata_file"]):
                    raise r.error(swhere, "metadata_file", f"file {svals['metadata_file']!r} does "
                                  "not exist")
            elif "image_dir" not in svals:
                raise r.error(swhere, "image_dir", "is required (the folder of this subset's images)")
            if v["image_dir"] is not None and not os.path.isdir(v["image_dir"]):
                raise r.error(swhere, "image_dir", f"folder {v['image_dir']!r} does not exist or is "
                              "not a directory")
            subs.append(SubsetConfig(
                where=swhere, image_dir=v["image_dir"], num_repeats=v["num_repeats"],
                caption_extension=v["caption_extension"], class_tokens=v["class_tokens"],
                is_reg=v["is_reg"], flip_aug=v["flip_aug"], random_crop=v["random_crop"],
                color_aug=v["color_aug"],
                captions=CaptionOptions(**{k: v[k] for k in CAPTION_FIELDS}),
                metadata_file=v["metadata_file"], alpha_mask=v["alpha_mask"],
                # the run option conditioning_data_dir masks training subsets, not reg images
                conditioning_data_dir=(svals.get("conditioning_data_dir") if v["is_reg"]
                                       else v["conditioning_data_dir"]) or None,
                custom_attributes=dict(v["custom_attributes"] or {})))
        out.append(DatasetConfig(where=dwhere, subsets=subs, **res))
    return out


def run_caption_options(opts: Options) -> CaptionOptions:
    """The caption settings of the run options (folder mode: train_data_dir / reg_data_dir)."""
    values: dict = {k: getattr(opts, k) if getattr(opts, k) is not None else SUBSET_KEYS[k][1]
                    for k in CAPTION_FIELDS}
    return CaptionOptions(**values)
