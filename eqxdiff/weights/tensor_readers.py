"""A `{name: array}` state_dict behind safetensors' reader interface (`keys`, `get_slice`,
`get_tensor`, a context manager), so eqxdiff.nn.torch_weights loads safetensors files, torch files
(read by eqxdiff.weights.torch_pickle) and state_dicts taken out of larger checkpoints alike."""

from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from eqxdiff.weights.torch_pickle import read_state_dict

# numpy dtype -> safetensors' dtype names, for `get_slice(...).get_dtype()`
SAFETENSORS_NAMES = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}


class Tensors:
    """`{name: array}` behind safetensors' reader interface (`keys`, `get_slice`, `get_tensor`), so
    eqxdiff.nn.torch_weights loads a state_dict taken out of a larger checkpoint; `where` names it
    in errors."""

    def __init__(self, tensors: Mapping[str, np.ndarray], where: str):
        self.tensors, self.where = dict(tensors), where

    def __str__(self) -> str:
        return self.where

    def __enter__(self) -> "Tensors":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_tensor(self, key: str) -> np.ndarray:
        return self.tensors[key]

    def get_slice(self, key: str) -> "_Slice":
        return _Slice(self.tensors[key])


class TorchFile(Tensors):
    """A state_dict file behind safetensors' reader interface (`keys`, `get_slice`, `get_tensor`),
    so eqxdiff.nn.torch_weights loads torch files and safetensors files alike."""

    def __init__(self, path: str | Path):
        super().__init__(read_state_dict(path), str(path))


class _Slice:
    def __init__(self, array: np.ndarray):
        self.array = array

    def get_dtype(self) -> str:
        dtype = self.array.dtype.newbyteorder("=")
        return SAFETENSORS_NAMES.get(dtype, str(dtype))

    def get_shape(self) -> list[int]:
        return list(self.array.shape)

    def __getitem__(self, index) -> np.ndarray:
        return self.array[index]
