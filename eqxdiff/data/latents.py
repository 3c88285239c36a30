"""Pre-encoded latents (written once by train/encode.py) as a record source: `latents:DIR`.

The folder holds `meta.json` and ArrayRecord shards `shard-SSSSS-of-NNNNN.array_record`: shard
k holds global examples [k·shard_size, min((k+1)·shard_size, count)), so the shards in name order
are the examples in order, whatever the number of processes that wrote them. A shard is written
under `<name>.tmp` and renamed when complete; `meta.json` is written last, once every shard
exists, so it marks a complete encode.

A record is the raw little-endian bytes of each field, concatenated in the order meta.json's
`fields` lists them (no pickle, no header). meta.json:

    fields          {name: {"dtype": "float16", "shape": [h, w, c]}, ...}: "mean", "logvar",
                    then every field of the image source except "image" (e.g. "label")
    vae             eqxdiff.autoencoders.describe_autoencoder's {"spec", "path", "weights_sha256"}
    scaling_factor, shift_factor   the VAE's: the model sees (z - shift_factor) · scaling_factor
    latent_shape    [h, w, c];  count, shard_size, num_shards;  num_classes
    source          the image dataset spec;  image_shape  its [H, W, C]
    hflip_copies    whether examples count/2 .. count-1 are examples 0 .. count/2-1 mirrored
"""

import json
from collections.abc import Sequence
from pathlib import Path

import grain
import jax
import numpy as np

from eqxdiff.data.records import Fields

META = "meta.json"
TMP_SUFFIX = ".tmp"
RERUN = "(re)run train/encode.py with the same flags to complete it"


def shard_name(k: int, num_shards: int) -> str:
    """The file name of shard k of num_shards."""
    return f"shard-{k:05d}-of-{num_shards:05d}.array_record"


def fields_to_meta(fields: Fields) -> dict[str, dict]:
    """Declared fields -> meta.json's `fields` (order kept: it is the record's byte order)."""
    return {k: {"dtype": np.dtype(f.dtype).name, "shape": list(f.shape)} for k, f in fields.items()}


def fields_from_meta(meta_fields: dict[str, dict]) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(tuple(f["shape"]), np.dtype(f["dtype"])) for k, f in meta_fields.items()}


def record_bytes(example: dict, fields: Fields) -> bytes:
    """One record: each declared field's little-endian bytes, in declaration order."""
    parts = []
    for name, f in fields.items():
        value = np.asarray(example[name])
        if value.shape != tuple(f.shape):
            raise ValueError(f"Field {name!r} has shape {value.shape}, declared {tuple(f.shape)}.")
        parts.append(np.ascontiguousarray(value, np.dtype(f.dtype).newbyteorder("<")).tobytes())
    return b"".join(parts)


def parse_record(data: bytes, fields: Fields) -> dict[str, np.ndarray]:
    """The inverse of `record_bytes`: a dict of arrays in the declared (native) dtypes."""
    example, offset = {}, 0
    for name, f in fields.items():
        dtype = np.dtype(f.dtype)
        count = int(np.prod(f.shape, dtype=np.int64))
        value = np.frombuffer(data, dtype.newbyteorder("<"), count, offset).reshape(f.shape)
        example[name] = value.astype(dtype, copy=False)
        offset += count * dtype.itemsize
    if offset != len(data):
        raise ValueError(f"A latent record has {len(data)} bytes, but its fields take {offset}.")
    return example


def write_shard(folder: Path, k: int, num_shards: int, records: Sequence[bytes]) -> Path:
    """Write shard k under a temporary name, then rename it: a reader never sees it half-written."""
    from array_record.python.array_record_module import ArrayRecordWriter

    path = folder / shard_name(k, num_shards)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    tmp.unlink(missing_ok=True)  # a stale one from an interrupted run
    writer = ArrayRecordWriter(str(tmp), "group_size:1")  # group size 1: fast random access (grain)
    try:
        for record in records:
            writer.write(record)
    finally:
        writer.close()
    tmp.replace(path)  # atomic on POSIX
    return path


def read_meta(folder: Path, spec: str) -> dict:
    """meta.json of a complete encode; a missing one raises, saying to (re)run encode.py."""
    if not folder.is_dir():
        raise FileNotFoundError(f"Latent folder not found: {folder} (from --dataset {spec}).")
    if not (folder / META).is_file():
        raise FileNotFoundError(f"{folder} has no {META}: the encode did not complete; {RERUN}.")
    return json.loads((folder / META).read_text())


class LatentSource:
    """Latents written by train/encode.py: records `{"mean": float16[h, w, c], "logvar":
    float16[h, w, c], ...the source's other fields (label)}`. `image_shape` is the latent
    shape (what the diffusion model sees); `meta` is the parsed meta.json."""

    def __init__(self, folder: str | Path, spec: str):
        folder = Path(folder)
        self.meta = read_meta(folder, spec)
        self.spec = spec
        self.fields = fields_from_meta(self.meta["fields"])
        self.image_shape = tuple(int(d) for d in self.meta["latent_shape"])
        self.num_classes = int(self.meta["num_classes"])
        n = int(self.meta["num_shards"])
        paths = [folder / shard_name(k, n) for k in range(n)]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder} lacks {len(missing)} of {n} shards ({missing[0]}, ...); {RERUN}.")
        self.records = grain.sources.ArrayRecordDataSource([str(p) for p in paths])
        if len(self.records) != self.meta["count"]:
            got, want = len(self.records), self.meta["count"]
            raise ValueError(f"{folder} holds {got} records, meta.json says {want}; {RERUN}.")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        return parse_record(self.records[i], self.fields)
