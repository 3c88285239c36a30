"""A state_dict of numpy arrays written as `torch.save` writes one (its zip format), without torch.

The file is what torch 2.x's `torch.save(OrderedDict(state))` gives for contiguous CPU tensors: a zip of
uncompressed records under `archive/` — `data.pkl`, a protocol-2 pickle of an `OrderedDict` whose
values are `torch._utils._rebuild_tensor_v2(storage, 0, shape, contiguous strides, False, OrderedDict())`
with each storage a persistent id `("storage", torch.<Type>Storage, key, "cpu", numel)`; `data/<key>`,
each storage's little-endian bytes, aligned to 64 bytes in the file as torch aligns them (so readers
can memory-map them); `byteorder` and `version`. Only globals torch's `weights_only` loader allows
appear, so `torch.load(path)` (weights_only by default) and eqxdiff's `read_torch_file` both read it.
The pickle is written opcode by opcode: pickling stand-in classes would need torch to name its globals.
"""

import pickle
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from eqxdiff.weights.torch_pickle import STORAGE_DTYPES

# numpy dtype -> torch's storage class name (the typed storages of torch's legacy pickles, still what it writes).
STORAGES = {np.dtype(dtype): name for name, dtype in STORAGE_DTYPES.items() if name != "UntypedStorage"}
ALIGNMENT = 64  # torch/serialization.py: records start on 64-byte boundaries


def _text(s: str) -> bytes:
    data = s.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _int(n: int) -> bytes:
    if -(2**31) <= n < 2**31:
        return pickle.BININT + struct.pack("<i", n)
    data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return pickle.LONG1 + bytes([len(data)]) + data


def _ints(values) -> bytes:
    return pickle.MARK + b"".join(_int(int(v)) for v in values) + pickle.TUPLE


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


EMPTY_ORDERED_DICT = _global("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE


def _tensor(key: str, array: np.ndarray) -> bytes:
    """`_rebuild_tensor_v2` of a contiguous tensor on storage `key` (element strides: C order)."""
    strides = [s // array.itemsize for s in array.strides] if array.size else [1] * array.ndim
    storage = (
        pickle.MARK
        + _text("storage")
        + _global("torch", STORAGES[array.dtype])
        + _text(key)
        + _text("cpu")
        + _int(array.size)
        + pickle.TUPLE
        + pickle.BINPERSID
    )
    args = pickle.MARK + storage + _int(0) + _ints(array.shape) + _ints(strides) + pickle.NEWFALSE + EMPTY_ORDERED_DICT
    return _global("torch._utils", "_rebuild_tensor_v2") + args + pickle.TUPLE + pickle.REDUCE


def save_torch_state_dict(state: Mapping[str, np.ndarray], path: str | Path, *, archive: str = "archive") -> Path:
    """`state` ({name: array}, in order) as a torch zip file at `path` that `torch.load` returns as an
    `OrderedDict` of CPU tensors (a bare state_dict, as DiT-XL-2-256x256.pt is). dtypes: those torch has
    storages for (float32, float16, bfloat16, int64, ...). Returns `path`."""
    arrays = {name: np.asarray(a, order="C") for name, a in state.items()}  # not ascontiguousarray: 0-d stays 0-d
    unknown = {name: a.dtype for name, a in arrays.items() if a.dtype not in STORAGES}
    if unknown:
        raise ValueError(f"save_torch_state_dict: no torch storage for {unknown}")
    body = b"".join(_text(name) + _tensor(str(i), a) for i, (name, a) in enumerate(arrays.items()))
    data_pkl = pickle.PROTO + bytes([2]) + EMPTY_ORDERED_DICT + pickle.MARK + body + pickle.SETITEMS + pickle.STOP
    path = Path(path)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        _record(zf, f"{archive}/data.pkl", data_pkl)
        _record(zf, f"{archive}/byteorder", b"little")
        for i, a in enumerate(arrays.values()):
            _record(zf, f"{archive}/data/{i}", a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
        _record(zf, f"{archive}/version", b"3\n")
    return path


def _record(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    """One uncompressed record whose bytes start on an `ALIGNMENT` boundary: the local header's extra
    field is padded (id "FB", as torch's writer pads)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    start = zf.fp.tell() + 30 + len(name.encode()) + 4  # local header, the name, the extra field's own header
    pad = -start % ALIGNMENT
    info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
    zf.writestr(info, data, compress_type=zipfile.ZIP_STORED)
