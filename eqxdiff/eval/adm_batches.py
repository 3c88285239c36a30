"""ADM's batch files (openai/guided-diffusion, evaluations/): a reference batch such as
VIRTUAL_imagenet256_labeled.npz holds `arr_0`, uint8 images [n, h, w, 3], and the statistics ADM's
evaluator computed from them with the TF graph, `mu` [2048], `sigma` [2048, 2048] (pool3) and `mu_s`
[2023], `sigma_s` [2023, 2023] (mixed_6/conv's first 7 channels); a sample batch holds `arr_0` and
optionally `arr_1`, the class labels [n].

`arr_0` is read a batch at a time straight from the zip member, as ADM's evaluator streams it (50,000
images at 256² are 9.8 GB): np.load would hold all of it in memory.
"""

import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

IMAGES = "arr_0"
STORED = {"pool3": ("mu", "sigma"), "spatial": ("mu_s", "sigma_s")}  # ADM's stored statistics, by feature set


def _members(path: Path) -> list[str]:
    """The array names of the .npz at `path`, or an error naming what it is instead."""
    if not path.is_file():
        raise FileNotFoundError(
            f"No batch file {path}: ADM's batches are .npz files with '{IMAGES}' (uint8 images "
            "[n, h, w, 3]; np.savez(path, images) writes one)."
        )
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is not an .npz file (a zip of .npy arrays, as np.savez writes).")
    with zipfile.ZipFile(path) as z:
        return [n.removesuffix(".npy") for n in z.namelist() if n.endswith(".npy")]


def array_names(path: str | Path) -> list[str]:
    """The arrays an .npz holds (checked to be one)."""
    return _members(Path(path).expanduser())


@contextmanager
def _open_array(path: Path, name: str):
    """(shape, dtype, file positioned at the data) of array `name` of the .npz `path`."""
    with zipfile.ZipFile(path) as z, z.open(f"{name}.npy") as f:
        version = np.lib.format.read_magic(f)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        if version not in read_header:  # 3.0: utf-8 field names, never written for a plain array
            raise ValueError(f"{path}: '{name}' is an .npy of format {version}; write it with np.savez.")
        shape, fortran, dtype = read_header[version](f)
        if fortran or dtype.hasobject:
            raise ValueError(
                f"{path}: '{name}' is stored {'in Fortran order' if fortran else 'as objects'}; "
                "write it with np.savez from a C-ordered uint8 array."
            )
        yield tuple(shape), dtype, f


def image_shape(path: str | Path) -> tuple[int, ...]:
    """The [n, h, w, c] of the batch's images, checked: uint8, NHWC, 3 (or 1: grayscale) channels, n >= 1."""
    path = Path(path).expanduser()
    names = _members(path)
    if IMAGES not in names:
        raise ValueError(
            f"{path} has no '{IMAGES}' (it holds {sorted(names)}): ADM's batches keep their uint8 "
            f"images [n, h, w, 3] under '{IMAGES}' (np.savez(path, images) names it so)."
        )
    with _open_array(path, IMAGES) as (shape, dtype, _):
        if dtype != np.uint8 or len(shape) != 4 or shape[-1] not in (1, 3) or shape[0] < 1:
            raise ValueError(
                f"{path}: '{IMAGES}' is {dtype} {list(shape)}; ADM's batches hold uint8 images "
                "[n, h, w, 3] (NHWC, 0..255; eqxdiff.images.to_uint8 maps [-1, 1] samples)."
            )
        return shape


def image_batches(path: str | Path, batch_size: int) -> Iterator[np.ndarray]:
    """The batch's images, uint8 [<= batch_size, h, w, c], in order, read from the file as they go."""
    path = Path(path).expanduser()
    shape = image_shape(path)
    row = int(np.prod(shape[1:]))
    with _open_array(path, IMAGES) as (_, _, f):
        for start in range(0, shape[0], batch_size):
            rows = min(batch_size, shape[0] - start)
            data = f.read(rows * row)
            if len(data) != rows * row:
                raise ValueError(f"{path}: '{IMAGES}' ends after {start} of its {shape[0]} images (a truncated file).")
            yield np.frombuffer(data, np.uint8).reshape(rows, *shape[1:])


def stored_stats(path: str | Path, dims: dict[str, int]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The statistics ADM stored in a reference batch, {"pool3": (mu, sigma), "spatial": (mu_s, sigma_s)}
    as float64, for each pair the file has; `dims`: each feature set's dimension, checked, as are
    NaN/inf and a pair with one half missing."""
    path = Path(path).expanduser()
    names = _members(path)
    out = {}
    with np.load(path, allow_pickle=False) as f:
        for which, (mu_key, sigma_key) in STORED.items():
            have = [k for k in (mu_key, sigma_key) if k in names]
            if not have:
                continue
            if len(have) == 1:
                raise ValueError(f"{path} has '{have[0]}' without its pair ({mu_key}, {sigma_key}); rewrite both.")
            mu, sigma = np.asarray(f[mu_key], np.float64), np.asarray(f[sigma_key], np.float64)
            d = dims[which]
            if mu.shape != (d,) or sigma.shape != (d, d):
                raise ValueError(
                    f"{path}: '{mu_key}' {list(mu.shape)}, '{sigma_key}' {list(sigma.shape)}; ADM's "
                    f"{which} statistics are [{d}] and [{d}, {d}]."
                )
            if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
                raise ValueError(f"{path}: '{mu_key}'/'{sigma_key}' hold NaN/inf values.")
            out[which] = (mu, sigma)
    return out
