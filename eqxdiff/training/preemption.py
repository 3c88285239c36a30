"""SIGTERM/SIGINT as a request to stop cleanly: finish the step, save, exit 0.

A cluster preempts a job with SIGTERM and a grace period (often 30 s); Ctrl-C sends SIGINT. The
handler only sets a flag — the loop decides when to stop, so a step is never cut in half. A
second SIGINT falls through to Python's default (KeyboardInterrupt) for a user who insists.
"""

import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils


class StopRequest:
    """Context manager that turns SIGTERM/SIGINT into `received` (the signal's name)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self.received: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the next Ctrl-C interrupts

    def should_stop(self, step: int, every: int) -> bool:
        """Whether every process has to stop after `step`. One process: its own flag, at any step.
        Several: they must agree, so the flags are all-gathered — a host sync, done only when
        `step % every == 0` (the logging cadence), at the same steps on every process."""
        if jax.process_count() == 1:
            return self.received is not None
        if step % every:
            return False
        flags = multihost_utils.process_allgather(np.int32(self.received is not None))
        return bool(np.any(flags))

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signal() works there only
            self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def __exit__(self, *exc_info) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
