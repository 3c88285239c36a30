"""Sharded, asynchronous checkpoints of a TrainState that restore onto any mesh.

`run_dir/checkpoints/<step>/` holds four orbax items:
  state   the array leaves of the TrainState, each process writing its own shards (no gather);
  data    the data position, JSON (`examples_consumed`, seed, dataset size: see eqxdiff.data);
  config  the run's Config as JSON, so `train/sample.py` can rebuild the model;
  layout  JSON: each state leaf's name, shape and dtype, which a restore checks its target against first
          (one file; orbax's own metadata of the same opens every array: checkpoints without it still read that).

Restore targets come from the *restoring* run's mesh (`state_shardings` of its abstract state),
so a checkpoint written on (data=2, fsdp=4) restores onto (1, 2), one device or two processes.
`restore_part` reads one field of the state alone (a rebuild for sampling: the EMA, not the model or optimizer).
"""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata.array_metadata_store import Store as ArrayMetadataStore

from eqxdiff import xla_cpu
from eqxdiff.paths import absolute
from eqxdiff.training import TrainState

# orbax splits every replicated array into per-replica slices before writing ("replica
# parallel"): thousands of small slice dispatches for a small UNet's state, most of each save's
# blocking time (BENCHMARKS.md). Kept only where the slices are large enough to pay for it
# (`min_slice_bytes_for_replica_parallel` below).
ARRAY_HANDLERS = ocp.type_handlers.create_type_handler_registry(
    (
        jax.Array,
        ocp.type_handlers.ArrayHandler(
            array_metadata_store=ArrayMetadataStore(), min_slice_bytes_for_replica_parallel=2**20
        ),
    ),
    (np.ndarray, ocp.type_handlers.NumpyHandler()),  # a saved jax.Array read onto the host (EmaSnapshots.restore)
)


# The fix a CheckpointError of a restore names: the run, or the step, it was written by.
CHANGED_RUN = (
    "If the model or optimizer flags (or the model's entry in eqxdiff/run/models.py) changed since it was written, "
    "use the original flags or a new --run_dir; another step restores with --resume_step (train/main.py) or --step "
    "(train/sample.py)."
)


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used; the message names the step and the reason."""


def _is_abstract_array(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def leaf_table(tree) -> dict[str, tuple]:
    """'model.blocks.0.weight' -> (shape, dtype) for every leaf; module attributes, dict keys and
    list indices all become plain names, so orbax's saved metadata and a module tree compare."""

    def name(k) -> str:
        return str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {".".join(name(k) for k in path): (tuple(v.shape), str(v.dtype)) for path, v in flat}


def layout(arrays) -> dict[str, list]:
    """A `layout` item: each leaf's name -> [shape, dtype] (`leaf_table` as JSON), saved beside the arrays."""
    return {name: [list(shape), dtype] for name, (shape, dtype) in leaf_table(arrays).items()}


def saved_table(manager: ocp.CheckpointManager, directory, step: int, item: str) -> dict[str, tuple]:
    """The `leaf_table` of `item` as saved at `step`: from the step's layout item, or orbax's metadata of `item`
    where there is none (written before layouts were; that metadata opens every array). Unreadable: a
    CheckpointError naming the step."""
    try:
        if (directory / str(step) / "layout").exists():
            saved = manager.restore(step, args=ocp.args.Composite(layout=ocp.args.JsonRestore())).layout
            return {name: (tuple(shape), dtype) for name, (shape, dtype) in saved.items()}
        return leaf_table(manager.item_metadata(step)[item].tree)
    except Exception as e:
        raise CheckpointError(f"Step {step} in {directory}: cannot read the layout of its {item}: {e}") from e


def table_differences(saved: dict[str, tuple], wanted: dict[str, tuple], limit: int = 5) -> list[str]:
    """Up to `limit` lines naming the leaves where a saved `leaf_table` and a restore target's differ (missing,
    extra, or another shape/dtype); empty when the target fits."""
    out = [f"{k}: not in the checkpoint" for k in wanted.keys() - saved.keys()]
    out += [f"{k}: in the checkpoint only" for k in saved.keys() - wanted.keys()]
    both = wanted.keys() & saved.keys()
    out += [f"{k}: saved {saved[k]}, this run has {wanted[k]}" for k in both if saved[k] != wanted[k]]
    return sorted(out)[:limit]


def _as_saved(arrays):
    """A TrainState's array half as checkpoints hold it: its fields by name, without `phema` when it tracks
    none, so a run without post-hoc EMA writes and reads what checkpoints before that field held."""
    if not isinstance(arrays, TrainState):
        return arrays
    fields = {name: getattr(arrays, name) for name in ("model", "ema", "opt_state", "step", "bad_steps", "phema")}
    return fields if fields["phema"] else {k: v for k, v in fields.items() if k != "phema"}


def _laid_out(arrays, shardings):
    """Restore targets: the ShapeDtypeStructs `arrays` with the `shardings` to read them into."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), arrays, shardings)


def _from_saved(restored, like):
    """`_as_saved`'s inverse: the TrainState `like` (the restore target) with the restored arrays."""
    if not isinstance(like, TrainState):
        return restored
    return TrainState(**{"phema": (), **restored})


def _without_traceback(error: Exception) -> str:
    """`error`'s message up to any traceback text inside it: an error from orbax's async reads can carry the
    formatted traceback of the read that failed first, which the user's one-line error should not print."""
    return str(error).split("Traceback")[0].rstrip() or type(error).__name__


def all_finite(tree) -> bool:
    """Whether every inexact array of `tree` is finite: one host read of a jitted reduction, or
    numpy on the host on a single-process CPU run with `eqxdiff.xla_cpu` on (xla_cpu.py, 6)."""
    on_host = xla_cpu.host_all_finite(jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array)))
    return bool(_all_finite(tree)) if on_host is None else on_host


@eqx.filter_jit
def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))]
    return jnp.all(jnp.stack(leaves))


class Checkpoints:
    """orbax CheckpointManager under `directory`, keeping the newest `keep` steps.

    Saves are asynchronous: `save` returns once the state is copied off the devices; the files
    are written in the background. `wait()` (also called by `close()`) blocks until they are.
    """

    def __init__(
        self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True, read_only: bool = False
    ):
        """`read_only`: for readers (train/sample.py): nothing is created, saved or deleted (orbax's own
        read_only mode logs warnings at every open; without `create` and saves it writes nothing)."""
        if keep < 1:
            raise ValueError(f"--keep_checkpoints must be >= 1, got {keep}.")
        self.directory = absolute(directory)  # a local folder or a bucket's prefix (eqxdiff/paths.py)
        self.read_only = read_only
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=not read_only
        )
        handlers = {
            "state": ocp.PyTreeCheckpointHandler(type_handler_registry=ARRAY_HANDLERS),
            "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(),
            "layout": ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    @property
    def steps(self) -> list[int]:
        """Steps with a complete (committed) checkpoint, oldest first."""
        return sorted(self._manager.all_steps())

    def latest(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state, data: dict, config: dict) -> str:
        """Start saving `state` (a TrainState) with the data position and config. Returns
        "saved", or why nothing was written: "exists" (the step is already saved), "not_newest"
        (a newer step is saved: e.g. a run resumed with an older --resume_step; orbax keeps
        steps in order) or "non_finite" (the state holds a NaN or inf: a bad state never
        replaces a good checkpoint)."""
        if self.read_only:
            raise CheckpointError(f"{self.directory} was opened read-only; step {step} not saved.")
        if step in self._manager.all_steps():
            return "exists"
        if self.steps and step < self.steps[-1]:
            return "not_newest"
        if not all_finite(state):  # at the checkpoint cadence only
            return "non_finite"
        arrays = _as_saved(eqx.filter(state, eqx.is_array))
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(arrays),
            data=ocp.args.JsonSave(data),
            config=ocp.args.JsonSave(config),
            layout=ocp.args.JsonSave(layout(arrays)),
        )
        if not self._manager.save(step, args=args):
            raise CheckpointError(f"orbax declined to save step {step} in {self.directory} (its save policy).")
        return "saved"

    def restore(self, step: int, abstract_state, shardings) -> tuple:
        """(state, data, config) of `step`, the state laid out by `shardings` (the restoring
        run's `state_shardings(abstract_state, mesh, ...)`). `abstract_state` is the
        eqx.filter_eval_shape of the state's init: it supplies the structure and the static parts.
        """
        self._require(step)
        arrays, static = eqx.partition(abstract_state, _is_abstract_array)
        target = _as_saved(_laid_out(arrays, shardings))
        self._check_fits(step, saved_table(self._manager, self.directory, step, "state"), target, "state")
        state = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
        restored = self._read(step, "state", state=state, data=ocp.args.JsonRestore(), config=ocp.args.JsonRestore())
        return eqx.combine(_from_saved(restored.state, arrays), static), restored.data, restored.config

    def restore_part(self, step: int, part: str, abstract, sharding):
        """The state's field `part` ("ema", "model", ...) of `step` alone, laid out by `sharding`, the other fields
        left unread (orbax's partial restore): a rebuild for sampling keeps the EMA, a quarter of an Adam run's
        arrays. `abstract`: that field's structure (e.g. the eqx.filter_eval_shape of the network), which supplies
        its static parts; the check before the read compares that field's saved leaves alone."""
        self._require(step)
        arrays, static = eqx.partition(abstract, _is_abstract_array)
        target = {part: _laid_out(arrays, sharding)}
        saved = saved_table(self._manager, self.directory, step, "state")
        in_part = {name: v for name, v in saved.items() if name == part or name.startswith(f"{part}.")}
        self._check_fits(step, in_part, target, part)
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        restored = self._read(
            step, part, state=ocp.args.PyTreeRestore(target, restore_args=restore_args, partial_restore=True)
        )
        return eqx.combine(restored.state[part], static)

    def _check_fits(self, step: int, saved: dict[str, tuple], target, what: str) -> None:
        """A CheckpointError naming the leaves where `saved` (a `leaf_table`) and `target` differ, before orbax reads
        an array: its own mismatch errors arrive from inside its async reads."""
        mismatch = table_differences(saved, leaf_table(target))
        if mismatch:
            raise CheckpointError(
                f"Checkpoint step {step} in {self.directory} cannot be restored into this run's {what}, which differs "
                "in: " + "; ".join(mismatch) + f". {CHANGED_RUN}"
            )

    def _read(self, step: int, what: str, **items):
        """orbax's restore of `items` (name -> restore args) of `step`; a failure one CheckpointError naming it."""
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # orbax/tensorstore raise many kinds; the user needs the step and why
            raise CheckpointError(
                f"Checkpoint step {step} in {self.directory} cannot be restored into this run's {what}: "
                f"{type(e).__name__}: {_without_traceback(e)}. {CHANGED_RUN}"
            ) from e

    def restore_config(self, step: int) -> dict:
        """Only the config item of `step` (e.g. to rebuild the model before restoring it)."""
        self._require(step)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
        except Exception as e:
            raise CheckpointError(f"Checkpoint step {step} in {self.directory}: cannot read its config: {e}") from e

    def _require(self, step: int) -> None:
        if step not in self._manager.all_steps():
            raise CheckpointError(
                f"No checkpoint for step {step} in {self.directory}; complete ones: {self.steps or 'none'}."
            )

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
