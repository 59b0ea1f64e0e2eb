"""The one base class of errors caused by the user's input (options, files, data), and the errors
that lower layers raise and the entry glue answers (the bottom layer: it imports only the log).

Entry scripts print such an error as one line, without a traceback, and exit with status 2
(``run_tool`` / ``tool_main`` for the LoRA and dataset tools); ``NonFiniteStop`` exits with 3, ``TrainingInterrupted`` with 128 +
the signal.
"""
import signal
import sys

from library.log import setup_logging


class UserError(Exception):
    """An error in what the user gave us; its message is one line naming the option or file."""


def run_tool(work, *args, **kwargs) -> int:
    """Every tool's main around its work: the ``sdtk`` log on stderr, then ``work(*args,
    **kwargs)``. Exit status: 2 on a UserError (printed as one line, no traceback), the work's
    int result where it returns one (check_dataset: 1 when it found problems), else 0."""
    setup_logging(True)
    try:
        result = work(*args, **kwargs)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def tool_main(parse_args, run, argv=None) -> int:
    """A tool's main from its flag parser: ``run(parse_args(argv))`` through ``run_tool``."""
    return run_tool(run, parse_args(argv))


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
