"""The one base class of errors caused by the user's input (options, files, data), and the errors
that lower layers raise and the entry glue answers (the bottom layer: it imports nothing of ours).

Entry scripts print such an error as one line, without a traceback, and exit with status 2
(``tool_main`` for the tools); ``NonFiniteStop`` exits with 3, ``TrainingInterrupted`` with 128 +
the signal.
"""
import signal
import sys


class UserError(Exception):
    """An error in what the user gave us; its message is one line naming the option or file."""


def tool_main(parse_args, run, argv=None) -> int:
    """A tool's main: parse the flags, run, and print a user error as one line (exit 2)."""
    args = parse_args(argv)
    try:
        run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def first_line(e: BaseException, *, typed: bool = False) -> str:
    """The first line of an exception's message (libraries such as torch and PIL explain over
    several lines; the first says what failed), or its type's name when it has none; ``typed``:
    prefixed with the type's name."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    line = text.splitlines()[0]
    return f"{type(e).__name__}: {line}" if typed else line


class DataError(UserError):
    """Bad dataset input. The message is one line naming the file, folder or option."""


class ResumeError(UserError, ValueError):
    """A state that cannot be resumed by this run (missing, corrupt, or another run's)."""


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM stopped training after a complete step; its state was written."""

    def __init__(self, signum: int, state_dir: str, step: int):
        self.signum, self.state_dir, self.step = signum, state_dir, step
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        super().__init__(f"{name}: stopped after step {step}; training state written to {state_dir} "
                         f"(continue with --resume {state_dir})")


class NonFiniteStop(Exception):
    """Training stopped on a non-finite loss or gradient (not a user error: exit code 3)."""

    exit_code = 3  # distinct from 2 (user error) and 128+signal (interrupted)


class ModelError(UserError, ValueError):
    """A model cannot be found or loaded; the message is one line naming the file or option."""
