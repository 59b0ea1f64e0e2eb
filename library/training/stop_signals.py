"""What may stop or steer a run from outside between steps: SIGINT / SIGTERM (``StopSignals``) and
the control_file's commands (``COMMANDS``; read by library/outputs/progress_stream.py). The step's
one small all-reduce (library/training/step_sync.py) makes every process agree on them."""
from __future__ import annotations

import signal
import threading

COMMANDS = ("save_now", "sample_now", "stop")


class StopSignals:
    """While active, SIGINT and SIGTERM ask training to stop after the current step.

    A second signal stops at once (KeyboardInterrupt / exit 143). It carries the pending signal
    only (``signum``): the step's one small all-reduce (library/training/step_sync.py ``gather``,
    every process once per step) makes all processes stop after the same step even when the
    signal reached only one of them.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = 0
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def _handle(self, signum, frame):
        if self.signum:  # second signal: stop now
            self.__exit__()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.signum = signum
