"""ADM's sample batches, written in chunks a preempted job skips when it is restarted.

The format is what ADM's evaluator (openai/guided-diffusion's evaluations/evaluator.py) and DiT's
and SiT's `sample_ddp.py` read: one .npz of `arr_0`, uint8 images [num, h, w, c], and for a
class-conditional model `arr_1`, the int64 label of each image (scripts/image_sample.py's layout).

`write_sample_batches` makes `num` images `chunk_size` at a time by a `sample_chunk(labels, key)`
callable (every device of every process: the callable's own sharding; every process calls it alike
and gets all the images). Chunk `i`'s labels are rows `i·chunk_size...` of one balanced, shuffled
label list, its noise comes from `fold_in(key(seed), i)`: a chunk is the same whichever chunks ran
before it. Process 0 writes each chunk to OUT.parts/ (a temp file renamed: a chunk on disk is
whole); a restart with the same flags skips those and refuses other flags, naming them; the .npz is
assembled (streamed, one chunk in memory at a time) once all chunks exist, and OUT.parts/ removed.
Process 0 alone writes because every process holds every image anyway (the callable's contract);
the others learn which chunks are done from it, so OUT.parts/ need not be on a shared disk.
"""

import fcntl
import json
import os
import shutil
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

# (labels int32 [chunk_size] or None (unconditional), a jax key) -> uint8 images [chunk_size, h, w, c] on every process.
SampleChunk = Callable[[np.ndarray | None, jax.Array], np.ndarray]


def balanced_labels(num: int, classes: Sequence[int], seed: int) -> np.ndarray:
    """`num` int32 labels: every one of `classes` num // k times (k = len(classes)), the remainder r one
    more each for r classes spread evenly over the list (positions ⌊j·k/r⌋), in an order shuffled by `seed`."""
    k = len(classes)
    counts = np.full(k, num // k)
    counts[np.arange(num % k) * k // max(num % k, 1)] += 1
    labels = np.repeat(np.asarray(classes, np.int32), counts)
    return labels[np.random.default_rng([seed, num]).permutation(num)]


def chunk_key(seed: int, index: int) -> jax.Array:
    """Chunk `index`'s sampling key: a function of (seed, index) alone."""
    return jax.random.fold_in(jax.random.key(seed), index)


def parts_dir(out: str | Path) -> Path:
    """Where the chunks of `out` are kept until it is assembled: OUT.parts beside it."""
    out = Path(out)
    return out.with_name(out.name + ".parts")


def write_sample_batches(
    sample_chunk: SampleChunk,
    out: str | Path,
    *,
    num: int,
    chunk_size: int,
    seed: int,
    classes: Sequence[int] | None,
    flags: dict[str, Any],
) -> Path:
    """`num` samples of `sample_chunk` as ADM's .npz at `out` (`arr_0` uint8 NHWC; `arr_1` int64 labels,
    balanced over `classes`, when `classes` is not None), made `chunk_size` at a time (the last chunk
    padded with repeated labels: one program for all). `flags`: the command-line flags that decide the
    samples, by flag name (`{"--steps": 250, ...}`, JSON values), recorded with the parts; a restart
    whose flags (or num, chunk_size, seed, classes) differ is refused with a SystemExit naming them.
    Every process calls it alike; process 0 writes. Returns `out`."""
    if num < 1 or chunk_size < 1 or (classes is not None and not len(classes)):
        raise ValueError(
            f"write_sample_batches: num {num} and chunk_size {chunk_size} must be >= 1, classes {classes} None or some"
        )
    out, parts = Path(out), parts_dir(out)
    n_chunks = -(-num // chunk_size)
    labels = None if classes is None else balanced_labels(num, classes, seed)
    record = {
        "flags": flags,
        "num": num,
        "chunk_size": chunk_size,
        "seed": seed,
        "classes": None if classes is None else [int(c) for c in classes],
    }
    record = json.loads(json.dumps(record))  # as it is read back (tuples are lists)
    done, refusal, lock = np.zeros(n_chunks, bool), "", None
    if jax.process_index() == 0:
        refusal = _check_record(parts, record)
        lock, refusal = (None, refusal) if refusal else _lock(parts, out)
        done = np.array([(parts / _chunk_name(i)).exists() for i in range(n_chunks)]) if not refusal else done
    if jax.process_count() > 1:  # every process samples the same chunks (the callable's collectives)
        refused = bool(multihost_utils.broadcast_one_to_all(np.int32(bool(refusal))))
        done = np.asarray(multihost_utils.broadcast_one_to_all(done)).astype(bool)
        refusal = refusal or ("process 0 refused these flags (its output says why)" if refused else "")
    if refusal:
        raise SystemExit(refusal)
    try:
        return _sample_chunks(sample_chunk, out, parts, num, chunk_size, seed, labels, done)
    finally:  # the lock released also when sampling fails (a restart in this process takes it again)
        if lock is not None:
            lock.close()


def _sample_chunks(
    sample_chunk: SampleChunk,
    out: Path,
    parts: Path,
    num: int,
    chunk_size: int,
    seed: int,
    labels: np.ndarray | None,
    done: np.ndarray,
) -> Path:
    """write_sample_batches' work once the flags are checked: the chunks not `done`, then the batch assembled."""
    n_chunks = len(done)
    sizes = [min(chunk_size, num - i * chunk_size) for i in range(n_chunks)]
    bar = tqdm(
        total=num,
        initial=sum(s for s, d in zip(sizes, done) if d),
        unit="img",
        desc="samples",
        disable=jax.process_index() != 0,
        dynamic_ncols=True,
    )
    for i in np.flatnonzero(~done).tolist():
        rows = np.minimum(np.arange(i * chunk_size, (i + 1) * chunk_size), num - 1)  # past the end: the last row again
        images = np.asarray(sample_chunk(None if labels is None else labels[rows], chunk_key(seed, i)))
        if images.dtype != np.uint8 or images.ndim != 4 or len(images) != chunk_size:
            raise ValueError(f"sample_chunk gave {images.dtype} {images.shape}; uint8 [{chunk_size}, h, w, c] expected")
        if jax.process_index() == 0:
            chunk = {"images": images[: sizes[i]]} | ({} if labels is None else {"labels": labels[rows][: sizes[i]]})
            _write_atomically(parts / _chunk_name(i), lambda f, chunk=chunk: np.savez(f, **chunk))
        bar.update(sizes[i])
    bar.close()
    if jax.process_index() == 0:
        _assemble(parts, out, n_chunks, num, labels is not None)
        shutil.rmtree(parts)
    return out


def _lock(parts: Path, out: Path):
    """(the open lock file of `parts`, "") while this process is the one writing `out`: another process that
    writes the same --out would remove the chunks under it once it finished; else (None, the line refusing it).
    The lock goes with its process (a killed one's too)."""
    lock = open(parts / "lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another"
        lock.close()
        return None, (
            f"--out {out}: process {holder} is writing it (its chunks in {parts}); wait for it to finish, or "
            "choose another --out."
        )
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock, ""


def _chunk_name(index: int) -> str:
    return f"chunk_{index:06d}.npz"


def _check_record(parts: Path, record: dict) -> str:
    """ "" if `parts` is new (then it is made and `record` written) or was written with `record`; else
    the one line that refuses the restart, naming what differs."""
    path = parts / "flags.json"
    if not path.exists():
        parts.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, lambda f: f.write(json.dumps(record, indent=1).encode()))
        return ""
    before = json.loads(path.read_text())
    if before == record:
        return ""
    old, new = before.get("flags", {}), record["flags"]
    names = [f for f in dict.fromkeys([*old, *new]) if old.get(f) != new.get(f)]
    names += [k for k in record if k != "flags" and before.get(k) != record[k]]
    said = "; ".join(f"{n}: {_said(before, old, n)} there, {_said(record, new, n)} now" for n in names)
    return (
        f"{parts} holds chunks sampled with other settings ({said}): pass the same flags to finish them, or "
        f"remove {parts} (or choose another --out) to start again."
    )


def _said(record: dict, flags: dict, name: str) -> str:
    if name not in flags and name not in record:
        return "(not given)"
    return json.dumps(flags[name] if name in flags else record[name])


def _write_atomically(path: Path, write: Callable) -> None:
    """`write(file)` into a temp file beside `path`, then renamed over it: `path` is whole or absent."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _assemble(parts: Path, out: Path, n_chunks: int, num: int, with_labels: bool) -> None:
    """The chunks in order as one .npz (np.savez's layout: `arr_0.npy`, `arr_1.npy` in a zip), streamed."""
    first = np.load(parts / _chunk_name(0))["images"]
    shape = (num, *first.shape[1:])
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(f) -> None:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, key, dtype, array_shape in [
                ("arr_0", "images", np.uint8, shape),
                ("arr_1", "labels", np.int64, (num,)),
            ][: 1 + with_labels]:
                with archive.open(f"{name}.npy", "w", force_zip64=True) as entry:
                    header = {
                        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                        "fortran_order": False,
                        "shape": array_shape,
                    }
                    np.lib.format.write_array_header_1_0(entry, header)
                    for i in range(n_chunks):
                        part = np.load(parts / _chunk_name(i))[key]
                        if part.shape[1:] != array_shape[1:]:
                            raise ValueError(
                                f"{parts / _chunk_name(i)}: {key} of shape {part.shape}, not [n, "
                                f"{', '.join(map(str, array_shape[1:]))}] as chunk 0's"
                            )
                        entry.write(np.ascontiguousarray(part, dtype).tobytes())

    _write_atomically(out, write)
