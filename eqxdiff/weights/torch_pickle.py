"""Torch files (`torch.save` of a state_dict: `.pth`, `.pt`, `.bin`) read into numpy without torch
and without running anything the file names.

A torch file is a pickle whose tensors point into raw storages: the zip format (torch >= 1.6:
`<archive>/data.pkl` plus one `<archive>/data/<key>` record per storage) or the legacy stream
(pickled magic number, protocol, system info, the object, the storage keys, then each storage as
an int64 element count and its bytes, little-endian). The pickle is read by a `pickle.Unpickler`
whose `find_class` hands out only numpy stand-ins for what torch's own `weights_only` unpickler
allows for plain tensors and containers — `torch._utils._rebuild_tensor_v2/_v3/_rebuild_tensor/
_rebuild_parameter`, the typed storage classes (`torch.FloatStorage`, ...), dtypes,
`collections.OrderedDict`, `torch.Size`, `_codecs.encode` (bytes) and `builtins.set/bytearray/
complex` — and refuses every other global by name, before anything is called (so also
`torch.storage._load_from_bytes`, which torch's rule refuses too: it calls torch.load). Objects the
reader hands the pickle refuse a BUILD (no state can be set on them). Storages are
memory-mapped where the file stores them uncompressed; globals the caller names in `skip`
(`argparse.Namespace`, the `"args"` of a training checkpoint) become inert `Skipped` placeholders
whose arguments and state are dropped, so nothing of theirs runs either; a tensor is a read-only strided view of its
storage, checked to lie inside it, so views that share a storage share memory as in torch.
Reference: torch 2.13's torch/serialization.py (`_save`, `_legacy_save`, `_load`, `_legacy_load`)
and torch/_weights_only_unpickler.py (`_get_allowed_globals`).
"""

import _compat_pickle
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch/serialization.py MAGIC_NUMBER
LEGACY_PROTOCOL = 1001
# torch's storage classes -> the element type of their bytes (UntypedStorage: raw bytes, _v3's tensors).
STORAGE_DTYPES = {
    "DoubleStorage": np.float64,
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
    "ComplexDoubleStorage": np.complex128,
    "ComplexFloatStorage": np.complex64,
    "UntypedStorage": np.uint8,
}
# torch dtypes by their global name (`_rebuild_tensor_v3`'s argument; `torch.float32` pickles as such).
TORCH_DTYPES = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "bool": np.bool_,
    "complex64": np.complex64,
    "complex128": np.complex128,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}


class TorchFileError(ValueError):
    """A torch file this reader refuses (a global outside the allowed set) or cannot read."""


class _Sealed:
    """Objects the pickle receives from this reader: a pickle's BUILD must not change them."""

    __slots__ = ()

    def __setstate__(self, state):
        raise pickle.UnpicklingError(f"the pickle tries to set the state of a {type(self).__name__}")


class _StorageType(_Sealed):
    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype):
        self.name, self.dtype = name, np.dtype(dtype)


class _DType(_Sealed):
    __slots__ = ("dtype",)

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)


class _Storage(_Sealed):
    """A storage the pickle refers to: `numel` elements of `dtype` at element `offset` of storage `key`."""

    __slots__ = ("key", "dtype", "numel", "offset")

    def __init__(self, key: str, dtype: np.dtype, numel: int, offset: int = 0):
        self.key, self.dtype, self.numel, self.offset = key, dtype, numel, offset


class _Tensor(_Sealed):
    """A tensor the pickle rebuilds: a strided view of `storage`, in elements of `dtype`; made an
    array once the storages are read (`_resolve`)."""

    __slots__ = ("storage", "offset", "shape", "strides", "dtype")

    def __init__(self, storage, offset, size, stride, dtype=None):
        if not isinstance(storage, _Storage):
            raise pickle.UnpicklingError(f"a tensor is rebuilt from a {type(storage).__name__}, not a storage")
        dtype = storage.dtype if dtype is None else dtype
        shape, strides = _ints(size, "size"), _ints(stride, "stride")
        offset = _ints((offset,), "storage offset")[0]
        numel = storage.numel * storage.dtype.itemsize // dtype.itemsize
        if len(shape) != len(strides):
            raise pickle.UnpicklingError(f"a tensor of size {shape} has strides {strides}")
        last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
        if 0 not in shape and last >= numel:
            raise pickle.UnpicklingError(
                f"a tensor of size {shape}, strides {strides}, offset {offset} reads past its storage of {numel}"
            )
        self.storage, self.offset, self.shape, self.strides, self.dtype = storage, offset, shape, strides, dtype


def _ints(values, what: str) -> tuple[int, ...]:
    if not isinstance(values, tuple | list) or not all(type(v) is int and v >= 0 for v in values):
        raise pickle.UnpicklingError(f"a tensor's {what} is {values!r}, not non-negative integers")
    return tuple(values)


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _Tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    return _Tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    if not isinstance(dtype, _DType):
        raise pickle.UnpicklingError(f"_rebuild_tensor_v3's dtype is a {type(dtype).__name__}")
    return _Tensor(storage, storage_offset, size, stride, dtype.dtype)


def _rebuild_parameter(data, requires_grad, backward_hooks):
    return data  # an nn.Parameter is its tensor here


def _encode(text, encoding="latin1"):
    """`_codecs.encode` as protocol-2 pickles use it for bytes: latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode of a {type(text).__name__} as {encoding!r}")
    return text.encode("latin1")


ALLOWED = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch.storage", "UntypedStorage"): _StorageType("UntypedStorage", np.uint8),
    ("torch", "Size"): tuple,
    ("_codecs", "encode"): _encode,
    ("builtins", "set"): set,
    ("builtins", "bytearray"): bytearray,
    ("builtins", "complex"): complex,
    **{
        (module, name): _StorageType(name, d)
        for name, d in STORAGE_DTYPES.items()
        for module in ("torch", "torch.cuda")
    },
    **{("torch", name): _DType(d) for name, d in TORCH_DTYPES.items()},
}


class Skipped:
    """What an object of a global the caller chose to skip reads as: its class's name only; the
    arguments and state the pickle gives it are dropped (BUILD included), nothing of the class runs."""

    __slots__ = ()
    global_name = "?"

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __repr__(self) -> str:
        return f"<skipped {self.global_name}>"


def _skipped(name: str) -> type:
    """A `Skipped` subclass standing in for the global `name` (a type, as the pickle's NEWOBJ needs)."""
    return type("Skipped", (Skipped,), {"__slots__": (), "global_name": name})


class _Unpickler(pickle.Unpickler):
    """Globals from ALLOWED only, or `Skipped` for those named in `skip` ("module.name"); persistent
    ids (storages) through `storage(key, dtype, numel, view)`."""

    def __init__(self, file, storage, where: str, skip: Collection[str] = ()):
        super().__init__(file)
        self._storage, self._where, self._skip = storage, where, frozenset(skip)

    def find_class(self, module: str, name: str):
        if (module, name) in _compat_pickle.NAME_MAPPING:  # Python 2 names (protocol 2), as pickle's own
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if f"{module}.{name}" in self._skip:
            return _skipped(f"{module}.{name}")
        if (module, name) not in ALLOWED:
            raise TorchFileError(
                f"{self._where}: refused the global {module}.{name}: a torch file is read as tensors and plain "
                "containers only (torch's weights_only rule), nothing it names is run"
            )
        return ALLOWED[(module, name)]

    def persistent_load(self, pid):
        if not isinstance(pid, tuple) or not pid:
            raise pickle.UnpicklingError(f"persistent id {pid!r} is not a storage")
        kind = pid[0].decode("ascii") if isinstance(pid[0], bytes) else pid[0]
        if kind == "module":
            raise TorchFileError(
                f"{self._where}: holds a pickled nn.Module (torch.save(model)); save model.state_dict() instead"
            )
        if kind != "storage" or len(pid) not in (5, 6) or not isinstance(pid[1], _StorageType):
            raise pickle.UnpicklingError(f"persistent id {pid!r} is not a storage")
        storage_type, key, numel = pid[1], str(pid[2]), pid[4]
        if type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(f"storage {key} has {numel!r} elements")
        view = pid[5] if len(pid) == 6 else None
        return self._storage(key, storage_type.dtype, numel, view)


def _load(file, where: str, storage=None, skip: Collection[str] = ()) -> Any:
    return _Unpickler(file, storage or _no_storage, where, skip).load()


def _no_storage(key, dtype, numel, view):
    raise pickle.UnpicklingError(f"a storage where the format has none ({key})")


def _resolve(obj, arrays: dict[str, np.ndarray], seen: dict[int, tuple]) -> Any:
    """`obj` with every _Tensor replaced by a read-only view of its storage's array; dicts and lists
    updated in place, tuples rebuilt. `seen` maps id -> (object, result): shared objects resolve
    once, and a container that holds itself ends the walk."""
    if id(obj) in seen:
        return seen[id(obj)][1]
    if isinstance(obj, _Tensor):
        storage, size = obj.storage, obj.dtype.itemsize
        data = arrays[storage.key][storage.offset : storage.offset + storage.numel]
        if obj.dtype != storage.dtype:  # _v3: a typed tensor on raw bytes
            data = data[: data.size - data.size % size].view(obj.dtype)
        strides = [s * size for s in obj.strides]
        out = np.lib.stride_tricks.as_strided(data[obj.offset :], obj.shape, strides, writeable=False)
    elif isinstance(obj, dict | list):
        seen[id(obj)] = (obj, obj)
        for k, v in list(obj.items() if isinstance(obj, dict) else enumerate(obj)):
            obj[k] = _resolve(v, arrays, seen)
        out = obj
    elif isinstance(obj, tuple):
        out = tuple(_resolve(v, arrays, seen) for v in obj)
    else:
        out = obj
    seen[id(obj)] = (obj, out)
    return out


def _mapped(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """`nbytes` bytes of the file at `offset`, read-only and memory-mapped."""
    if nbytes == 0:
        return np.zeros(0, np.uint8)
    return np.memmap(path, np.uint8, mode="r", offset=offset, shape=(nbytes,))


def _read_zip(path: Path, skip: Collection[str] = ()) -> Any:
    with zipfile.ZipFile(path) as archive:
        pickles = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise TorchFileError(f"{path}: a zip archive with {len(pickles)} data.pkl records is not a torch.save file")
        prefix = pickles[0][: -len("data.pkl")]
        names = set(archive.namelist())
        big = f"{prefix}byteorder" in names and archive.read(f"{prefix}byteorder").strip() == b"big"
        wanted: dict[str, tuple[np.dtype, int]] = {}

        def storage(key, dtype, numel, view):
            if view is not None:
                raise pickle.UnpicklingError(f"storage {key}: a legacy storage view in a zip file")
            if key in wanted and wanted[key] != (dtype, numel):
                raise pickle.UnpicklingError(f"storage {key} is read as two dtypes or sizes")
            wanted[key] = (dtype, numel)
            return _Storage(key, dtype, numel)

        with archive.open(pickles[0]) as file:
            obj = _load(file, str(path), storage, skip)
        arrays = {}
        for key, (dtype, numel) in wanted.items():
            info = archive.getinfo(f"{prefix}data/{key}")
            if info.file_size != numel * dtype.itemsize:
                raise TorchFileError(f"{path}: storage {key} holds {info.file_size} bytes, not {numel} × {dtype}")
            if info.compress_type == zipfile.ZIP_STORED:  # torch writes its records uncompressed
                with path.open("rb") as file:  # the local header: 30 bytes, then a name and an extra field
                    file.seek(info.header_offset)
                    name_len, extra_len = struct.unpack("<26xHH", file.read(30))
                raw = _mapped(path, info.header_offset + 30 + name_len + extra_len, info.file_size)
            else:
                raw = np.frombuffer(archive.read(info), np.uint8)
            arrays[key] = raw.view(dtype.newbyteorder(">") if big and dtype.itemsize > 1 else dtype)
    return _resolve(obj, arrays, {})


def _read_legacy(path: Path, skip: Collection[str] = ()) -> Any:
    with path.open("rb") as file:
        try:
            magic = _load(file, str(path))
        except (pickle.UnpicklingError, EOFError):
            magic = None
        if magic != LEGACY_MAGIC:
            raise TorchFileError(f"{path} is not a torch.save file (neither a zip archive nor torch's legacy stream)")
        if _load(file, str(path)) != LEGACY_PROTOCOL:
            raise TorchFileError(f"{path}: a legacy torch file of an unknown protocol version")
        _load(file, str(path))  # system info: storages are little-endian whatever it says
        roots: dict[str, tuple[np.dtype, int]] = {}

        def storage(key, dtype, numel, view):
            if roots.setdefault(key, (dtype, numel)) != (dtype, numel):  # a view's id carries its root's too
                raise pickle.UnpicklingError(f"storage {key} is read as two dtypes or sizes")
            if view is None:
                return _Storage(key, dtype, numel)
            view_key, offset, view_numel = view  # storage views of torch < 0.4
            if (
                type(offset) is not int
                or type(view_numel) is not int
                or offset < 0
                or view_numel < 0
                or offset + view_numel > roots[key][1]
            ):
                raise pickle.UnpicklingError(f"storage view {view_key} lies outside storage {key}")
            return _Storage(key, dtype, view_numel, offset)

        obj = _load(file, str(path), storage, skip)
        keys = _load(file, str(path))
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise TorchFileError(f"{path}: its list of storages is a {type(keys).__name__}")
        arrays, offset, size = {}, file.tell(), path.stat().st_size
        for key in keys:
            if key not in roots:
                raise TorchFileError(f"{path}: storage {key} is listed but never used")
            dtype, numel = roots[key]
            file.seek(offset)
            header = file.read(8)
            if len(header) < 8 or offset + 8 + numel * dtype.itemsize > size:
                raise TorchFileError(f"{path} is truncated: storage {key} ends past its {size} bytes")
            (count,) = struct.unpack("<q", header)
            if count != numel:
                raise TorchFileError(f"{path}: storage {key} holds {count} elements, its tensors say {numel}")
            arrays[key] = _mapped(path, offset + 8, numel * dtype.itemsize).view(dtype.newbyteorder("<"))
            offset += 8 + numel * dtype.itemsize
    missing = sorted(set(roots) - set(arrays))
    if missing:
        raise TorchFileError(f"{path}: storages {missing[:5]} are used but not stored")
    return _resolve(obj, arrays, {})


def read_torch_file(path: str | Path, *, skip: Collection[str] = ()) -> Any:
    """The object `torch.save` wrote to `path`, with every tensor a read-only numpy array (a view
    of its storage, memory-mapped where the file allows; `np.array(x)` for a copy) and containers
    as pickled (dict, OrderedDict, list, tuple, ...). Objects of the globals named in `skip`
    ("module.name", e.g. "argparse.Namespace") read as inert `Skipped` placeholders. Raises
    TorchFileError naming any other global than plain tensors' and containers' (nothing from the
    file runs), and for a file that is not torch's zip or legacy format."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return _read_zip(path, skip) if zipfile.is_zipfile(path) else _read_legacy(path, skip)
    except TorchFileError:
        raise
    except (
        pickle.UnpicklingError,
        EOFError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
        ValueError,
        RecursionError,
        struct.error,
    ) as e:
        raise TorchFileError(f"{path}: not a torch state file this reader can read ({type(e).__name__}: {e})") from None


def read_state_dict(path: str | Path) -> dict[str, np.ndarray]:
    """A state_dict file as `{name: array}`, in the file's order; nested dicts (a checkpoint of
    several state_dicts) give dotted names. A value that is neither a tensor nor a dict raises,
    naming it: take the state_dict out of such a checkpoint with `read_torch_file`."""
    path = Path(path)
    obj = read_torch_file(path)
    if not isinstance(obj, dict):
        raise TorchFileError(f"{path} holds a {type(obj).__name__}, not a state_dict (a dict of tensors)")
    return dict(_flatten(obj, "", path))


def _flatten(tree: dict, prefix: str, path: Path) -> Iterator[tuple[str, np.ndarray]]:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, f"{name}.", path)
        elif isinstance(value, np.ndarray):
            yield name, value
        else:
            raise TorchFileError(f"{path}: {name!r} is a {type(value).__name__}, not a tensor (not a state_dict)")
