"""The one base class of errors caused by the user's input (options, files, data).

Entry scripts print such an error as one line, without a traceback, and exit with status 2.
"""


class UserError(Exception):
    """An error in what the user gave us; its message is one line naming the option or file."""


def first_line(e: BaseException, *, typed: bool = False) -> str:
    """The first line of an exception's message (libraries such as torch and PIL explain over
    several lines; the first says what failed), or its type's name when it has none; ``typed``:
    prefixed with the type's name."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    line = text.splitlines()[0]
    return f"{type(e).__name__}: {line}" if typed else line
