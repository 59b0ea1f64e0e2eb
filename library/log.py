"""The toolkit's log: one logger ("sdtk"), written to whatever stderr is at the time, one voice
per job (rank 0 logs INFO, the other ranks only problems)."""
from __future__ import annotations

import logging
import sys
import time

import library

logger = logging.getLogger("sdtk")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (tests and wrappers replace it)."""

    def emit(self, record):
        self.stream = sys.stderr
        super().emit(record)


def setup_logging(main: bool):
    """The ``sdtk`` logger: INFO on the main process (``main``: library/accelerator.py
    ``is_main_process()``), warnings only on the others."""
    # Noise from dependencies that says nothing about this run: bitsandbytes' optional 4-bit CPU
    # kernels, and diffusers' float32-modules notice on .to() when the list is empty.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    logging.getLogger("diffusers.models.modeling_utils").addFilter(
        lambda r: "should be kept in float32: []" not in r.getMessage())
    if not logger.handlers:
        h = _StderrHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        logger.addHandler(h)
        # One voice per job: other ranks report only problems.
        logger.setLevel(logging.INFO if main else logging.WARNING)
        logger.propagate = False


def seconds_since_process_start() -> float:
    """Seconds since the entry script imported ``library`` (its first import)."""
    return time.time() - library.STARTED
