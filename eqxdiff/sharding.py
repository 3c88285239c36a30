"""FSDP by leaf: a ('data', 'fsdp') mesh, and named rules over one size-threshold default.

Every array leaf of the state gets a PartitionSpec from an ordered list of rules
`(regex on the leaf's parameter path, PartitionSpec or spec function)`, big_vision's
`sharding_strategy`: the first rule whose regex matches wins, and a leaf no rule matches gets
`fsdp_spec`. An EMA copy or optimizer moment is matched by the path of the parameter it copies,
so it is sharded exactly like its parameter; GSPMD inserts the all-gathers and reduce-scatters.
The batch is split over both axes. `fsdp=1` is plain data parallelism. Frozen modules (a text
tower, a VAE) are laid out by the same function and rules, their leaves named by their paths in the
tree they are placed as (`{"text_encoder": tower}`: `text_encoder.encoder.layers.0.mlp.fc1.weight`).
"""

import difflib
import re
from collections.abc import Callable, Sequence
from typing import Any

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


def output_axis_spec(shape: tuple[int, ...], fsdp_size: int, min_size: int) -> P:
    """Shard a leaf over 'fsdp' along its last (output) axis when that divides and it has `min_size` elements;
    else replicate."""
    if fsdp_size == 1 or int(np.prod(shape, dtype=np.int64)) < min_size or shape[-1] % fsdp_size:
        return P()
    return P(*([None] * (len(shape) - 1)), "fsdp")


# Stable Diffusion UNets' attention output projections (`to_out.0`, `[heads · head_dim, out]`): fsdp_spec's tie on
# the square weight picks its input axis, and GSPMD carries that split back into the attention's heads (SDXL: 20
# heads over 8 devices -> 4 × 2, which it can only reach by replicating: "involuntary full rematerialization" in the
# backward pass). Their output axis instead; a LoRA's A [rank, heads · head_dim] there is replicated (small).
HEAD_LAYOUT_RULES = [(r"(^|\.)to_out\.0\.(base_layer\.)?weight$", output_axis_spec), (r"(^|\.)to_out\.0\.lora_A$", P())]


def is_array_like(x) -> bool:
    """A jax array or its abstract stand-in (ShapeDtypeStruct): the leaves a state's layout,
    compile and restore are computed for."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


class RuleError(ValueError):
    """A sharding rule that cannot be applied: its regex is invalid or matches no leaf, or its spec does not
    fit the leaf it names."""


SpecFn = Callable[[tuple[int, ...], int, int], P]  # (shape, fsdp_size, min_size) -> spec, like fsdp_spec
Rule = tuple[str, P | SpecFn]


def leaf_names(tree):
    """The name every rule is matched against, at each leaf of `tree` (a TrainState or a model).

    A path is its keys joined by '.': `down_blocks.0.0.conv1.weight`. The parameters are the
    leaves of `tree.model` (of `tree` itself when it has no `model`); a leaf whose path ends in a
    parameter's path and has that parameter's shape is a copy of it (the EMA, an Adam moment
    nested in optax's tuples) and takes the parameter's path, the longest such suffix winning.
    Other leaves (step, bad_steps, optax's count) keep their full path: `opt_state.1.0.count`.
    """
    return jax.tree_util.tree_map_with_path(_namer(tree), tree)


def _namer(tree) -> Callable:
    """`(key path, leaf) -> name or None` for the leaves of `tree` (see `leaf_names`)."""
    model = getattr(tree, "model", tree)
    params = {_path(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(model) if is_array_like(x)}

    def name(path, x):
        if not is_array_like(x):
            return None
        keys = _path(path)
        for start in range(len(keys)):  # longest suffix first
            if params.get(keys[start:]) == tuple(x.shape):
                return ".".join(keys[start:])
        return ".".join(keys)

    return name


def placement(
    mesh: Mesh, min_size: int = 2**12, *, rules: Sequence[Rule] = (), name: str | None = None
) -> Callable[[Any], Any]:
    """`place` for the weight loaders (`eqxdiff.nn.torch_weights.load_safetensors`, `from_diffusers`,
    `from_transformers`): an abstract module -> its `state_shardings` on `mesh`, so each weight is read
    straight into the layout the training state's leaves of its size get. `name`: the module is one of
    several one rule list lays out (a frozen text tower, a VAE), its leaves named `name.<path>` (its path
    in the tree the rules see it in: `text_encoder` in the step's frozen argument), and a rule that
    matches none of them is no error here (it may be another module's: `check_rules_match`)."""
    if name is None:
        return lambda abstract: state_shardings(abstract, mesh, min_size, rules=rules)
    return lambda abstract: state_shardings({name: abstract}, mesh, min_size, rules=rules, strict=False)[name]


def state_shardings(abstract_state, mesh: Mesh, min_size: int, *, rules: Sequence[Rule] = (), strict: bool = True):
    """NamedSharding for every array leaf of `abstract_state` (e.g. from eqx.filter_eval_shape),
    None for the rest.

    `rules` is an ordered list of `(regex, spec)`. The regex is looked for anywhere in the leaf's
    name (`re.search`; anchor it with ^ and $ to match a whole name), the name being the
    parameter's path for a parameter and for its EMA and optimizer-moment copies (`leaf_names`),
    so one rule moves all of them together. The first rule that matches wins; `spec` is a
    PartitionSpec used as it is, or a function `(shape, fsdp_size, min_size) -> PartitionSpec`
    like `fsdp_spec`. A leaf no rule matches gets `fsdp_spec`: with no rules, scalars and small
    leaves are replicated and the rest sharded over 'fsdp'. Replicating one leaf is the rule
    `("conv_out", PartitionSpec())`. A regex that matches no leaf, or a spec that names an axis
    not in the mesh or does not divide its leaf's shape, is an error naming it. `strict=False`:
    a rule that matches no leaf of this tree is no error (one rule list laying out several trees,
    a model and frozen towers: `check_rules_match` checks it against all of them together).
    """
    fsdp_size = mesh.shape["fsdp"]
    compiled = [(_compile(regex), spec) for regex, spec in rules]
    if strict:
        check_rules_match(rules, [abstract_state])
    namer = _namer(abstract_state)

    def leaf(path, x):
        name = namer(path, x)
        if name is None:
            return None
        shape = tuple(x.shape)
        rule = next((spec for pattern, spec in compiled if pattern.search(name)), fsdp_spec)
        spec = rule if isinstance(rule, P) else rule(shape, fsdp_size, min_size)
        _check_spec(name, shape, spec, mesh)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(leaf, abstract_state)


def check_rules_match(rules: Sequence[Rule], trees: Sequence) -> None:
    """Raises RuleError (a ValueError) naming the first rule of `rules` whose regex matches no leaf name (`leaf_names`)
    of any of `trees` (None among them: no leaves), with the closest names there are: a typo."""
    names = sorted({name for tree in trees for name in jax.tree.leaves(leaf_names(tree)) if name is not None})
    for regex, _ in rules:
        if not any(_compile(regex).search(name) for name in names):
            close = difflib.get_close_matches(regex, names, n=5, cutoff=0.3) or names[:5]
            raise RuleError(
                f"Sharding rule {regex!r} matches no leaf (re.search on names such as {close}); "
                f"fix the regex or remove the rule."
            )


def _path(path) -> tuple[str, ...]:
    """A key path as strings: attribute names, sequence indices, dict keys."""
    return tuple(str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in path)


def _compile(regex: str) -> re.Pattern:
    try:
        return re.compile(regex)
    except re.error as e:
        raise RuleError(f"Sharding rule {regex!r} is not a valid regex: {e}") from e


def _check_spec(name: str, shape: tuple[int, ...], spec, mesh: Mesh) -> None:
    """Raise, naming the leaf, unless `spec` is a PartitionSpec that splits `shape` evenly on `mesh`."""
    where = f"leaf {name} of shape {shape}: spec {spec} on mesh {dict(mesh.shape)}"
    if not isinstance(spec, P):
        raise RuleError(f"{where} is not a PartitionSpec")
    if len(spec) > len(shape):
        raise RuleError(f"{where} names {len(spec)} dimensions, the leaf has {len(shape)}")
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        axes = (axes,) if isinstance(axes, str) else axes if isinstance(axes, tuple) else ()  # None: not split
        unknown = [a for a in axes if a not in mesh.shape]
        if unknown:
            raise RuleError(f"{where} uses axes {unknown} the mesh does not have")
        parts = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
        if size % parts:
            raise RuleError(
                f"{where} splits dimension {dim} (size {size}) into {parts} parts, which does not divide it; PartitionSpec() replicates it"
            )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over every device of the mesh, the rest replicated."""
    return NamedSharding(mesh, P(AXES))


def sharding_summary(abstract_state, shardings) -> str:
    """One line: how many array leaves are sharded/replicated and the state's bytes per device."""
    arrays = jax.tree.leaves(eqx.filter(abstract_state, is_array_like))
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
