"""LECO prompt files (``prompts_file`` of train_leco.py), read as sd-scripts'
``library/leco_train_util.py`` (``load_prompt_settings``) reads them.

Two shapes, in TOML (sd-scripts) or YAML (the original LECO's prompt files, a list at the top):

* prompt pairs: ``[[prompts]]`` (or a top-level list, or ``targets`` whose entries have
  ``target``), each with ``target``, ``positive`` (default: target), ``unconditional`` (""),
  ``neutral`` (default: unconditional), ``action`` ("erase" / "enhance"), ``guidance_scale``,
  ``resolution`` (int or [h, w]), ``dynamic_resolution``, ``batch_size``, ``dynamic_crops``,
  ``multiplier``, ``weight``; top-level values of those keys are the defaults.
* slider targets: ``targets`` (at the top or under ``[slider]``) with ``target_class``,
  ``positive`` and/or ``negative``, ``multiplier``, ``resolution``/``resolutions``; the neutral
  prompts from ``neutral``, ``neutrals``, ``neutral_prompt_file`` or ``prompt_file`` (one prompt
  a line, relative to the prompt file). Each target becomes 4 settings (both prompts: erase the
  negative / enhance the positive at +multiplier, erase the positive / enhance the negative at
  -multiplier) or 2 (one prompt), per resolution and neutral prompt, as sd-scripts expands them.

An unknown key is an error naming it (sd-scripts drops it silently; a misspelt ``guidance_scale``
would silently train with 1.0).
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass

import yaml

from library.errors import UserError

PROMPT_KEYS = ("target", "positive", "unconditional", "neutral", "action", "guidance_scale",
               "resolution", "dynamic_resolution", "batch_size", "dynamic_crops", "multiplier",
               "weight")
SLIDER_KEYS = ("target_class", "positive", "negative", "neutral", "guidance_scale", "resolution",
               "resolutions", "dynamic_resolution", "batch_size", "dynamic_crops", "multiplier",
               "weight", "neutrals", "neutral_prompt_file", "prompt_file")
DEFAULTS = {"guidance_scale": 1.0, "resolution": 512, "dynamic_resolution": False, "batch_size": 1,
            "dynamic_crops": False, "multiplier": 1.0, "weight": 1.0}
TOP_KEYS = ("prompts", "targets", "slider", "neutrals", "neutral_prompt_file", "prompt_file",
            "target_class", "negative")


class PromptFileError(UserError, ValueError):
    """A LECO prompt file that cannot be read; one line naming the file and key."""


@dataclass(frozen=True)
class PromptSetting:
    target: str
    positive: str
    unconditional: str
    neutral: str
    action: str  # "erase" | "enhance"
    guidance_scale: float
    resolution: tuple  # (height, width)
    dynamic_resolution: bool
    batch_size: int
    dynamic_crops: bool
    multiplier: float
    weight: float

    def build_target(self, positive, neutral, unconditional):
        """sd-scripts' ``PromptSettings.build_target``: the prediction the network (on the target
        prompt) is trained toward, from the model's predictions with the network off."""
        offset = self.guidance_scale * (positive - unconditional)
        return neutral - offset if self.action == "erase" else neutral + offset


def _resolution(value, where: str) -> tuple:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or not all(isinstance(v, (int, float)) for v in value):
            raise PromptFileError(f"{where}: resolution must be a number or [height, width], got {value!r}")
        h, w = int(value[0]), int(value[1])
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        h = w = int(value)
    else:
        raise PromptFileError(f"{where}: resolution must be a number or [height, width], got {value!r}")
    if h < 64 or w < 64 or h % 8 or w % 8:
        raise PromptFileError(f"{where}: resolution {h}x{w} must be at least 64 and a multiple of 8")
    return h, w


def _setting(item: dict, where: str) -> PromptSetting:
    if "target" not in item:
        raise PromptFileError(f"{where}: no target prompt")
    action = item.get("action", "erase")
    if action not in ("erase", "enhance"):
        raise PromptFileError(f"{where}: action must be erase or enhance, got {action!r}")
    try:
        uncond = str(item.get("unconditional", "") or "")
        positive = item.get("positive")
        neutral = item.get("neutral")
        batch = int(item.get("batch_size", 1))
        s = PromptSetting(
            target=str(item["target"]), positive=str(item["target"] if positive is None else positive),
            unconditional=uncond, neutral=uncond if neutral is None else str(neutral), action=action,
            guidance_scale=float(item.get("guidance_scale", 1.0)),
            resolution=_resolution(item.get("resolution", 512), where),
            dynamic_resolution=bool(item.get("dynamic_resolution", False)), batch_size=batch,
            dynamic_crops=bool(item.get("dynamic_crops", False)),
            multiplier=float(item.get("multiplier", 1.0)), weight=float(item.get("weight", 1.0)))
    except (TypeError, ValueError) as e:
        raise PromptFileError(f"{where}: {e}") from None
    if s.batch_size < 1:
        raise PromptFileError(f"{where}: batch_size must be at least 1")
    return s


def _check_keys(item, allowed, where: str) -> dict:
    if not isinstance(item, dict):
        raise PromptFileError(f"{where}: expected a table of prompt settings, got {type(item).__name__}")
    for k in item:
        if k not in allowed:
            raise PromptFileError(f"{where}: unknown key {k!r} (known: {', '.join(allowed)})")
    return item


def _lines(base_dir: str, name: str, where: str) -> list[str]:
    path = os.path.join(base_dir, name)
    try:
        with open(path, encoding="utf-8") as f:
            return [ln.strip() for ln in f if ln.strip()]
    except OSError as e:
        raise PromptFileError(f"{where}: cannot read {path}: {e.strerror}") from None


def _expand_slider(item: dict, neutral: str, where: str) -> list[PromptSetting]:
    positive = str(item.get("positive", "") or "")
    negative = str(item.get("negative", "") or "")
    m = float(item.get("multiplier", 1.0))
    if not positive.strip() and not negative.strip():
        raise PromptFileError(f"{where}: a slider target needs a positive or a negative prompt")
    res = item.get("resolutions", item.get("resolution", 512))
    resolutions = res if isinstance(res, list) and res and isinstance(res[0], (list, tuple)) else [res]
    if positive.strip() and negative.strip():
        pairs = [(negative, positive, "erase", m), (positive, negative, "enhance", m),
                 (positive, negative, "erase", -m), (negative, positive, "enhance", -m)]
    elif negative.strip():
        pairs = [(negative, "", "erase", m), (negative, "", "enhance", -m)]
    else:
        pairs = [(positive, "", "enhance", m), (positive, "", "erase", -m)]
    base = {k: item[k] for k in ("guidance_scale", "dynamic_resolution", "batch_size",
                                 "dynamic_crops", "weight") if k in item}
    out = []
    for r in resolutions:
        for pos, uncond, action, mult in pairs:
            out.append(_setting(dict(base, target=str(item.get("target_class", "")), neutral=neutral,
                                     positive=pos, unconditional=uncond, action=action,
                                     resolution=r, multiplier=mult), where))
    return out


def _neutrals(item: dict, base_dir: str, where: str, fallback: list[str]) -> list[str]:
    if "neutrals" in item:
        return [str(v) for v in item["neutrals"]]
    for key in ("neutral_prompt_file", "prompt_file"):
        if key in item:
            return _lines(base_dir, item[key], f"{where}.{key}")
    if "neutral" in item:
        return [str(item["neutral"] or "")]
    return fallback


def read_prompt_file(path: str) -> list[PromptSetting]:
    """The prompt settings of ``path`` (.toml, or .yaml / .yml), in file order."""
    data = _read(path)
    if not data:
        raise PromptFileError(f"prompts_file {path}: the file is empty")
    base_dir = os.path.dirname(os.path.abspath(path))
    out: list[PromptSetting] = []
    if isinstance(data, list):  # the original LECO: a YAML list of prompt settings
        data = {"prompts": data}
    if "prompts" in data:
        top = _check_keys({k: v for k, v in data.items() if k != "prompts"}, PROMPT_KEYS,
                          f"prompts_file {path}")
        for n, item in enumerate(data["prompts"]):
            where = f"prompts_file {path}: prompts[{n}]"
            if isinstance(item, dict) and "target_class" in item:
                item = _check_keys(item, SLIDER_KEYS, where)
                merged = {**{k: v for k, v in {**DEFAULTS, **top}.items() if k in SLIDER_KEYS}, **item}
                for neutral in _neutrals(item, base_dir, where, [str(item.get("neutral", "") or "")]):
                    out += _expand_slider(merged, neutral, where)
            else:
                out.append(_setting({**DEFAULTS, **top, **_check_keys(item, PROMPT_KEYS, where)}, where))
        return _nonempty(out, path)
    slider = data.get("slider", data)
    targets = slider.get("targets")
    if targets is None:
        if "target_class" in slider or "target" in slider:
            targets = [slider]
        else:
            raise PromptFileError(f"prompts_file {path}: neither [[prompts]] nor slider targets")
    if not isinstance(targets, list) or not targets:
        raise PromptFileError(f"prompts_file {path}: targets is empty")
    if isinstance(targets[0], dict) and "target" in targets[0]:
        top = {k: v for k, v in slider.items() if k in PROMPT_KEYS}
        for n, item in enumerate(targets):
            where = f"prompts_file {path}: targets[{n}]"
            out.append(_setting({**DEFAULTS, **top, **_check_keys(item, PROMPT_KEYS, where)}, where))
        return _nonempty(out, path)
    top = {k: v for k, v in slider.items() if k in SLIDER_KEYS and k != "targets"}
    for k in slider:
        if k not in SLIDER_KEYS and k not in TOP_KEYS:
            raise PromptFileError(f"prompts_file {path}: unknown key {k!r}")
    neutrals = _neutrals(slider, base_dir, f"prompts_file {path}", [""])
    for n, item in enumerate(targets):
        where = f"prompts_file {path}: targets[{n}]"
        item = _check_keys(item, SLIDER_KEYS, where)
        merged = {**{k: v for k, v in {**DEFAULTS, **top}.items() if k in SLIDER_KEYS}, **item}
        for neutral in _neutrals(item, base_dir, where, neutrals):
            out += _expand_slider(merged, neutral, where)
    return _nonempty(out, path)


def _nonempty(out: list, path: str) -> list:
    if not out:
        raise PromptFileError(f"prompts_file {path}: no prompt settings")
    return out


def _read(path: str):
    if not os.path.isfile(path):
        raise PromptFileError(f"prompts_file: no such file: {path}")
    if path.lower().endswith((".yaml", ".yml")):
        try:
            with open(path, encoding="utf-8") as f:
                return yaml.safe_load(f)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark is not None else ""
            raise PromptFileError(f"prompts_file {path}: not valid YAML{at} "
                                  f"({getattr(e, 'problem', None) or type(e).__name__})") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise PromptFileError(f"prompts_file {path}: not valid TOML ({e})") from None
