"""PyTorch state_dicts (safetensors files, or torch files read by eqxdiff.weights.torch_pickle) into
Equinox modules, by parameter name.

A module whose field names follow the PyTorch module's attribute names has leaf paths equal to
the state_dict keys (`encoder.down_blocks.0.resnets.1.conv1.weight`; a list field gives the
index). Each key is read exactly once; a missing or unexpected key, or a wrong shape, raises and
names it. Layouts differ only by an axis permutation per layer type (`LAYOUTS`): a conv kernel is
OIHW in PyTorch and HWIO here, a linear weight (out, in) there and (in, out) here. Every leaf is
built with `jax.make_array_from_callback` in its target sharding, and each callback reads only
its device's slice of the memory-mapped file, so no device ever holds a whole host copy. The
shardings come from the caller (`place`; `eqxdiff.sharding.placement(mesh, min_size)` gives the
training state's layout): a network knows nothing of meshes.
"""

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16", which safetensors' numpy reader asks for)
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding
from jax.typing import DTypeLike
from safetensors import safe_open

from eqxdiff.nn.layers import Conv2d, Dense
from eqxdiff.weights.tensor_readers import Tensors, TorchFile

# Per layer type, per field: `perm` with ours = np.transpose(torch's, perm).
LAYOUTS: dict[type, dict[str, tuple[int, ...]]] = {
    Conv2d: {"weight": (2, 3, 1, 0)},  # OIHW -> HWIO
    Dense: {"weight": (1, 0)},  # (out, in) -> (in, out)
}
FLOAT_DTYPES = {"F32", "F16", "BF16"}
# `place(abstract_module)`: a Sharding per array leaf (a pytree of the module's structure, None at the other leaves).
Place = Callable[[Any], Any]
TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")  # torch.save's files: read as tensors, never code


def is_array_like(x) -> bool:
    """A jax array or its abstract stand-in (ShapeDtypeStruct): the leaves that are read."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def leaf_layouts(module, layouts: Mapping[type, Mapping[str, tuple[int, ...]]] = LAYOUTS) -> dict[str, tuple[int, ...]]:
    """`{state_dict name: perm}` for every array leaf of `module` (arrays or ShapeDtypeStructs);
    identity unless the leaf is a field of a layer type in `layouts`."""
    is_layer = lambda x: isinstance(x, tuple(layouts))  # noqa: E731
    out = {}
    for path, node in jax.tree_util.tree_flatten_with_path(module, is_leaf=is_layer)[0]:
        prefix = _name(path)
        if is_layer(node):
            for field_path, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=is_array_like)[0]:
                field = _name(field_path)
                if is_array_like(leaf):
                    out[f"{prefix}.{field}"] = tuple(layouts[type(node)].get(field, range(leaf.ndim)))
        elif is_array_like(node):
            out[prefix] = tuple(range(node.ndim))
    return out


def load_safetensors(
    abstract_module,
    path: str | Path | Tensors | Sequence[str | Path],
    *,
    rename: Callable[[str], str | None] = lambda key: key,
    ignore: Collection[str] = (),
    place: Place | None = None,
    layouts: Mapping[type, Mapping[str, tuple[int, ...]]] = LAYOUTS,
    conv1x1_as_dense: bool = False,
    dtype: DTypeLike = np.float32,
):
    """`abstract_module` (e.g. from `eqx.filter_eval_shape`) with every array leaf read from the
    safetensors file at `path`, or from several (the shards of one state_dict: a key in two raises),
    as `dtype` (float32; bfloat16 casts each slice as it is read, no float32 copy of the model).

    `rename` maps a file key to the current name (older checkpoints' aliases, another codebase's
    names), or to None for a key that belongs to another model in the same file (it is not read);
    two file keys mapping to one name raise. `ignore` names (after `rename`) keys that are accepted
    and not read: buffers the module does not keep (transformers' `position_ids`). With
    `conv1x1_as_dense`, a Dense weight also loads from a 1x1 convolution's `[out, in, 1, 1]` (the
    same map; LDM's attention projections, diffusers' `conv_attn_to_linear`). With `place`, each
    leaf is read straight into its sharding in `place(abstract_module)`; without, onto the first
    device. F32, F16 and BF16 files load; a torch file (`TORCH_SUFFIXES`) loads as a state_dict
    (torch_pickle). `path` may also be an open reader (`tensor_readers.Tensors`: a state_dict taken out
    of a larger checkpoint).
    """
    perms = leaf_layouts(abstract_module, layouts)
    if place is None:
        device_sharding = SingleDeviceSharding(jax.devices()[0])
        shardings = {name: device_sharding for name in perms}
    else:
        shardings = dict(zip(perms, jax.tree.leaves(place(abstract_module)), strict=True))
    paths = [path] if isinstance(path, (str, Path, Tensors)) else list(path)
    where = paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} shards)"
    with ExitStack() as stack:
        files = _files_by_key([stack.enter_context(open_weights(p)) for p in paths], paths)
        keys = _renamed_keys(list(files), rename, where)
        keys = {name: key for name, key in keys.items() if name not in ignore}
        _check_names(set(perms), set(keys), where)
        values = [
            _read(files[keys[name]], keys[name], perm, shardings[name], leaf, conv1x1_as_dense, dtype)
            for (name, perm), leaf in zip(perms.items(), _array_leaves(abstract_module), strict=True)
        ]
    leaves, treedef = jax.tree.flatten(abstract_module, is_leaf=is_array_like)
    it = iter(values)
    return jax.tree.unflatten(treedef, [next(it) if is_array_like(x) else x for x in leaves])


def open_weights(path: str | Path | Tensors):
    """A reader of the file's tensors by name (`keys`, `get_slice`, `get_tensor`): safetensors'
    for a safetensors file, a `TorchFile` (eqxdiff.weights.tensor_readers over eqxdiff.weights.torch_pickle) for
    a torch file; an open reader as it is."""
    if isinstance(path, Tensors):
        return path
    if Path(path).suffix in TORCH_SUFFIXES:
        return TorchFile(path)
    return safe_open(str(path), framework="numpy")


def _array_leaves(module) -> list:
    return [x for x in jax.tree.leaves(module, is_leaf=is_array_like) if is_array_like(x)]


def _files_by_key(files: list, paths: list) -> dict:
    """`{key: the open file holding it}` over shards, raising if two shards hold one key."""
    out, origin = {}, {}
    for file, path in zip(files, paths, strict=True):
        for key in file.keys():
            if key in out:
                raise ValueError(f"key {key!r} is in two shards: {origin[key]} and {path}")
            out[key], origin[key] = file, path
    return out


def _renamed_keys(file_keys: list[str], rename: Callable[[str], str | None], path) -> dict[str, str]:
    """`{current name: file key}` (keys renamed to None left out), raising if two file keys give one name."""
    keys: dict[str, str] = {}
    for key in file_keys:
        name = rename(key)
        if name is None:
            continue
        if name in keys:
            raise ValueError(f"{path}: keys {keys[name]!r} and {key!r} are both the parameter {name!r}")
        keys[name] = key
    return keys


def _check_names(expected: set[str], found: set[str], path) -> None:
    """Raise naming the parameters the file lacks and the keys the model has no place for."""
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    problems = [
        f"{kind} keys ({len(keys)}): {', '.join(keys[:10])}{' ...' * (len(keys) > 10)}"
        for kind, keys in (("missing", missing), ("unexpected", unexpected))
        if keys
    ]
    if problems:
        raise ValueError(f"{path} does not match the model: " + "; ".join(problems))


def _read(
    file,
    key: str,
    perm: tuple[int, ...],
    sharding: Sharding,
    leaf,
    conv1x1_as_dense: bool = False,
    dtype: DTypeLike = np.float32,
) -> jax.Array:
    """One leaf as `dtype` in `sharding`; each device's callback reads only its slice."""
    tensor = file.get_slice(key)
    stored, torch_shape = tensor.get_dtype(), tuple(tensor.get_shape())
    if stored not in FLOAT_DTYPES:
        raise ValueError(f"{key}: dtype {stored} is not one of {sorted(FLOAT_DTYPES)}")
    if conv1x1_as_dense and perm == (1, 0) and len(torch_shape) > 2 and set(torch_shape[2:]) == {1}:
        return _read_squeezed(file, key, torch_shape[:2], perm, sharding, leaf, dtype)
    shape = tuple(torch_shape[p] for p in perm)
    if shape != tuple(leaf.shape):
        raise ValueError(
            f"{key}: shape {torch_shape} in the file is {shape} in our layout, the model expects {tuple(leaf.shape)}"
        )
    # replicated leaves: one read per distinct slice (the {} below), not one per device
    return jax.make_array_from_callback(
        shape, sharding, functools.partial(_read_slice, file, key, tensor, perm, dtype, {})
    )


def _read_slice(
    file, key: str, tensor, perm: tuple[int, ...], dtype: DTypeLike, cache: dict, index: tuple
) -> np.ndarray:
    """`_read`'s slice `index` (our layout) of `tensor` (`file`'s `key`, torch's layout), as `dtype` in ours; each
    distinct slice read once into `cache`. A module's function, not a closure in `_read`: the tests' import hook
    (tests/typechecked.py) would wrap a closure anew at every leaf read."""
    torch_index = [slice(None)] * len(perm)
    for axis, p in enumerate(perm):
        torch_index[p] = index[axis]
    cache_key = tuple((s.start, s.stop, s.step) for s in torch_index)
    if cache_key not in cache:
        part = tensor[tuple(torch_index)] if perm else np.asarray(file.get_tensor(key))
        # np.array, not np.ascontiguousarray: that makes a 0-d leaf (a scalar gain) 1-d.
        cache[cache_key] = np.array(np.transpose(part, perm), dtype=dtype, order="C")
    return cache[cache_key]


def _read_squeezed(
    file, key: str, torch_shape: tuple, perm: tuple[int, ...], sharding: Sharding, leaf, dtype: DTypeLike = np.float32
) -> jax.Array:
    """A 1x1 convolution kernel `[out, in, 1, ...]` as a Dense leaf (small: read whole, then sliced)."""
    shape = tuple(torch_shape[p] for p in perm)
    if shape != tuple(leaf.shape):
        raise ValueError(
            f"{key}: a 1x1 kernel of shape {torch_shape} is {shape} as a linear map, the model expects "
            f"{tuple(leaf.shape)}"
        )
    whole = np.ascontiguousarray(np.transpose(np.asarray(file.get_tensor(key)).reshape(torch_shape), perm), dtype)
    return jax.make_array_from_callback(shape, sharding, lambda index: whole[index])


def _name(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in path)
