"""In-memory datasets and their per-process batch stream (host numpy, before the prefetch thread)."""

from collections.abc import Iterator

import numpy as np
from jaxtyping import Float, Int


def load_digits() -> tuple[Float[np.ndarray, "n 8 8 1"], Int[np.ndarray, " n"]]:
    """scikit-learn's bundled 1,797 handwritten digits (8×8, 10 classes) as [-1, 1] float32 NHWC,
    and their labels. Ships with scikit-learn: nothing is downloaded."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = (digits.images.astype(np.float32) / 16.0 * 2 - 1)[..., None]
    return images, digits.target.astype(np.int32)


def shuffled_batches(
    arrays: dict[str, np.ndarray], batch_size: int, seed: int, process_index: int = 0, process_count: int = 1
) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of `batch_size` rows (this process's share), a new permutation each epoch
    (same for every process, from `seed`), incomplete batches dropped. Process p takes rows
    p, p + P, ... of each global batch of batch_size·P rows."""
    n = len(next(iter(arrays.values())))
    global_batch = batch_size * process_count
    if global_batch > n:
        raise ValueError(f"Global batch {global_batch} is larger than the dataset ({n} examples).")
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(n)
        for start in range(0, n - global_batch + 1, global_batch):
            rows = order[start + process_index : start + global_batch : process_count]
            yield {name: a[rows] for name, a in arrays.items()}
        epoch += 1
