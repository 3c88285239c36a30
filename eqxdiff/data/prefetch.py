"""Background prefetch: a daemon thread pulls host batches, moves them to devices, and queues them.

In the trainer `to_device` is `global_batch`, which builds global arrays with
`jax.make_array_from_process_local_data(batch_sharding, host_batch)`, so the host→device copy of
batch i+1 overlaps the step on batch i (with depth ≥ 2 the next batch is ready when a step ends).
"""

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import jax
from jax.sharding import Sharding

T = TypeVar("T")
U = TypeVar("U")

_POLL_S = 0.05  # how often a blocked put/get re-checks the stop flag


def global_batch(sharding: Sharding, batch: Any) -> Any:
    """A pytree of this process's rows of a batch (host arrays) as global arrays in `sharding`, every
    process's rows together (its leading axis split over the processes' devices)."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


class _End:
    """Queue sentinel: the source is exhausted (error is None) or raised `error`."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


def _put(q: queue.Queue, stop: threading.Event, item: object) -> bool:
    """Put `item`, waiting for room; False if asked to stop meanwhile."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterable[Any], to_device: Callable[[Any], Any], q: queue.Queue, stop: threading.Event) -> None:
    """Producer thread body: every item, or the exception that ended the stream, goes to `q`."""
    try:
        for item in source:
            if stop.is_set() or not _put(q, stop, to_device(item)):
                return
        _put(q, stop, _End())
    except BaseException as e:  # noqa: BLE001 — handed to the consumer, re-raised there
        _put(q, stop, _End(e))


class Prefetch(Iterator[Any]):
    """Iterate `to_device(item)` for `item` in `source`, computed up to `depth` items ahead.

    Items come out in source order. When `source` or `to_device` raises, the items before it
    are delivered first, then the same exception object is re-raised by `__next__`; after
    that (or after exhaustion) the iterator raises StopIteration. `close()` (also `with`-exit)
    stops the thread within ~`_POLL_S` even if it is blocked on a full queue; it is idempotent.

    `delivered` counts items handed out by `__next__` — the position of the last batch given
    to the step, not of batches still queued; checkpoint that, not the source's own position.
    """

    def __init__(self, source: Iterable[T], to_device: Callable[[T], U], depth: int = 2):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"Prefetch depth must be an int >= 1, got {depth!r}.")
        self.depth = depth
        self.delivered = 0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False  # consumer side: end sentinel seen, or closed
        # The thread gets no reference to `self`, so an abandoned Prefetch is collected and its
        # `__del__` stops the thread.
        args = (source, to_device, self._queue, self._stop)
        self._thread = threading.Thread(target=_produce, args=args, name="eqxdiff-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> "Prefetch":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._stop.is_set() or not self._thread.is_alive() and self._queue.empty():
                    self._done = True  # closed, or the producer died without a sentinel
                    raise StopIteration from None
        if isinstance(item, _End):
            self._done = True
            self._thread.join()
            if item.error is not None:
                raise item.error
            raise StopIteration
        self.delivered += 1
        return item

    def close(self) -> None:
        """Stop the producer thread and wait for it; safe to call more than once."""
        self._stop.set()
        self._done = True
        # The producer may be inside `next(source)` or `to_device`; it exits at its next put.
        self._thread.join(timeout=1.0)
        while True:  # drop queued device arrays now rather than when this object dies
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    @property
    def alive(self) -> bool:
        """Whether the producer thread is still running."""
        return self._thread.is_alive()

    def __enter__(self) -> "Prefetch":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)  # absent when __init__ raised
        if stop is not None:
            stop.set()  # let an abandoned producer exit instead of blocking forever
