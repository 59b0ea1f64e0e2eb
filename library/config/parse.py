"""argv + `--config run.toml` -> validated `Options`, generated from `library.config.options`.

    opts = parse_args("train_lora", sys.argv[1:])   # raises ConfigError (one-line message)
    opts.network_dim, opts.resolution (w, h), opts.optimizer_args (dict), opts.given, opts.to_dict()
    opts.replace(train_batch_size=2)                 # a copy: Options are frozen

`Options` is a frozen dataclass generated from the schema: every option is a field with its
type and default, so code reads `opts.name` and no module repeats a default.

Rules (see docs/OPTIONS.md):
- Tables in a run TOML are free-form grouping, except `general` and `datasets`, which are the
  dataset config; they are kept raw on `opts.dataset_config` for the data pipeline. A separate
  `dataset_config` file is loaded the same way. Only one of the two may be given.
- The command line overrides the file. Relative paths are relative to the current directory,
  as in sd-scripts (a config is usually run from the project folder it was written for).
- Unknown names, a name given twice in one file, wrong types, out-of-range values, unsupported
  sd-scripts options and incompatible combinations are errors naming the key, the file and line.

No heavy imports here: `--help` prints in well under a second.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import logging
import math
import os
import re
import sys
import tomllib
from dataclasses import dataclass
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any, TypeVar

from library import text_files
from library.config.options import (ALIASES, GUI_ONLY, OPTIONS, OPTIONS_BY_NAME, Option, SCRIPTS,
                                    SD_SCRIPTS_BY_NAME, SD_SCRIPTS_NAMES, SECRET_OPTIONS, SECTIONS,
                                    SdScriptsName, options_for)
from library.errors import UserError

logger = logging.getLogger("sdtk")

DATASET_KEYS = ("general", "datasets")
_SD_DEST = "sdscripts:"  # argparse dest prefix of sd-scripts names we do not implement


class ConfigError(UserError):
    """Bad options or config file. The message is one line naming the file/key/option."""


T = TypeVar("T")


def required(value: T | None, name: str) -> T:
    """The value of option ``name`` where the run needs it set (the parser's checks and the
    plan set it before; a direct caller that did not gets one line naming the option)."""
    if value is None:
        raise ConfigError(f"{name} is required here")
    return value


class _Bad(Exception):
    """A value problem; the caller prefixes where the value came from."""


# ----------------------------------------------------------------------------------------------
# Options object


# Python types of the schema's value types (library/config/options.py Option.type).
_TYPES = {"str": str, "path": str, "int": int, "float": float, "bool": bool,
          "resolution": tuple[int, int], "kv_literal": dict[str, Any], "kv_str": dict[str, str],
          "float_or_list": float | list[float], "steps_or_fraction": int | float,
          "path_list": list[str], "float_list": list[float], "str_list": list[str],
          "int_list": list[int]}

def field_type(o: Option):
    """The annotation of option `o`'s field: its value type, or None where it may be unset. Dict
    options are always dicts (unset is {}); `dataset_config` holds the loaded tables, not the
    file name (that is `dataset_config_path`)."""
    if o.name == "dataset_config":
        return dict | None
    t = _TYPES[o.type]
    return t if o.type.startswith("kv") or o.default is not None else t | None


def field_default(o: Option):
    """The value an unset option has in Options: its schema default ({} for dict options)."""
    return {} if o.type.startswith("kv") and o.default is None else o.default


class _OptionsMethods:
    """What Options adds to its generated fields (see `Options` below)."""

    def __getattr__(self, name):  # only called for missing attributes: say what was meant
        if name.startswith("__"):
            raise AttributeError(name)
        hint = difflib.get_close_matches(name, list(OPTIONS_BY_NAME), n=1)
        raise AttributeError(f"no option {name!r}" + (f"; did you mean {hint[0]}?" if hint else ""))

    def replace(self, **changes):
        """A copy with `changes` (values resolved after parsing: the dataset config's batch size
        and resolution, a DeepSpeed launch's options). The options are frozen: a run that
        resolves a value holds the returned copy."""
        bad = [k for k in changes if k not in Options.__dataclass_fields__]
        if bad:
            getattr(self, bad[0])  # raises the "no option ...; did you mean" error
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The run as a plain dict that is itself a valid run config (TOML-serialisable: unset
        values are left out, tuples become lists; the dataset config is inlined as
        general/datasets)."""
        out = {}
        for o in options_for(self.script):
            if o.name in ("config", "dataset_config") or o.name in SECRET_OPTIONS:  # never saved
                continue
            v = getattr(self, o.name)
            if v is None or v == {}:
                continue
            out[o.name] = _plain(v)
        if self.dataset_config:
            for k in DATASET_KEYS:
                if self.dataset_config.get(k):
                    out[k] = _plain(self.dataset_config[k])
        return out

    def __repr__(self):
        vals = ", ".join(f"{o.name}={'***' if o.name in SECRET_OPTIONS and getattr(self, o.name) else repr(getattr(self, o.name))}"
                         for o in options_for(self.script))
        return f"Options(script={self.script!r}, {vals})"


def _fields() -> list:
    fs: list[tuple] = [("script", str),
          ("given", frozenset[str], dataclasses.field(default=frozenset())),
          ("dataset_config_path", str | None, dataclasses.field(default=None)),
          ("ignored", dict[str, Any], dataclasses.field(default_factory=dict))]
    for o in OPTIONS:
        d = field_default(o)
        f = dataclasses.field(default_factory=dict) if isinstance(d, dict) else dataclasses.field(default=d)
        fs.append((o.name, field_type(o), f))
    return fs


# Generated from the schema, so a new option is a field with its type and default: code reads
# `opts.name`, never getattr with a default of its own. Frozen: a value derived after parsing
# is set with `replace` on a new copy, so no module changes the options another one holds.
# Pickles by name (DataLoader workers, spawned processes).
# Type checkers and editors see the same class declared field by field in options_static.pyi
# (generated from the schema by library/config/options_stub.py; a test keeps them equal).
if TYPE_CHECKING:
    from library.config.options_static import Options
else:
    Options = dataclasses.make_dataclass(
        "Options", _fields(), bases=(_OptionsMethods,), frozen=True, kw_only=True, repr=False)
    Options.__module__ = __name__  # make_dataclass takes `module=` only from Python 3.12
    Options.__doc__ = """The resolved options of one run (frozen): every schema option is a field
    (options the script does not accept keep their defaults), plus `script`, `given` (names the
    user set explicitly), `config` (run file path or None), `dataset_config` (raw {"general",
    "datasets"} dict or None), `dataset_config_path` and `ignored` (sd-scripts names accepted with
    no effect -> value)."""


def options_from_values(script: str, values: dict) -> Options:
    """Options of `script` from {name: value}, each value read as the same key in a run file
    (so typed, range- and choice-checked, dict options from tables; a tuple as a list; None is
    unset), names checked against the script; the required options and combinations are not
    (tests build the few options a unit needs). `dataset_config` takes the tables themselves."""
    resolved = {o.name: field_default(o) for o in OPTIONS}
    dataset_config = values.get("dataset_config")
    for key, raw in values.items():
        name = ALIASES.get(key, key)
        opt = OPTIONS_BY_NAME.get(name)
        if opt is None or script not in opt.scripts:
            raise _unknown(_Src(path="options_from_values", key=key), key, script)
        if name == "dataset_config" or raw is None:
            continue
        try:
            resolved[name] = _convert(opt, _plain(raw), False, script)
        except _Bad as e:
            raise ConfigError(f"options_from_values: {key}: {e}") from None
    resolved["dataset_config"] = dataset_config
    given = {ALIASES.get(k, k) for k in values}
    return Options(script=script, given=frozenset(given), **resolved)


def _plain(v):
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


# ----------------------------------------------------------------------------------------------
# where a value came from


@dataclass(frozen=True)
class _Src:
    path: str | None = None  # None: the command line
    line: int | None = None
    key: str = ""            # the name as written (may be an alias)
    table: str | None = None

    def where(self) -> str:
        if self.path is None:
            return f"--{self.key}"
        return f"{self.path}:{self.line}: {self.key}" if self.line else f"{self.path}: {self.key}"

    def at(self) -> str:
        if self.path is None:
            return "on the command line"
        t = f" in [{self.table}]" if self.table else " at the top level"
        return f"at line {self.line}{t}" if self.line else t.strip()


_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")


def _find_line(text: str, key: str, table: str | None) -> int | None:
    """Line number of `key = ...` inside `[table]` (None: top level), by scanning the text."""
    k = re.escape(key)
    pat = re.compile(rf"""^\s*(?:{k}|"{k}"|'{k}')\s*=""")
    current = None
    for i, line in enumerate(text.splitlines(), 1):
        m = _HEADER.match(line)
        if m:
            current = m.group(1).strip().strip("\"'")
            continue
        if current == table and pat.match(line):
            return i
    return None


# ----------------------------------------------------------------------------------------------
# value conversion (one code path for the command line (strings) and TOML (typed values))

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _desc(v) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(v), type(v).__name__)
    return f"{kind} ({v!r})" if not isinstance(v, (dict, list)) or len(repr(v)) < 60 else kind


def _to_bool(v, cli):
    if isinstance(v, bool):
        return v
    if cli and isinstance(v, str):
        s = v.strip().lower()
        if s in _TRUE or s in _FALSE:
            return s in _TRUE
        raise _Bad(f"expected true or false, got {v!r}")
    raise _Bad(f"expected a boolean (true/false), got {_desc(v)}")


def _to_int(v, cli):
    if cli and isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            raise _Bad(f"expected an integer, got {v!r}") from None
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    raise _Bad(f"expected an integer, got {_desc(v)}")


def _to_float(v, cli):
    if cli and isinstance(v, str):
        try:
            f = float(v.strip())
        except ValueError:
            raise _Bad(f"expected a number, got {v!r}") from None
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
        f = float(v)
    else:
        raise _Bad(f"expected a number, got {_desc(v)}")
    if not math.isfinite(f):
        raise _Bad(f"expected a finite number, got {v!r}")
    return f


def _to_str(v, cli):
    if isinstance(v, str):
        return v
    raise _Bad(f"expected a string, got {_desc(v)}")


def _to_resolution(v, cli):
    bad = _Bad(f"expected 'size' or 'width,height' (e.g. 512 or \"512,768\" or [512, 768]), got {_desc(v)}")
    if isinstance(v, bool):
        raise bad
    if isinstance(v, int):
        parts = [v, v]
    elif isinstance(v, str):
        try:
            parts = [int(p.strip()) for p in v.split(",")]
        except ValueError:
            raise bad from None
    elif isinstance(v, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in v):
        parts = list(v)
    else:
        raise bad
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2:
        raise bad
    w, h = parts
    if w <= 0 or h <= 0:
        raise _Bad(f"{w}x{h}: width and height must be positive")
    # Not a multiple of 8 is allowed, as sd-scripts: with buckets the resolution is only the
    # bucket area; without, images are cropped to it and the VAE's latent covers w//8 x h//8
    # blocks (config.resolution_notes says so in one line).
    return (w, h)


def _literal(s: str):
    """optimizer_args values are Python literals (sd-scripts: ast.literal_eval); else a string."""
    try:
        return ast.literal_eval(s)
    except (ValueError, SyntaxError):
        low = s.lower()
        return (low == "true") if low in ("true", "false") else s


def _tuplify(v):
    return tuple(_tuplify(x) for x in v) if isinstance(v, list) else v


def _kv_value_str(k, v) -> str:
    # network_args reach the network module as strings (sd-scripts passes them unparsed)
    if isinstance(v, list):
        return ",".join(_kv_value_str(k, x) for x in v)
    if isinstance(v, (bool, int, float, str)):
        return str(v)
    raise _Bad(f"key {k!r}: expected a string, number, boolean or list, got {_desc(v)}")


def _to_kv(v, cli, literal: bool, name: str = ""):
    pairs = []
    if isinstance(v, dict):
        for k, x in v.items():
            if literal:
                pairs.append((k, _literal(x) if isinstance(x, str) else _tuplify(x)))
            else:
                pairs.append((k, _kv_value_str(k, x)))
    else:
        if isinstance(v, str):
            items = v.split()
        elif isinstance(v, list) and all(isinstance(x, str) for x in v):
            items = v
        else:
            raise _Bad(f"expected a list of 'key=value' strings or a table, got {_desc(v)}")
        for item in items:
            k, sep, x = item.partition("=")
            if not sep or not k.strip():
                raise _Bad(f"expected key=value, got {item!r}")
            x = x.strip()
            pairs.append((k.strip(), _literal(x) if literal else x))
    out: dict[str, object] = {}
    for k, x in pairs:
        if k in out and out[k] != x:
            logger.warning("%s: key %r given twice (%r, then %r): the last value wins, as in "
                           "sd-scripts", name, k, out[k], x)
        out[k] = x  # sd-scripts builds a dict: the last value wins (the GUI writes use_tucker twice)
    return out


def _to_float_or_list(v, cli):
    if cli and isinstance(v, list):
        vals = [_to_float(x, True) for x in v]
    elif isinstance(v, list):
        vals = [_to_float(x, False) for x in v]
    else:
        vals = [_to_float(v, cli)]
    if not vals:
        return None
    if len(vals) > 2:
        raise _Bad(f"expected one value or one per text encoder (at most 2), got {len(vals)}")
    return vals[0] if len(vals) == 1 else vals


def _to_steps_or_fraction(v, cli):
    msg = "expected a number of steps, or a fraction of all steps below 1 (or 'N%')"
    if isinstance(v, str):
        s = v.strip()
        try:
            if s.endswith("%"):
                v = float(s[:-1]) / 100.0
                if not 0 <= v < 1:
                    raise _Bad(f"{s}: a percentage must be in [0%, 100%)")
            else:
                v = int(s) if re.fullmatch(r"[+-]?\d+", s) else float(s)
        except ValueError:
            raise _Bad(f"{msg}, got {s!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Bad(f"{msg}, got {_desc(v)}")
    if isinstance(v, float):
        if 0 < v < 1:
            return v
        if not v.is_integer():
            raise _Bad(f"{v}: a fraction must be below 1; a number of steps must be whole")
        return int(v)
    return v


def _to_path_list(v, cli):
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise _Bad(f"expected a list of paths, got {_desc(v)}")
    return [x for x in items if x] or None


def _to_str_list(v, cli):
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise _Bad(f"expected a list of strings, got {_desc(v)}")
    return [x for x in items if x] or None


def _to_int_list(v, cli):
    items = v if isinstance(v, list) else [v]
    return [_to_int(x, cli) for x in items] or None


def _to_float_list(v, cli):
    if isinstance(v, str) or (cli and isinstance(v, list)):
        parts = [p for s in ([v] if isinstance(v, str) else v) for p in s.replace(",", " ").split()]
        vals = [_to_float(p, True) for p in parts]
    elif isinstance(v, list):
        vals = [_to_float(x, False) for x in v]
    else:
        vals = [_to_float(v, cli)]
    return vals or None


_CONVERTERS = {
    "str": _to_str, "path": _to_str, "int": _to_int, "float": _to_float, "bool": _to_bool,
    "resolution": _to_resolution, "float_or_list": _to_float_or_list,
    "steps_or_fraction": _to_steps_or_fraction, "path_list": _to_path_list, "float_list": _to_float_list,
    "str_list": _to_str_list, "int_list": _to_int_list,
}


def _convert(opt: Option, raw, cli: bool, script: str):
    if isinstance(raw, str) and raw == "" and opt.type in ("path", "str") and opt.default is None:
        return None  # sd-scripts GUIs write "" for an unset path
    if opt.name == "persistent_data_loader_workers" and type(raw) is int and raw in (0, 1):
        raw = bool(raw)  # the kohya_ss GUI writes this switch as 0 / 1
    if opt.type in ("kv_literal", "kv_str"):
        v = _to_kv(raw, cli, opt.type == "kv_literal", opt.name)
    else:
        v = _CONVERTERS[opt.type](raw, cli)
    if opt.name == "optimizer_type" and v == "":
        v = "AdamW"  # sd-scripts: "" means the default optimizer
    choices = opt.choices_for(script)
    if choices is not None and v is not None and v not in choices:
        hint = difflib.get_close_matches(str(v), list(map(str, choices)), n=1)
        raise _Bad(f"{v!r} is not one of: {', '.join(map(str, choices))}" + (f" (did you mean {hint[0]}?)" if hint else ""))
    if opt.name == "scale_weight_norms" and v == 0:
        v = None  # sd-scripts and the kohya_ss GUI: 0 is off (one spelling for the resume check)
    if opt.name == "max_token_length" and v == 75:
        v = None  # 75 tokens is the default (sd-scripts' None): one spelling for keys and resume checks
    for x in (v if isinstance(v, list) else [v]):
        if isinstance(x, (int, float)) and not isinstance(x, bool) and not _in_range(opt, x):
            raise _Bad(f"{x} is out of range: must be {opt.range_text()}")
    return v


def _in_range(opt: Option, x) -> bool:
    if opt.min is not None and (x < opt.min or (opt.min_exclusive and x == opt.min)):
        return False
    if opt.max is not None and (x > opt.max or (opt.max_exclusive and x == opt.max)):
        return False
    return True


def _is_off(entry: SdScriptsName, v) -> bool:
    """True when an sd-scripts-only option is set to its sd-scripts default (= not used)."""
    if isinstance(v, list):
        v = tuple(v)
    if entry.kind == "flag" and isinstance(v, str):
        s = v.strip().lower()
        if s not in _TRUE and s not in _FALSE:
            raise _Bad(f"expected true or false, got {v!r}")
        v = s in _TRUE
    for off in entry.off:
        if v == off and isinstance(v, bool) == isinstance(off, bool) or (v is None and off is None):
            return True
        if isinstance(off, (int, float)) and not isinstance(off, bool):
            try:
                if not isinstance(v, bool) and float(v) == off:
                    return True
            except (TypeError, ValueError):
                pass
    return False


# ----------------------------------------------------------------------------------------------
# argparse, generated from the schema


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump, no sys.exit
        raise ConfigError(message)


def _help_text(o: Option, script: str) -> str:
    parts = [o.help]
    choices = o.choices_for(script)
    if choices:
        parts.append(f"Choices: {', '.join(map(str, choices))}.")
    elif o.range_text():
        parts.append(f"Allowed: {o.range_text()}.")
    if o.default is not None and o.type != "path":
        d = str(o.default).lower() if isinstance(o.default, bool) else o.default
        parts.append(f"Default: {d}.")
    return " ".join(parts).replace("%", "%%")


_METAVAR = {"int": "N", "float": "X", "path": "PATH", "str": "TEXT", "resolution": "W[,H]",
            "steps_or_fraction": "N|FRACTION"}


def build_parser(script: str, entry: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser of one entry script (``entry``: the sd-scripts script name it runs as,
    which --help shows). Every default is SUPPRESS, so the parsed namespace holds exactly the
    options given on the command line."""
    prog = entry or f"{script}.py"
    p = _Parser(prog=prog, allow_abbrev=False,
                usage=f"{prog} [-h] [--config RUN.toml] [--OPTION VALUE ...]",
                description=f"{prog}{f' (runs {script}.py)' if entry else ''}: options by sd-scripts' names. A run TOML (--config) may set "
                            "any of them; command-line flags override it. Boolean flags take an "
                            "optional value: --flag, --flag=false.",
                epilog="sd-scripts option names that are accepted with no effect, or rejected as not "
                       "supported yet, are listed in docs/OPTIONS.md.")
    groups = {sec: p.add_argument_group(title) for sec, title in SECTIONS.items()}
    for o in options_for(script):
        kw: dict[str, object] = dict(dest=o.name, default=argparse.SUPPRESS, help=_help_text(o, script))
        if o.type == "bool":
            kw.update(nargs="?", const="true", metavar="BOOL")
        elif o.type in ("kv_literal", "kv_str"):
            kw.update(nargs="*", metavar="KEY=VALUE")
        elif o.type == "float_or_list":
            kw.update(nargs="*", metavar="LR")
        elif o.type in ("path_list", "float_list", "str_list", "int_list"):
            kw.update(nargs="*", metavar={"path_list": "PATH", "str_list": "WORD"}.get(o.type, "X"))
        else:
            kw.update(metavar=_METAVAR[o.type])
        groups[o.section].add_argument(f"--{o.name}", *(f"--{a}" for a in o.aliases),
                                       **kw)  # type: ignore[arg-type]  # argparse's keywords, by name
    for n in SD_SCRIPTS_NAMES:  # accepted for compatibility, hidden from --help
        nargs = {"flag": "?", "value": None, "list": "*"}[n.kind]
        sd_kw: dict[str, object] = dict(dest=_SD_DEST + n.name, default=argparse.SUPPRESS,
                                        help=argparse.SUPPRESS, nargs=nargs)
        if n.kind == "flag":
            sd_kw["const"] = "true"
        p.add_argument(f"--{n.name}", **sd_kw)  # type: ignore[arg-type]  # argparse's keywords, by name
    return p


def _suggest(name: str, script: str) -> str:
    cands = [o.name for o in options_for(script)] + [a for o in options_for(script) for a in o.aliases]
    cands += list(SD_SCRIPTS_BY_NAME)
    hint = difflib.get_close_matches(name.replace("-", "_"), cands, n=1, cutoff=0.6)
    return f"; did you mean {hint[0]}?" if hint else ""


def _unknown(src: _Src, name: str, script: str) -> ConfigError:
    canonical = ALIASES.get(name, name)
    if canonical in OPTIONS_BY_NAME:
        scripts = ", ".join(OPTIONS_BY_NAME[canonical].scripts)
        return ConfigError(f"{src.where()}: option {name} is not accepted by {script} (it applies to: {scripts})")
    return ConfigError(f"{src.where()}: unknown option {name!r}{_suggest(name, script)}")


# ----------------------------------------------------------------------------------------------
# TOML files


def _read_toml(path: str, what: str) -> tuple[str, dict]:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{what}: no such file: {path}") from None
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path}: {e.strerror}") from None

    text = text_files.decode(raw, path, ConfigError)  # TOML is UTF-8 by definition
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def _load_run_file(path: str, script: str):
    """-> (the path read, {name: (raw, src)} for schema options, {name: (raw, src)} for
    sd-scripts-only names, {name: (raw, src)} for kohya_ss GUI-only keys, {"general"/"datasets": raw})."""
    if not os.path.exists(path) and not path.endswith(".toml") and os.path.exists(path + ".toml"):
        path += ".toml"  # sd-scripts appends .toml to --config_file
    text, data = _read_toml(path, "config")
    values: dict[str, object] = {}
    sd_names: dict[str, object] = {}
    gui_names: dict[str, object] = {}
    dataset: dict[str, object] = {}

    def add(key, raw, table):
        src = _Src(path, _find_line(text, key, table), key, table)
        name = ALIASES.get(key, key)
        if name in OPTIONS_BY_NAME:
            opt = OPTIONS_BY_NAME[name]
            if script not in opt.scripts:
                raise _unknown(src, key, script)
            if opt.cli_only:
                raise ConfigError(f"{src.where()}: {key} can only be given on the command line")
            target = values
        elif name in SD_SCRIPTS_BY_NAME:
            target = sd_names
        elif name in GUI_ONLY:  # a key only the kohya_ss GUI writes (a file key, no flag)
            target = gui_names
        else:
            raise _unknown(src, key, script)
        if name in target:
            first = target[name][1]
            also = f" as {first.key}" if first.key != key else ""
            raise ConfigError(f"{src.where()}: given twice (also {first.at()}{also})")
        target[name] = (raw, src)

    for key, val in data.items():
        if key in DATASET_KEYS:
            dataset[key] = val
        elif isinstance(val, dict) and not _is_dict_option(key):
            for k, v in val.items():  # a free-form grouping table
                add(k, v, key)
        else:
            add(key, val, None)
    return path, values, sd_names, gui_names, dataset


def _is_dict_option(key: str) -> bool:
    opt = OPTIONS_BY_NAME.get(ALIASES.get(key, key))
    return opt is not None and opt.type.startswith("kv")


def _check_dataset_shape(ds: dict, path: str) -> dict:
    general = ds.get("general", {})
    datasets = ds.get("datasets", [])
    if not isinstance(general, dict):
        raise ConfigError(f"{path}: general must be a table ([general]), got {_desc(general)}")
    if not isinstance(datasets, list) or not all(isinstance(d, dict) for d in datasets):
        raise ConfigError(f"{path}: datasets must be an array of tables ([[datasets]])")
    return {"general": general, "datasets": datasets}


def _load_dataset_file(path: str) -> dict:
    _, data = _read_toml(path, "dataset_config")
    extra = [k for k in data if k not in DATASET_KEYS]
    if extra:
        raise ConfigError(f"{path}: unexpected key {extra[0]!r} in a dataset config "
                          "(expected only [general] and [[datasets]])")
    return _check_dataset_shape(data, path)


def _flag(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the last ``--name value`` / ``--name=value`` of ``names`` in ``argv``."""
    out = None
    for i, tok in enumerate(argv):
        name, eq, value = tok.partition("=")
        if name.lstrip("-") in names and name.startswith("--"):
            out = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return out


def _run_file_key(data: dict, key: str):
    """``key`` of a run file, at the top or in a free-form grouping table."""
    if key in data:
        return data[key]
    return next((v[key] for k, v in data.items() if isinstance(v, dict) and k not in DATASET_KEYS and key in v), None)


def fine_tuning_data(argv: list[str]) -> bool:
    """Whether sd-scripts' full-training scripts that take both kinds of dataset (sdxl_train.py,
    sd3_train.py, flux_train.py, lumina_train.py) train as fine_tune.py: ``in_json`` given (flag or
    run file), or a dataset subset with a ``metadata_file`` (sd-scripts: ``use_dreambooth_method =
    args.in_json is None``, the subsets' own kind with a dataset config); else as train_db.py. A file
    that cannot be read answers False: parse_args then names it."""
    if _flag(argv, ("in_json",)):
        return True
    run_file = _flag(argv, ("config", "config_file"))
    data: dict = {}
    if run_file:
        if not os.path.exists(run_file) and os.path.exists(run_file + ".toml"):
            run_file += ".toml"
        try:
            data = _read_toml(run_file, "config")[1]
        except ConfigError:
            return False
        if _run_file_key(data, "in_json"):
            return True
    dataset_file = _flag(argv, ("dataset_config",)) or _run_file_key(data, "dataset_config")
    if dataset_file:
        try:
            data = _read_toml(str(dataset_file), "dataset_config")[1]
        except ConfigError:
            return False
    datasets = data.get("datasets")
    return isinstance(datasets, list) and any(
        isinstance(sub, dict) and sub.get("metadata_file")
        for ds in datasets if isinstance(ds, dict) for sub in ds.get("subsets", []) or [])


# ----------------------------------------------------------------------------------------------
# the entry point


def parse_args(script: str, argv: list[str] | None = None, entry: str | None = None) -> Options:
    """Parse the command line (and the run/dataset TOML it names) of `script` into Options.
    `--help` prints the generated help and exits (SystemExit 0). Raises ConfigError."""
    if script not in SCRIPTS:
        raise ConfigError(f"unknown script {script!r} (expected one of: {', '.join(SCRIPTS)})")
    argv = sys.argv[1:] if argv is None else list(argv)
    ns, rest = build_parser(script, entry).parse_known_args(argv)
    for tok in rest:
        if tok.startswith("-"):
            name = tok.lstrip("-").split("=", 1)[0]
            raise _unknown(_Src(key=name), name, script)
        raise ConfigError(f"unexpected argument {tok!r} (options are written --name value)")

    cli = vars(ns)
    values, sd_names, gui_names, dataset_raw = {}, {}, {}, {}
    config_path = cli.pop("config", None)
    if config_path:
        config_path, values, sd_names, gui_names, dataset_raw = _load_run_file(config_path, script)
    gui_keys = _apply_gui_keys(gui_names)
    resolved = {o.name: o.default for o in OPTIONS}

    def convert(name, raw, src):
        try:
            resolved[name] = _convert(OPTIONS_BY_NAME[name], raw, src.path is None, script)
        except _Bad as e:
            raise ConfigError(f"{src.where()}: {e}") from None

    # Every value in the file is checked, also those the command line then overrides: a bad
    # value in a config is an error whichever way the run is started.
    for name, (raw, src) in values.items():
        convert(name, raw, src)
    for dest, raw in cli.items():  # the command line overrides the file
        if dest.startswith(_SD_DEST):
            name = dest[len(_SD_DEST):]
            sd_names[name] = (raw, _Src(key=name))
        else:
            values[dest] = (raw, _Src(key=dest))
            convert(dest, raw, values[dest][1])

    ignored = _apply_sd_scripts_names(sd_names)
    ignored.update(gui_keys)
    resolved["config"] = config_path
    for o in OPTIONS:  # dict options are always dicts
        if o.type.startswith("kv") and resolved[o.name] is None:
            resolved[o.name] = {}
    given = set(values) | ({"config"} if config_path else set())

    dataset_config, dataset_config_path = None, None
    if dataset_raw:
        dataset_config, dataset_config_path = _check_dataset_shape(dataset_raw, config_path), config_path
    if resolved["dataset_config"] is not None:
        where = values["dataset_config"][1].where()
        if dataset_config is not None:
            raise ConfigError(f"{where}: the dataset config is given twice: [general]/[[datasets]] "
                              f"in {config_path} and dataset_config; keep one")
        dataset_config_path = resolved["dataset_config"]
        dataset_config = _load_dataset_file(dataset_config_path)

    _deprecated_block_swap(resolved, script)
    _check_combinations(resolved, values, dataset_config is not None, script)
    resolved["dataset_config"] = dataset_config
    return Options(script=script, given=frozenset(given), dataset_config_path=dataset_config_path,
                   ignored=ignored, **resolved)


def _apply_sd_scripts_names(sd_names: dict) -> dict:
    """Reject the unsupported, warn (once each) about the no-effect ones; return those."""
    ignored = {}
    for name, (raw, src) in sd_names.items():
        entry = SD_SCRIPTS_BY_NAME[name]
        try:
            off = _is_off(entry, raw)
        except _Bad as e:
            raise ConfigError(f"{src.where()}: {e}") from None
        if off:
            continue
        if entry.action == "reject":
            raise ConfigError(f"{src.where()}: option {name} is not supported yet ({entry.why}); "
                              "remove it to run")
        ignored[name] = raw
        logger.warning("option %s has no effect in this toolkit (%s)", name, entry.why)
    return ignored


def _gui_unset(v) -> bool:
    """The kohya_ss GUI's "not set": false, an empty string or a zero (the fine-tune tab writes
    vae_chunk_size = 0 for every model)."""
    if v is False or v == "":
        return True
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0


def _apply_gui_keys(gui_names: dict) -> dict:
    """kohya_ss GUI-only keys (library.config.options GUI_KEYS): reject those that cannot be honoured,
    warn once each about those with no effect (also in sd-scripts); return the latter."""
    ignored = {}
    for name, (raw, src) in gui_names.items():
        if _gui_unset(raw):
            continue
        entry = GUI_ONLY[name]
        if entry.action == "reject":
            raise ConfigError(f"{src.where()}: cannot be used here: {entry.why}")
        ignored[name] = raw
        logger.warning("option %s has no effect (a kohya_ss GUI key: %s)", name, entry.why)
    return ignored


def _deprecated_block_swap(v: dict, script: str) -> None:
    """sd-scripts' deprecated FLUX.1 block-swap names, as its scripts read them: split_mode
    (flux_train_network.py: train_lora) sets blocks_to_swap = 18 unless blocks_to_swap is given;
    double_blocks_to_swap / single_blocks_to_swap (flux_train.py: train_dreambooth, finetune)
    without blocks_to_swap make blocks_to_swap = double + single // 2 when that is above 0. One
    warning line each; in the other scripts (where sd-scripts has no such option) a no-effect line."""
    lora = script == "train_lora"
    if v["split_mode"]:
        if not lora:
            logger.warning("option split_mode has no effect in %s (sd-scripts' flux_train_network.py "
                           "option, deprecated there: use blocks_to_swap)", script)
        elif v["blocks_to_swap"] is not None:
            logger.warning("split_mode is deprecated (sd-scripts); blocks_to_swap is given, so "
                           "split_mode is ignored")
        else:
            logger.warning("split_mode is deprecated (sd-scripts): use blocks_to_swap; "
                           "blocks_to_swap = 18 is set")
            v["blocks_to_swap"] = 18
    double, single = v["double_blocks_to_swap"], v["single_blocks_to_swap"]
    if double is None and single is None:
        return
    if lora:
        if double or single:
            logger.warning("options double_blocks_to_swap / single_blocks_to_swap have no effect in "
                           "train_lora (sd-scripts' flux_train.py options, deprecated there: use "
                           "blocks_to_swap)")
        return
    n = (double or 0) + (single or 0) // 2
    if v["blocks_to_swap"] is not None and n > 0:
        logger.warning("double_blocks_to_swap / single_blocks_to_swap are deprecated (sd-scripts); "
                       "blocks_to_swap is given, so they are ignored")
    elif n > 0:
        logger.warning("double_blocks_to_swap / single_blocks_to_swap are deprecated (sd-scripts): "
                       "use blocks_to_swap; double_blocks_to_swap = %s and single_blocks_to_swap = "
                       "%s give blocks_to_swap = %d", double, single, n)
        v["blocks_to_swap"] = n


def _check_hub(v: dict, where) -> None:
    """The Hugging Face Hub options (library/outputs/hub.py): each needs what it works with."""
    if v["huggingface_repo_id"] is None:
        if v["save_state_to_huggingface"]:
            raise ConfigError(f"{where('save_state_to_huggingface')}: uploading states needs "
                              "huggingface_repo_id (the repository, owner/name)")
        for name in ("huggingface_repo_type", "huggingface_path_in_repo",
                     "huggingface_repo_visibility", "async_upload"):
            if v[name]:
                logger.warning("%s has no effect: nothing is uploaded without huggingface_repo_id",
                               where(name))
    elif v["huggingface_repo_id"].count("/") != 1 or "" in v["huggingface_repo_id"].split("/"):
        raise ConfigError(f"{where('huggingface_repo_id')}: {v['huggingface_repo_id']!r} is not a "
                          "repository id (owner/name)")
    if v["save_state_to_huggingface"] and not (v["save_state"] or v["save_state_on_train_end"]):
        logger.warning("%s has no effect: no training state is saved (set save_state or "
                       "save_state_on_train_end)", where("save_state_to_huggingface"))
    if v["resume_from_huggingface"] and not v["resume"]:
        logger.warning("%s has no effect without resume (<owner>/<repo>/<path in repo>"
                       "[:<revision>[:<repo type>]])", where("resume_from_huggingface"))


def _check_combinations(v: dict, given: dict, has_dataset_config: bool, script: str) -> None:
    def where(name):
        return given[name][1].where() if name in given else name

    if v["pretrained_model_name_or_path"] is None:
        raise ConfigError("pretrained_model_name_or_path is required (a diffusers folder, a checkpoint "
                          "file or a built-in model such as tiny-sd15)")
    if script == "train_leco":  # prompts only: no dataset, the length in steps
        if v["prompts_file"] is None:
            raise ConfigError("prompts_file is required (the LECO prompt file)")
        if v["max_train_steps"] is None:
            raise ConfigError("the training length is not set: give max_train_steps")
        if has_dataset_config:
            raise ConfigError("train_leco trains from prompts only: a dataset config ([general] / "
                              "[[datasets]] or dataset_config) cannot be used; remove it")
    if v["max_train_steps"] is None and v["max_train_epochs"] is None:  # (train_leco: above)
        raise ConfigError("the training length is not set: give max_train_steps or max_train_epochs")
    if v["max_train_steps"] is not None and v["max_train_epochs"] is not None:
        logger.warning("both max_train_epochs (%d) and max_train_steps (%d) are given: "
                       "max_train_epochs wins, max_train_steps is ignored",
                       v["max_train_epochs"], v["max_train_steps"])
        v["max_train_steps"] = None
    _check_hub(v, where)
    if v["network_train_unet_only"] and v["network_train_text_encoder_only"]:
        raise ConfigError(f"{where('network_train_text_encoder_only')}: network_train_unet_only and "
                          "network_train_text_encoder_only exclude each other")
    if not has_dataset_config and script != "train_leco":
        if v["train_data_dir"] is None:
            raise ConfigError("train_data_dir is required (or a dataset config: [[datasets]] in the "
                              "run file, or dataset_config)")
        if v["resolution"] is None:
            raise ConfigError("resolution is required (e.g. 512 or \"512,768\"), unless a dataset "
                              "config sets it")
    if v["output_dir"] is None and not v["dry_run"]:
        raise ConfigError("output_dir is required (where the trained files are written)")
    # bucket_reso_steps that is not a multiple of 8, and min/max_bucket_reso that are not
    # multiples of the step, are rounded by library/data/buckets.py, with a warning.
    if v["min_bucket_reso"] > v["max_bucket_reso"]:
        raise ConfigError(f"{where('min_bucket_reso')}: min_bucket_reso ({v['min_bucket_reso']}) is "
                          f"larger than max_bucket_reso ({v['max_bucket_reso']})")
    if v["xformers"]:
        if find_spec("xformers") is None:
            # Attention is a speed choice with the same math (the kohya_ss GUI's default is
            # xformers): fall back to SDPA rather than refuse the config.
            logger.warning("%s: the xformers package is not installed; using SDPA attention "
                           "instead (the same computation)", where("xformers"))
            v["xformers"], v["sdpa"] = False, True
        else:
            v["sdpa"] = False  # xformers takes precedence, as in sd-scripts
