"""The static view of ``Options`` for editors and type checkers.

``Options`` (library/config/parse.py) is generated at run time from the schema, so an editor or
a type checker sees none of its fields. ``library/config/options_static.pyi`` declares the same
class, field by field with its type and default, generated from the same schema by this module
(``python -m library.config.options_stub`` rewrites it; tests/config/test_options_stub.py fails
when the two differ). parse.py imports the declared class only for type checkers, so ``opts.x``
with a typo, or an int option used as a string, is a type error in the caller's editor.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing

from library.config.parse import Options

STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "options_static.pyi")

def annotation(t) -> str:
    """A type as source text: ``int | None``, ``tuple[int, int]``, ``dict[str, Any]``."""
    if t is type(None):
        return "None"
    if t is typing.Any:
        return "Any"
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        return " | ".join(annotation(a) for a in typing.get_args(t))
    origin = typing.get_origin(t)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(annotation(a) for a in typing.get_args(t))}]"
    return t.__name__


def render() -> str:
    lines = ['"""Generated from library/config/options.py by `python -m library.config.options_stub`;',
             'do not edit. The fields of library/config/parse.py Options, for type checkers."""',
             "from dataclasses import dataclass", "from typing import Any", "", "",
             "@dataclass(frozen=True, kw_only=True)", "class Options:"]
    for f in dataclasses.fields(Options):
        if f.default is not dataclasses.MISSING:
            default = f"= ...  # default {f.default!r}"
        elif f.default_factory is not dataclasses.MISSING:
            default = f"= ...  # default {f.default_factory()!r}"
        else:
            default = ""
        lines.append(f"    {f.name}: {annotation(f.type)} {default}".rstrip())
    lines += ["",
              "    def replace(self, **changes: Any) -> Options: ...",
              "    def to_dict(self) -> dict[str, Any]: ..."]
    return "\n".join(lines) + "\n"


def runtime_fields() -> list[tuple[str, str]]:
    """(name, annotation text) of the run-time class's fields, in order."""
    return [(f.name, annotation(f.type)) for f in dataclasses.fields(Options)]


if __name__ == "__main__":
    with open(STUB, "w", encoding="utf-8") as f:
        f.write(render())
    print(f"wrote {STUB}")
