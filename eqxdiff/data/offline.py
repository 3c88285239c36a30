"""The offline device pipeline of train/encode.py and train/fid_stats.py: a dataset read once, batch by
batch, through a jitted function on this process's devices, every result back on the host in order.

`run_offline` reads the examples on host threads, pads each batch to one shape (one compile), puts it on
the mesh from a prefetch thread two batches ahead, and brings a batch's results to the host while the
next one runs.
"""

import collections
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from tqdm import tqdm

from eqxdiff.data.prefetch import Prefetch


def pad_rows(x: np.ndarray, size: int) -> np.ndarray:
    """`x` with its last row repeated up to `size` rows."""
    return np.concatenate([x, np.repeat(x[-1:], size - len(x), axis=0)])


def run_offline(
    read: Callable[[int], dict],
    indices: Sequence[int],
    batch_size: int,
    split: Callable[[list], tuple],
    compute: Callable,
    collect: Callable,
    *,
    sharding,
    desc: str,
    progress: bool = True,
) -> None:
    """Every example `read(g)` for g in `indices` (8 host threads), `batch_size` at a time (this
    process's share of the global batch, split over `sharding`'s devices):

    - `split(examples) -> (host, inputs)`: what stays on the host, and a pytree of arrays for the
      devices; `inputs` are padded to `batch_size` rows by repeating the last (`pad_rows`), so the
      last, shorter batch has the shape of the others;
    - `compute(inputs on the devices)` is dispatched; while it runs, the previous batch's outputs come
      to the host as numpy, cut to its real rows, and `collect(host, outputs)` takes them in order.

    A tqdm bar counts the examples when `progress`."""

    def host_batches(pool: ThreadPoolExecutor):
        for start in range(0, len(indices), batch_size):
            examples = list(pool.map(read, indices[start : start + batch_size]))
            host, inputs = split(examples)
            yield host, jax.tree.map(lambda x: pad_rows(x, batch_size), inputs), len(examples)

    bar = tqdm(total=len(indices), unit="img", desc=desc, disable=not progress, smoothing=0.1)

    def finish(host, outputs, rows: int) -> None:
        collect(host, jax.tree.map(lambda v: np.asarray(v)[:rows], outputs))
        bar.update(rows)

    put = lambda b: (b[0], jax.device_put(b[1], sharding), b[2])  # noqa: E731  (on the prefetch thread)
    with ThreadPoolExecutor(8) as pool, Prefetch(host_batches(pool), put, depth=2) as device_batches:
        in_flight = collections.deque()  # one batch runs while the previous one is collected
        for host, inputs, rows in device_batches:
            in_flight.append((host, compute(inputs), rows))
            if len(in_flight) > 1:
                finish(*in_flight.popleft())
        while in_flight:
            finish(*in_flight.popleft())
    bar.close()
