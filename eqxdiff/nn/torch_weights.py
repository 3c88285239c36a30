"""PyTorch state_dicts (safetensors files, or torch files read by eqxdiff.nn.torch_pickle) into
Equinox modules, by parameter name.

A module whose field names follow the PyTorch module's attribute names has leaf paths equal to
the state_dict keys (`encoder.down_blocks.0.resnets.1.conv1.weight`; a list field gives the
index). Each key is read exactly once; a missing or unexpected key, or a wrong shape, raises and
names it. Layouts differ only by an axis permutation per layer type (`LAYOUTS`): a conv kernel is
OIHW in PyTorch and HWIO here, a linear weight (out, in) there and (in, out) here. Every leaf is
built with `jax.make_array_from_callback` in its target sharding, and each callback reads only
its device's slice of the memory-mapped file, so no device ever holds a whole host copy.
"""

from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import jax
import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16", which safetensors' numpy reader asks for)
import numpy as np
from jax.sharding import Mesh, Sharding, SingleDeviceSharding
from safetensors import safe_open

from eqxdiff.nn.layers import Conv2d, Dense
from eqxdiff.nn.torch_pickle import TorchFile
from eqxdiff.sharding import is_array_like, state_shardings

# Per layer type, per field: `perm` with ours = np.transpose(torch's, perm).
LAYOUTS: dict[type, dict[str, tuple[int, ...]]] = {
    Conv2d: {"weight": (2, 3, 1, 0)},  # OIHW -> HWIO
    Dense: {"weight": (1, 0)},  # (out, in) -> (in, out)
}
FLOAT_DTYPES = {"F32", "F16", "BF16"}
TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")  # torch.save's files: read as tensors, never code


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
    path: str | Path,
    *,
    rename: Callable[[str], str] = lambda key: key,
    ignore: Collection[str] = (),
    mesh: Mesh | None = None,
    min_size: int = 2**12,
    layouts: Mapping[type, Mapping[str, tuple[int, ...]]] = LAYOUTS,
):
    """`abstract_module` (e.g. from `eqx.filter_eval_shape`) with every array leaf read from the
    safetensors file at `path`, as float32.

    `rename` maps a file key to the current name (older checkpoints' aliases); two file keys
    mapping to one name raise. `ignore` names (after `rename`) keys that are accepted and not read:
    buffers the module does not keep (transformers' `position_ids`). With `mesh`, leaves are placed
    in `eqxdiff.sharding`'s shardings for `(mesh, min_size)`; without, on the first device. F32, F16
    and BF16 files load; a torch file (`TORCH_SUFFIXES`) loads as a state_dict (torch_pickle).
    """
    perms = leaf_layouts(abstract_module, layouts)
    if mesh is None:
        device_sharding = SingleDeviceSharding(jax.devices()[0])
        shardings = {name: device_sharding for name in perms}
    else:
        tree = state_shardings(abstract_module, mesh, min_size)
        shardings = dict(zip(perms, jax.tree.leaves(tree), strict=True))
    with open_weights(path) as file:
        keys = _renamed_keys(list(file.keys()), rename, path)
        keys = {name: key for name, key in keys.items() if name not in ignore}
        _check_names(set(perms), set(keys), path)
        values = [
            _read(file, keys[name], perm, shardings[name], leaf)
            for (name, perm), leaf in zip(perms.items(), _array_leaves(abstract_module), strict=True)
        ]
    leaves, treedef = jax.tree.flatten(abstract_module, is_leaf=is_array_like)
    it = iter(values)
    return jax.tree.unflatten(treedef, [next(it) if is_array_like(x) else x for x in leaves])


def open_weights(path: str | Path):
    """A reader of the file's tensors by name (`keys`, `get_slice`, `get_tensor`): safetensors'
    for a safetensors file, eqxdiff.nn.torch_pickle's for a torch file."""
    if Path(path).suffix in TORCH_SUFFIXES:
        return TorchFile(path)
    return safe_open(str(path), framework="numpy")


def _array_leaves(module) -> list:
    return [x for x in jax.tree.leaves(module, is_leaf=is_array_like) if is_array_like(x)]


def _renamed_keys(file_keys: list[str], rename: Callable[[str], str], path) -> dict[str, str]:
    """`{current name: file key}`, raising if two file keys give one name."""
    keys: dict[str, str] = {}
    for key in file_keys:
        name = rename(key)
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


def _read(file, key: str, perm: tuple[int, ...], sharding: Sharding, leaf) -> jax.Array:
    """One leaf as float32 in `sharding`; each device's callback reads only its slice."""
    tensor = file.get_slice(key)
    dtype, torch_shape = tensor.get_dtype(), tuple(tensor.get_shape())
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{key}: dtype {dtype} is not one of {sorted(FLOAT_DTYPES)}")
    shape = tuple(torch_shape[p] for p in perm)
    if shape != tuple(leaf.shape):
        raise ValueError(
            f"{key}: shape {torch_shape} in the file is {shape} in our layout, the model expects {tuple(leaf.shape)}"
        )
    cache: dict = {}  # replicated leaves: one read per distinct slice, not one per device

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        torch_index = [slice(None)] * len(perm)
        for axis, p in enumerate(perm):
            torch_index[p] = index[axis]
        cache_key = tuple((s.start, s.stop, s.step) for s in torch_index)
        if cache_key not in cache:
            part = tensor[tuple(torch_index)] if perm else np.asarray(file.get_tensor(key))
            cache[cache_key] = np.ascontiguousarray(np.transpose(part, perm), dtype=np.float32)
        return cache[cache_key]

    return jax.make_array_from_callback(shape, sharding, shard)


def _name(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in path)

