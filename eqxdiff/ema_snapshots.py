"""EMA snapshots: model-shaped EMAs saved by step with what they are, never pruned.

`directory/<step>/` holds three orbax items:
  emas    the array leaves of a tuple of EMA models, each process writing its own shards (as checkpoints);
  meta    JSON: at least `sigma_rels`, one per EMA (a power-function EMA's relative width);
  layout  JSON: each leaf's name, shape and dtype, which a restore's check reads (as checkpoints' layout).
Training writes its power-function EMAs to RUN_DIR/phema (eqxdiff/training/phema.py); train/posthoc_ema.py
reads them and writes each reconstruction the same way, one EMA per folder (RUN_DIR/posthoc_ema/<σ_rel>).
"""

import os

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp

from eqxdiff.checkpoint import ARRAY_HANDLERS, CheckpointError, layout, leaf_table, saved_table, table_differences
from eqxdiff.paths import absolute


class EmaSnapshots:
    """orbax CheckpointManager under `directory` that keeps every step; saves are asynchronous (`wait`)."""

    def __init__(self, directory: str | os.PathLike, *, read_only: bool = False, async_save: bool = True):
        self.directory = absolute(directory)  # a local folder or a bucket's prefix (eqxdiff/paths.py)
        self.read_only = read_only
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, enable_async_checkpointing=async_save, create=not read_only
        )
        handlers = {
            "emas": ocp.PyTreeCheckpointHandler(type_handler_registry=ARRAY_HANDLERS),
            "meta": ocp.JsonCheckpointHandler(),
            "layout": ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    @property
    def steps(self) -> list[int]:
        """Steps with a complete (committed) snapshot, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, emas: tuple, meta: dict) -> str:
        """Start saving `emas` (a tuple of EMA models) as `step` with `meta`. Returns "saved", or "exists":
        a resumed run replays steps its snapshots already hold (bitwise the same), and nothing is rewritten.
        Any step may be added, older ones too (a changed cadence)."""
        if self.read_only:
            raise CheckpointError(f"{self.directory} was opened read-only; step {step} not saved.")
        if step in self._manager.all_steps():
            return "exists"
        arrays = eqx.filter(tuple(emas), eqx.is_array)
        args = ocp.args.Composite(
            emas=ocp.args.PyTreeSave(arrays), meta=ocp.args.JsonSave(meta), layout=ocp.args.JsonSave(layout(arrays))
        )
        self._manager.save(step, args=args, force=True)  # force: orbax's default policy refuses older steps
        return "saved"

    def meta(self, step: int) -> dict:
        self._require(step)
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def restore(self, step: int, abstract_emas: tuple, shardings: tuple | None, *, check: bool = True) -> tuple:
        """The EMAs of `step` laid out by `shardings`, or as host numpy arrays where `shardings` is None (a reader
        that sums them on the host: no device copies to read back); `abstract_emas` (ShapeDtypeStructs, e.g. an
        abstract state's `phema` or `(ema,)`) gives the structure and the static parts. `check=False` skips
        comparing the saved leaves with the target first (the step's layout item; orbax's metadata, a third of a small
        restore's time, for snapshots written before it): for a caller that checked another snapshot of the same run."""
        self._require(step)
        arrays, static = eqx.partition(tuple(abstract_emas), lambda x: isinstance(x, jax.ShapeDtypeStruct))
        if shardings is None:
            target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays)
            restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype), target)
        else:
            target = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), arrays, tuple(shardings)
            )
            restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        mismatch = check and table_differences(
            saved_table(self._manager, self.directory, step, "emas"), leaf_table(target)
        )
        if mismatch:
            raise CheckpointError(
                f"EMA snapshot step {step} in {self.directory} does not fit this run's model: " + "; ".join(mismatch)
            )
        args = ocp.args.Composite(emas=ocp.args.PyTreeRestore(target, restore_args=restore_args))
        return eqx.combine(self._manager.restore(step, args=args).emas, static)

    def _require(self, step: int) -> None:
        if step not in self._manager.all_steps():
            raise CheckpointError(
                f"No EMA snapshot of step {step} in {self.directory}; complete ones: {self.steps or 'none'}."
            )

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "EmaSnapshots":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
