"""A kohya_ss GUI config (the TOML it writes for a run, or the JSON it saves / ships as a preset)
-> a run TOML of this toolkit, with one note per key that is dropped or means something
different here.

    import_config(text, script) -> (toml_text, notes)

Each key is classified by the schema's own tables (library/config/options.py: OPTIONS, ALIASES,
SD_SCRIPTS_NAMES, GUI_KEYS), the same tables the parser and docs/KOHYA_GUI.md use:
- an option of ``script``: kept (aliases under the option's name), with the GUI table's note when
  it has one;
- an sd-scripts option or GUI-only key with no effect here: dropped, noted with why;
- one that cannot be honoured (another model family, an unsupported feature): dropped when unset,
  else dropped and noted, so that the rest still imports and the user sees what is missing;
- an unknown key: dropped, noted with the closest option name.
The GUI's saved JSON uses its field names for a few keys (``optimizer``, ``max_resolution``,
``lr_warmup`` in percent, ``LoRA_type``, ``xformers`` as a choice, ``sdxl``): those are translated
as the GUI does when it writes the TOML (kohya_gui/lora_gui.py ``train_model``); a LyCORIS
``LoRA_type`` is noted, not translated (its network_args are set by hand).
"""
from __future__ import annotations

import difflib
import json
import tomllib

import toml

from library.config.options import (ALIASES, GUI_KEYS_BY_NAME, GUI_ONLY, OPTIONS_BY_NAME,
                                    SD_SCRIPTS_BY_NAME)
from library.errors import UserError

DATASET_KEYS = ("general", "datasets")


class ImportError_(UserError):
    pass


def _unset(v) -> bool:
    """The GUI's "not set": an empty string, None or false."""
    return v is None or v is False or v == ""


def _json_fields(d: dict, notes: list) -> dict:
    """The GUI's saved field names -> the TOML keys it writes for them."""
    d = dict(d)
    if "optimizer" in d:
        d["optimizer_type"] = d.pop("optimizer")
    if "max_resolution" in d:
        d["resolution"] = d.pop("max_resolution")
    if "lr_warmup" in d:
        pct = d.pop("lr_warmup")
        try:
            pct = float(pct or 0)
        except (TypeError, ValueError):
            pct = 0.0
        if pct and not d.get("lr_warmup_steps"):
            d["lr_warmup_steps"] = pct / 100  # a fraction of all steps, as the GUI computes
            notes.append(f"lr_warmup: {pct:g} % of the steps -> lr_warmup_steps = {pct / 100:g}")
    if "xformers" in d and isinstance(d["xformers"], str):
        choice = d.pop("xformers")
        if choice == "xformers":
            d["xformers"] = True
        elif choice == "sdpa":
            d["sdpa"] = True
    for k in ("sdxl", "sdxl_checkbox"):
        if k in d:
            d.pop(k)
            notes.append(f"{k}: dropped; the model family is read from the weights")
    lora_type = d.pop("LoRA_type", None)
    if lora_type in ("Standard", None, ""):
        if lora_type:
            d.setdefault("network_module", "networks.lora")
    else:
        notes.append(f"LoRA_type {lora_type!r}: not translated; set network_module = "
                     "\"lycoris.kohya\" and network_args (algo=...) by hand (docs/NETWORK_OPTIONS.md)")
    if "lora_network_weights" in d:
        d["network_weights"] = d.pop("lora_network_weights")
    return d


def import_config(text: str, script: str) -> tuple[str, list[str]]:
    text = text.strip()
    if not text:
        raise ImportError_("text: empty; paste a kohya_ss GUI config (JSON or TOML)")
    notes: list[str] = []
    from_json = text.startswith("{")
    if from_json:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ImportError_(f"text: invalid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ImportError_("text: expected a JSON object of GUI fields")
        data = _json_fields(data, notes)
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ImportError_(f"text: invalid TOML: {e}") from None
    flat: dict = {}
    for key, value in data.items():
        if key in DATASET_KEYS:
            continue
        if isinstance(value, dict) and not (OPTIONS_BY_NAME.get(ALIASES.get(key, key))
                                            and OPTIONS_BY_NAME[ALIASES.get(key, key)].type.startswith("kv")):
            flat.update(value)  # a free-form grouping table ([model_arguments], ...)
        else:
            flat[key] = value
    out: dict = {}
    for key, value in flat.items():
        name = ALIASES.get(key, key)
        gui = GUI_KEYS_BY_NAME.get(key)
        if name in OPTIONS_BY_NAME:
            opt = OPTIONS_BY_NAME[name]
            if _unset(value) and opt.type in ("path", "str", "path_list") or value is None:
                continue  # the GUI's empty field
            if from_json and value == 0 and not isinstance(value, bool) and opt.default is None:
                continue  # the GUI writes its 0 fields as unset (`value or None`)
            if script not in opt.scripts:
                notes.append(f"{key}: dropped; not an option of {script} (it applies to: "
                             f"{', '.join(opt.scripts)})")
                continue
            if opt.cli_only:
                notes.append(f"{key}: dropped; command line only")
                continue
            out[name] = value
            if key != name:
                notes.append(f"{key}: written as {name}")
            if gui is not None and gui.why:
                notes.append(f"{key}: {gui.why}")
        elif name in SD_SCRIPTS_BY_NAME:
            entry = SD_SCRIPTS_BY_NAME[name]
            off = value in entry.off or _unset(value) or value == []
            if not off:
                what = "no effect here" if entry.action == "ignore" else "not supported yet"
                notes.append(f"{key}: dropped; {what} ({entry.why})")
        elif key in GUI_ONLY:
            entry = GUI_ONLY[key]
            if not _unset(value) and not (isinstance(value, (int, float)) and value == 0):
                what = "no effect" if entry.action == "ignore" else "cannot be used here"
                notes.append(f"{key}: dropped; {what} ({entry.why})")
        else:
            if from_json and (_unset(value) or value == 0):
                continue  # a GUI form field left empty (the GUI's JSON holds every field)
            cands = list(OPTIONS_BY_NAME) + list(ALIASES)
            hint = difflib.get_close_matches(key, cands, n=1, cutoff=0.6)
            notes.append(f"{key}: dropped; unknown key" + (f" (did you mean {hint[0]}?)" if hint else ""))
    for k in DATASET_KEYS:
        if k in data:
            out[k] = data[k]
    return toml.dumps(out), notes
