"""FSDP by leaf: a ('data', 'fsdp') mesh and one size-threshold rule for every array leaf.

Parameters, EMA and optimizer moments all get their PartitionSpec from `fsdp_spec`, so a
moment is sharded exactly like its parameter; GSPMD inserts the all-gathers and
reduce-scatters. The batch is split over both axes. `fsdp=1` is plain data parallelism.
"""

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp")


def make_mesh(data: int = -1, fsdp: int = 1, devices: list | None = None) -> Mesh:
    """A (data, fsdp) mesh over `devices` (default: all). `data=-1` takes what fsdp leaves.

    Axis types are Auto: with Explicit axes (jax.make_mesh's default) Equinox layers fail to
    trace (jax 0.10.2, equinox 0.13.8).
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if fsdp < 1 or n % fsdp:
        raise ValueError(f"fsdp={fsdp} must be >= 1 and divide the {n} devices.")
    if data == -1:
        data = n // fsdp
    if data < 1 or data * fsdp != n:
        raise ValueError(
            f"Mesh data={data} x fsdp={fsdp} = {data * fsdp} devices, but {n} are present; "
            f"pass data=-1 to use all of them, or choose sizes whose product is {n}."
        )
    return Mesh(np.asarray(devices).reshape(data, fsdp), AXES, axis_types=(AxisType.Auto,) * 2)


def fsdp_spec(shape: tuple[int, ...], fsdp_size: int, min_size: int) -> P:
    """Shard a leaf of `shape` over 'fsdp' along its largest dimension divisible by fsdp_size
    (ties: the earliest such axis), if it has at least `min_size` elements; else replicate."""
    if fsdp_size == 1 or int(np.prod(shape, dtype=np.int64)) < min_size:
        return P()
    candidates = [(size, -axis) for axis, size in enumerate(shape) if size % fsdp_size == 0]
    if not candidates:
        return P()
    axis = -max(candidates)[1]
    return P(*([None] * axis), "fsdp")  # no trailing Nones: the form JAX reports back


def _is_array_like(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def state_shardings(abstract_state, mesh: Mesh, min_size: int):
    """NamedSharding for every array leaf of `abstract_state` (e.g. from eqx.filter_eval_shape),
    None for the rest. Scalars and small leaves are replicated."""
    fsdp_size = mesh.shape["fsdp"]

    def leaf(x):
        return NamedSharding(mesh, fsdp_spec(tuple(x.shape), fsdp_size, min_size)) if _is_array_like(x) else None

    return jax.tree.map(leaf, abstract_state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over every device of the mesh, the rest replicated."""
    return NamedSharding(mesh, P(AXES))


def sharding_summary(abstract_state, shardings) -> str:
    """One line: how many array leaves are sharded/replicated and the state's bytes per device."""
    arrays = jax.tree.leaves(eqx.filter(abstract_state, _is_array_like))
    leaves = list(zip(arrays, jax.tree.leaves(shardings), strict=True))
    sharded = sum(1 for _, s in leaves if any(a is not None for a in s.spec))
    total = sum(x.size * np.dtype(x.dtype).itemsize for x, _ in leaves)
    per_device = sum(
        int(np.prod(s.shard_shape(x.shape), dtype=np.int64)) * np.dtype(x.dtype).itemsize for x, s in leaves
    )
    return (
        f"state: {len(leaves)} arrays, {sharded} sharded over fsdp, {len(leaves) - sharded} replicated; "
        f"{total / 2**20:.1f} MiB in all, {per_device / 2**20:.1f} MiB per device"
    )
