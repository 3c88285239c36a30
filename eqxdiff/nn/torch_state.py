"""An Equinox module's array leaves as a PyTorch state_dict: the inverse of `torch_weights.load_safetensors`.

Names are the leaf paths (the state_dict keys, as the loader reads them); each leaf goes back to PyTorch's
layout by the inverse of its `LAYOUTS` permutation (HWIO -> OIHW, (in, out) -> (out, in)). A `Dense` that the
PyTorch module holds as a 1x1 convolution (what the loader's `conv1x1_as_dense` reads) is named in `as_conv1x1`
and written `[out, in, 1, 1]`.
"""

from collections.abc import Collection

import jax
import ml_dtypes  # noqa: F401  (numpy's "bfloat16")
import numpy as np
from jax.typing import DTypeLike

from eqxdiff.nn.torch_weights import is_array_like, leaf_layouts

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def file_dtype(dtype: DTypeLike | str) -> np.dtype:
    """float32, float16 or bfloat16 (a name, e.g. "fp16"/"bf16", or a dtype); anything else raises naming the three."""
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    name = aliases.get(dtype, dtype) if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: the weight files are written as float32, float16 or bfloat16")
    return np.dtype(DTYPES[name])


def torch_state_dict(
    module, *, dtype: DTypeLike | str = np.float32, as_conv1x1: Collection[str] = (), prefix: str = ""
) -> dict[str, np.ndarray]:
    """`{prefix + leaf path: host array in PyTorch's layout, as dtype}` for every array leaf of `module`, in
    leaf order. `as_conv1x1`: names (without prefix) of Dense weights to write as `[out, in, 1, 1]` kernels.
    A leaf spread over several processes raises (gather the model first)."""
    dtype = file_dtype(dtype)
    leaves = [x for x in jax.tree.leaves(module, is_leaf=is_array_like) if is_array_like(x)]
    layouts = leaf_layouts(module)
    unknown = sorted(set(as_conv1x1) - set(layouts))
    if unknown:
        raise ValueError(f"as_conv1x1 names leaves the module does not have: {unknown[:5]}")
    state = {}
    for (name, perm), leaf in zip(layouts.items(), leaves, strict=True):
        if not leaf.is_fully_addressable:
            raise ValueError(
                f"{name} is spread over several processes; gather the model first "
                "(jax.experimental.multihost_utils.process_allgather)"
            )
        array = np.transpose(np.asarray(leaf), np.argsort(perm))  # ours = transpose(torch's, perm)
        if name in as_conv1x1:
            if array.ndim != 2:
                raise ValueError(f"{name}: only a linear weight [out, in] becomes a 1x1 kernel, not {array.shape}")
            array = array[:, :, None, None]
        state[prefix + name] = np.ascontiguousarray(array, dtype=dtype)
    return state
