"""Pre-encoded latents (written once by train/encode.py) as a record source: `latents:DIR`.

The folder holds `meta.json` and ArrayRecord shards `shard-SSSSS-of-NNNNN.array_record`: shard
k holds global examples [k·shard_size, min((k+1)·shard_size, count)), so the shards in name order
are the examples in order, whatever the number of processes that wrote them. A shard is written
under `<name>.tmp` and renamed when complete; `meta.json` is written last, once every shard
exists, so it marks a complete encode. In a bucket (`--out gs://...`) each shard is written locally and
uploaded as one object (which appears whole or not at all), and the folder is read from its local copy
(eqxdiff/local_copies.py): ArrayRecord reads local files only.

A record is the raw little-endian bytes of each field, concatenated in the order meta.json's
`fields` lists them (no pickle, no header); a text field (a caption) is a little-endian uint32
byte count, then that many bytes of UTF-8. meta.json:

    fields          {name: {"dtype": "float16", "shape": [h, w, c]}, ...} ({"dtype": "text"} for
                    text): "mean", "logvar", then every field of the image source except "image"
                    (e.g. "label", and "caption", the raw caption, for a captioned source); with a
                    text encoder then "input_ids", "attention_mask" int32[n] (its tokenizer's,
                    n = text.max_length) and, when text.encoded, "context" float16[n, d] (the
                    tower's last hidden states) and "pooled" float16[d] (its pooled vector)
    vae             eqxdiff.autoencoders.describe_autoencoder's {"spec", "path", "weights_sha256"}
    scaling_factor, shift_factor   the VAE's: the model sees (z - shift_factor) · scaling_factor
    latent_shape    [h, w, c];  count, shard_size, num_shards;  num_classes
    class_names     the label names (index = label; a folder's sub-folders), or null (bare label ids)
    source          the image dataset spec;  image_shape  its [H, W, C]
    hflip_copies    whether examples count/2 .. count-1 are examples 0 .. count/2-1 mirrored
    text            only when encoded with a text encoder (train/encode.py --text_encoder):
                    {"text_encoder": its absolute folder, "weights_sha256": of its model.safetensors,
                     "tokenizer": the tokenizer's absolute folder, "tokenizer_sha256": of its files
                     (`tokenizer_files_sha256`), "max_length": n, "null_text": "empty" | "zeros",
                     "encoded": whether records hold "context" and "pooled",
                     "null": {"file": "null_text.npz", "sha256": of that file}}

`null_text.npz` (beside meta.json, named by text.null.file) is the run's null condition for
classifier-free guidance, `eqxdiff.text.conditioning.TextConditioning.encoded_null()`, a TextCond
stored by its fields' names: "context" float32[1, n, d] and "pooled" float32[1, d] (the encoded
empty caption "", or zeros for null_text "zeros"), "mask" int32[1, n] (the tokens of "").
`LatentSource.text_null()` reads it back as a TextCond.
"""

import hashlib
import io
import json
import os
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path

import grain
import jax
import numpy as np

from eqxdiff.data.records import TEXT, Fields, TextField
from eqxdiff.local_copies import local_copy, upload
from eqxdiff.nn.text_cond import TextCond
from eqxdiff.paths import as_path, is_url

META = "meta.json"
TMP_SUFFIX = ".tmp"
RERUN = "(re)run train/encode.py with the same flags to complete it"
NULL_FILE = "null_text.npz"
_TEXT_LEN = struct.Struct("<I")  # a text field's byte count


def shard_name(k: int, num_shards: int) -> str:
    """The file name of shard k of num_shards."""
    return f"shard-{k:05d}-of-{num_shards:05d}.array_record"


def fields_to_meta(fields: Fields) -> dict[str, dict]:
    """Declared fields -> meta.json's `fields` (order kept: it is the record's byte order); a text
    field is `{"dtype": "text"}`."""
    return {
        k: {"dtype": "text"} if isinstance(f, TextField) else {"dtype": np.dtype(f.dtype).name, "shape": list(f.shape)}
        for k, f in fields.items()
    }


def fields_from_meta(meta_fields: dict[str, dict]) -> dict[str, jax.ShapeDtypeStruct | TextField]:
    return {
        k: TEXT if f["dtype"] == "text" else jax.ShapeDtypeStruct(tuple(f["shape"]), np.dtype(f["dtype"]))
        for k, f in meta_fields.items()
    }


def record_bytes(example: dict, fields: Fields) -> bytes:
    """One record: each declared field's little-endian bytes, in declaration order."""
    parts = []
    for name, f in fields.items():
        if isinstance(f, TextField):
            if not isinstance(example[name], str):
                raise ValueError(f"Field {name!r} is text, got {type(example[name]).__name__}.")
            text = example[name].encode("utf-8")
            parts += [_TEXT_LEN.pack(len(text)), text]
            continue
        value = np.asarray(example[name])
        if value.shape != tuple(f.shape):
            raise ValueError(f"Field {name!r} has shape {value.shape}, declared {tuple(f.shape)}.")
        parts.append(np.ascontiguousarray(value, np.dtype(f.dtype).newbyteorder("<")).tobytes())
    return b"".join(parts)


def parse_record(data: bytes, fields: Fields) -> dict[str, np.ndarray | str]:
    """The inverse of `record_bytes`: a dict of arrays in the declared (native) dtypes (str for text)."""
    example, offset = {}, 0
    for name, f in fields.items():
        if isinstance(f, TextField):
            (size,) = _TEXT_LEN.unpack_from(data, offset)
            offset += _TEXT_LEN.size
            example[name] = data[offset : offset + size].decode("utf-8")
            offset += size
            continue
        dtype = np.dtype(f.dtype)
        count = int(np.prod(f.shape, dtype=np.int64))
        value = np.frombuffer(data, dtype.newbyteorder("<"), count, offset).reshape(f.shape)
        example[name] = value.astype(dtype, copy=False)
        offset += count * dtype.itemsize
    if offset != len(data):
        raise ValueError(f"A latent record has {len(data)} bytes, but its fields take {offset}.")
    return example


def write_shard(folder: os.PathLike, k: int, num_shards: int, records: Sequence[bytes]) -> os.PathLike:
    """Write shard k under a temporary name, then rename it: a reader never sees it half-written. In a bucket
    (ArrayRecord writes local files only): written in a local temporary folder, then uploaded as one object."""
    from array_record.python.array_record_module import ArrayRecordWriter

    if is_url(folder):
        with tempfile.TemporaryDirectory() as tmp:
            local = write_shard(Path(tmp), k, num_shards, records)
            upload(local, folder / local.name)
        return folder / local.name
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


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_files_sha256(folder: str | Path) -> str:
    """Hex SHA-256 naming a tokenizer folder's content wherever it lies: over each of
    `TOKENIZER_FILES` present, in that order, its name, a NUL, the SHA-256 of its bytes."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(folder) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def null_npz_bytes(null: TextCond) -> bytes:
    """`null_text.npz`'s bytes for an encoded null: its context, mask, pooled as "context" float32,
    "mask" int32, "pooled" float32 (numpy's npz, whose zip entries carry a fixed date: equal arrays
    give equal bytes)."""
    buffer = io.BytesIO()
    dtypes = {"context": np.float32, "mask": np.int32, "pooled": np.float32}
    np.savez(buffer, **{k: np.asarray(v, dtypes[k]) for k, v in null.as_dict().items()})
    return buffer.getvalue()


def read_meta(folder: os.PathLike, spec: str) -> dict:
    """meta.json of a complete encode; a missing one raises, saying to (re)run encode.py."""
    if not folder.is_dir():
        raise FileNotFoundError(f"Latent folder not found: {folder} (from --dataset {spec}).")
    if not (folder / META).is_file():
        raise FileNotFoundError(f"{folder} has no {META}: the encode did not complete; {RERUN}.")
    return json.loads((folder / META).read_text())


class LatentSource:
    """Latents written by train/encode.py: records `{"mean": float16[h, w, c], "logvar":
    float16[h, w, c], ...the source's other fields (label)}`, plus, when encoded with a text
    encoder, `"input_ids", "attention_mask": int32[n]` and (text.encoded) `"context":
    float16[n, d], "pooled": float16[d]`. `image_shape` is the latent shape (what the diffusion
    model sees); `meta` is the parsed meta.json (`meta.get("text")`: the text side, or None).

    A stored raw caption is a TEXT field, which cannot be batched: it is declared (and read) only
    with `captions=True`, e.g. to tokenize it again with `eqxdiff.data.TokenizedSource`; by default
    records carry every other field."""

    def __init__(self, folder: str | os.PathLike, spec: str, captions: bool = False):
        folder = as_path(folder)
        self.folder = folder  # as given: a URL's latents are read from their local copy (local_copies.local_copy)
        self.meta = read_meta(folder, spec)
        local = local_copy(folder)
        self.spec = spec
        self.record_fields = fields_from_meta(self.meta["fields"])  # what each record's bytes hold
        text = [k for k, f in self.record_fields.items() if isinstance(f, TextField)]
        if captions and not text:
            raise ValueError(
                f"{folder} stores no captions (its fields: {sorted(self.record_fields)}): encode a captioned"
                " dataset with train/encode.py to keep them, or open it without captions."
            )
        hidden = () if captions else text
        self.fields = {k: f for k, f in self.record_fields.items() if k not in hidden}
        self.image_shape = tuple(int(d) for d in self.meta["latent_shape"])
        self.num_classes = int(self.meta["num_classes"])
        self.class_names = self.meta.get("class_names")  # None: bare label ids (or an encode without names)
        n = int(self.meta["num_shards"])
        paths = [local / shard_name(k, n) for k in range(n)]
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
        record = parse_record(self.records[i], self.record_fields)
        return {k: record[k] for k in self.fields}

    def caption(self, i: int) -> str:
        """Example i's stored raw caption, also when records are read without it (`captions=False`:
        what training on pre-encoded text does, which still draws its sample grids' prompts from it)."""
        if "caption" not in self.record_fields:
            raise KeyError(f"{self.folder} stores no captions (its fields: {sorted(self.record_fields)}).")
        return str(parse_record(self.records[i], self.record_fields)["caption"])

    def text_null(self) -> TextCond:
        """The null condition the encode stored with text latents (`null_text.npz`): TextCond(context
        float32[1, n, d], mask int32[1, n], pooled float32[1, d]). Latents encoded without a text
        encoder, or a file that is missing or not the one meta.json names, raise."""
        if "text" not in self.meta:
            raise ValueError(f"{self.folder} was encoded without a text encoder: it stores no null text condition.")
        path = as_path(self.folder) / self.meta["text"]["null"]["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{path} (the null text condition meta.json names) is missing; {RERUN}.")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.meta["text"]["null"]["sha256"]:
            raise ValueError(f"{path} is not the file meta.json names (its sha256 differs); {RERUN}.")
        with np.load(io.BytesIO(data)) as arrays:
            return TextCond.from_dict(arrays)
