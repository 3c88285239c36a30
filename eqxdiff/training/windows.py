"""Loop bookkeeping kept out of the loop's way: the metrics window read at the log cadence, and
the profiler window."""

import contextlib
import os
import time

import jax
import numpy as np

from eqxdiff.training.metrics import mfu


class LogWindow:
    """The step metrics since the last log, kept on device and read to the host in one transfer
    (`read`), with the training time between reads: time spent inside `paused()` (sampling,
    checkpoints), and the steps before `restart_clock()` (the compile), are not step time."""

    def __init__(self, batch_size: int, flops_per_device: float, peak_flops_per_device: float):
        self.batch_size, self.flops, self.peak = batch_size, flops_per_device, peak_flops_per_device
        self.rows = []
        self.restart_clock()

    def restart_clock(self) -> None:
        self._timed, self._start, self._paused = 0, time.perf_counter(), 0.0

    def add(self, metrics: dict) -> None:
        self.rows.append(metrics)
        self._timed += 1

    @contextlib.contextmanager
    def paused(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - start

    def read(self) -> tuple[dict, int]:
        """(the logged values, the most consecutive non-finite steps seen); then restarts."""
        rows = jax.device_get(self.rows)  # the one host read per log interval
        elapsed = time.perf_counter() - self._start - self._paused
        step_time = elapsed / self._timed if self._timed else float("nan")
        logged = {
            "train/loss": float(np.mean([r["loss"] for r in rows if r["finite"]] or [np.nan])),
            "train/grad_norm": float(rows[-1]["grad_norm"]),
            "train/lr": float(rows[-1]["lr"]),
            "train/bad_steps": int(rows[-1]["bad_steps"]),
            "train/step_time_ms": 1000 * step_time,
            "train/samples_per_sec": self.batch_size / step_time,
            "train/mfu": mfu(self.flops, step_time, self.peak),
        }
        worst = max(int(r["bad_steps"]) for r in rows)
        self.rows = []
        self.restart_clock()
        return logged, worst


def parse_step_range(text: str) -> tuple[int, int] | None:
    """ "A:B" -> (A, B) with 1 <= A < B; None when `text` is not of that form."""
    try:
        a, b = (int(v) for v in text.split(":"))
    except ValueError:
        return None
    return (a, b) if 1 <= a < b else None


class ProfileWindow:
    """A `jax.profiler` trace of steps A..B-1 ("A:B") into `directory`; "" traces nothing."""

    def __init__(self, steps: str, directory: os.PathLike):  # run_dir's: a pathlib.Path or an epath.Path
        self.range = parse_step_range(steps) if steps else None
        self.directory = directory

    def before(self, step: int) -> None:
        if self.range and step == self.range[0]:
            jax.profiler.start_trace(str(self.directory))

    def after(self, step: int, metrics: dict) -> None:
        if self.range and step == self.range[1] - 1:
            jax.block_until_ready(metrics)
            jax.profiler.stop_trace()
