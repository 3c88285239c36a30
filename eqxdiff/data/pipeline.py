"""Per-process batches of one global example stream, so resume is exact on any process count.

Global example g = 0, 1, 2, ... is dataset index perm_e(g mod N) with epoch e = g // N: grain's
`shuffle` gives each epoch its own permutation (seeded from (seed, e)) and `repeat` makes the
stream endless. Global batch b holds g in [start + b·B, start + (b+1)·B); process p of n takes its
contiguous rows [p·L, (p+1)·L), L = B / n — the block `jax.make_array_from_process_local_data`
places for process p — so the global batch is the same for every process count. A run that
consumed k examples resumes with `start_example=k` on any process count or global batch size.
Batches may straddle epochs: no example is dropped at an epoch end. Random horizontal flips are
drawn from (seed, g), so they do not depend on the process count or on `num_threads` either.
"""

from collections.abc import Iterator

import grain
import numpy as np

from eqxdiff.data.records import Source, describe_fields, stack_records


def derived_seeds(seed: int) -> tuple[int, int]:
    """(shuffle seed, flip seed), both 32-bit, from the run seed."""
    # Hashed rather than `seed` itself: grain seeds epoch e with seed + e, so runs 0 and 1 would share epochs.
    if seed < 0:
        raise ValueError(f"The data seed must be >= 0, got {seed}.")
    shuffle_seed, flip_seed = np.random.SeedSequence(seed).generate_state(2)
    return int(shuffle_seed), int(flip_seed)


def random_hflip(example: dict, rng: np.random.Generator) -> dict:
    """Mirror the image left-right with probability 1/2."""
    if rng.random() < 0.5:
        return {**example, "image": example["image"][:, ::-1]}
    return example


def batch_stream(
    source: Source,
    global_batch_size: int,
    seed: int,
    *,
    start_example: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    hflip: bool = False,
    num_threads: int = 4,
) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of this process's rows of each global batch (see the module docstring):
    each of the source's fields stacked, `(L, *shape)` in its declared dtype, L =
    global_batch_size // process_count. `hflip` mirrors the "image" field. `num_threads` grain threads read (decode) batches ahead; the stream is the
    same for any value (0 reads in the calling thread, best for in-memory sources)."""
    if global_batch_size < 1 or global_batch_size % process_count:
        raise ValueError(
            f"The global batch size {global_batch_size} must be a positive multiple of the process count"
            f" {process_count}."
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count}).")
    if start_example < 0:
        raise ValueError(f"start_example must be >= 0, got {start_example}.")
    shuffle_seed, flip_seed = derived_seeds(seed)
    if hflip and "image" not in source.fields:
        raise ValueError(f"--hflip mirrors the 'image' field; {source.spec} has {sorted(source.fields)}.")
    examples = grain.MapDataset.source(source).shuffle(seed=shuffle_seed).repeat()  # element g, endless
    if hflip:
        examples = examples.random_map(random_hflip, seed=flip_seed)  # rng from (flip_seed, g): before slicing
    local_batches = examples[start_example:].batch(
        global_batch_size // process_count, batch_fn=lambda records: stack_records(records, source.fields)
    )
    mine = local_batches[process_index::process_count]  # the p-th L-row block of each global batch
    read = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=2 * num_threads)
    return iter(mine.to_iter_dataset(read))


def data_position(examples_consumed: int, seed: int, source: Source) -> dict:
    """The json-able data position to checkpoint: resume with `start_example=examples_consumed`."""
    return {
        "examples_consumed": int(examples_consumed),
        "seed": int(seed),
        "dataset": source.spec,
        "dataset_size": len(source),
        "fields": describe_fields(source.fields),
    }


def check_position(position: dict, seed: int, source: Source, allow_dataset_change: bool = False) -> int:
    """`position["examples_consumed"]`, after checking that the checkpoint's dataset and seed are
    this run's (a different one would silently resume a different stream). `allow_dataset_change`
    accepts another dataset size (and spec) with the same fields and seed; the example count goes
    on, the epoch order restarts (example k is example k of the new data's own shuffled stream)."""
    now = data_position(position["examples_consumed"], seed, source)
    k = now["examples_consumed"]
    # "fields" is absent from positions written before sources declared fields: not compared then.
    compared = ("fields", "seed") if allow_dataset_change else ("dataset_size", "fields", "seed")
    differs = [key for key in compared if key in position and position[key] != now[key]]
    if not differs:
        return k
    if differs == ["dataset_size"]:
        fix = (
            "If you changed the data on purpose (e.g. removed unreadable files), pass --allow_dataset_change to"
            f" continue from example {k}; else resume with the checkpoint's --dataset and --seed, or start a new"
            " --run_dir."
        )
    else:
        fix = "Resume with the checkpoint's --dataset and --seed, or start a new --run_dir."
    raise ValueError(
        f"The checkpoint was written for a dataset of {position.get('dataset_size')} records with fields"
        f" {position.get('fields')} ({position.get('dataset')}, seed {position.get('seed')}), but this run has"
        f" {now['dataset_size']} with fields {now['fields']} ({now['dataset']}, seed {seed});"
        f" {', '.join(differs)} differ. {fix}"
    )
