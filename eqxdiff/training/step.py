"""The training step: (state, batch) -> (state, metrics), pure, sharded, donated, NaN-guarded.

GSPMD derives every collective from the pinned shardings (no shard_map, no pmean): the batch
is split over ('data', 'fsdp'), the state laid out by `eqxdiff.sharding.fsdp_spec`.
"""

import threading
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from eqxdiff import xla_cpu
from eqxdiff.sharding import is_array_like

from .phema import update_power_emas
from .precision import cast_for_compute
from .state import TrainState

# prepare(batch, key[, frozen]) -> batch: draws the per-example randomness (σ, noise, condition
# dropout) for the whole global batch, so splitting it into micro-batches does not change what is
# drawn; `frozen`, the step's frozen modules (a text tower, ...), is passed when the step has them.
PrepareFn = Callable[..., dict]
# loss_fn(model, micro_batch, key) -> scalar mean loss over the micro-batch.
LossFn = Callable[[eqx.Module, dict, jax.Array], jax.Array]


# How a non-finite step keeps the old state: "cond", one lax.cond over the whole state (one conditional to
# compile instead of a select per leaf: XLA:CPU's compile time, BENCHMARKS.md), or "where", a select per leaf,
# which XLA fuses into the optimizer's and the EMA's elementwise update (on a TPU a conditional over the
# state copies every leaf into its result: BENCHMARKS.md "On a TPU v5e"). None: "cond" on a CPU mesh, else
# "where"; read when a step is built.
GUARD_FORM: str | None = None


def _select(pred, new, old, form: str):
    """`new` if pred else `old` (arrays only; the static parts are shared), as `form` (GUARD_FORM) says."""
    new_arrays, static = eqx.partition(new, eqx.is_array)
    old_arrays = eqx.filter(old, eqx.is_array)
    if form == "where":
        return eqx.combine(jax.tree.map(lambda a, b: jnp.where(pred, a, b), new_arrays, old_arrays), static)
    return eqx.combine(jax.lax.cond(pred, lambda: new_arrays, lambda: old_arrays), static)


def _micro_batches(batch: dict, k: int) -> dict:
    """(B, ...) -> (k, B/k, ...), micro-batch i = examples i, i+k, ...: each one still spans
    every device of the batch sharding, so all devices work on every micro-step."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), batch)


def make_train_step(
    *,
    prepare: PrepareFn,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
    ema_decay: float | optax.Schedule,
    state_shardings,
    batch_sharding,
    seed: int,
    grad_accum_steps: int = 1,
    precision: str = "fp32",
    frozen_shardings=None,
    phema_gammas: tuple[float, ...] = (),
    after_update: Callable | None = None,
    model_of: Callable[[eqx.Module, object], eqx.Module] | None = None,
) -> "TrainStep":
    """Build `train_step(state, batch, frozen=None) -> (state, metrics)`; `state` is donated.

    `ema_decay`: a float, or a schedule of the step count (`ema_warmup(d)`).

    `phema_gammas`: the exponents γ of the state's power-function EMAs (`state.phema`, in order;
    eqxdiff/training/phema.py): step t = state.step + 1 moves each by 1 - β_t = 1 - (1 - 1/t)^(γ+1)
    towards the model after the step, also after a skipped one (then the model kept), so that each
    stays the power-function average of the weights of steps 1..t.

    `after_update(model) -> model` runs on the model after each optimizer update, before the EMAs read it: a
    constraint on the parameters, e.g. EDM2's forced weight normalisation (`eqxdiff.nn.force_weight_normalization`).

    `frozen` is a pytree of modules the step reads but never trains (a pretrained text tower that
    encodes captions in `prepare`): an ARGUMENT of the jitted step, so its weights are neither
    compiled in as constants nor part of the gradient, the optimizer or the EMA;
    `frozen_shardings` (e.g. `eqxdiff.sharding.state_shardings` of it) lays it out.

    `model_of(trained, frozen) -> model`: the network `loss_fn` sees, from the trained part (`state.model`)
    and the frozen argument; default the trained part itself. LoRA fine-tuning trains adapters only
    (`eqxdiff.nn.lora.partition_lora`) and passes the base in `frozen`: `eqx.combine(adapters, frozen[...])`,
    so the gradient, the optimizer and the EMA hold the adapters alone.

    metrics (device scalars, read by the host only at the logging cadence): loss, grad_norm,
    lr (the learning rate of this step's update), finite (this step's loss and gradients),
    bad_steps (consecutive non-finite steps).
    A non-finite step leaves model, EMA and optimizer state bitwise unchanged.
    """
    k = grad_accum_steps
    on_cpu = batch_sharding.mesh.devices.flat[0].platform == "cpu"
    guard = GUARD_FORM or ("cond" if on_cpu else "where")
    if guard not in ("cond", "where"):
        raise ValueError(f"GUARD_FORM {guard!r}: 'cond' or 'where'")

    def loss_of(trained, micro_batch, key, frozen):
        model = trained if model_of is None else model_of(trained, frozen)
        return loss_fn(cast_for_compute(model, precision), micro_batch, key)

    grad_fn = eqx.filter_value_and_grad(loss_of)  # with respect to the trained part only

    def micro_gradients(model, batch, key, frozen):
        """(loss, gradients), the gradients in the compute dtype: without `model_of` they are taken at the cast
        model. The float32 master's gradient is that one converted (the cast's transpose), so the values are the
        same, and a micro-batch's gradients take half the memory until they are summed in float32."""
        at = cast_for_compute(model, precision) if model_of is None else model
        return grad_fn(at, batch, key, frozen)

    def gradients(model, batch, key, frozen):
        params = eqx.filter(model, eqx.is_inexact_array)
        if k == 1:
            loss, grads = micro_gradients(model, batch, key, frozen)
            return loss, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        # One optimizer update per call, k sequential micro-batches (activation memory ≈ 1/k).
        # A scan keeps them sequential; with the XLA:CPU workarounds on it is unrolled
        # (eqxdiff/xla_cpu.py: XLA:CPU runs a conv backward inside a rolled loop far slower).

        def micro(carry, xs):
            loss_sum, grad_sum = carry
            i, mb = xs
            loss, grads = micro_gradients(model, mb, jax.random.fold_in(key, i), frozen)
            return (loss_sum + loss, jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads)), None

        init = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        unroll = xla_cpu.on_cpu("unrolled_accumulation")
        (loss_sum, grad_sum), _ = jax.lax.scan(micro, init, (jnp.arange(k), _micro_batches(batch, k)), unroll=unroll)
        return loss_sum / k, jax.tree.map(lambda g: g / k, grad_sum)

    def step(state_arrays, static, batch: dict, frozen) -> tuple[TrainState, dict]:
        state = eqx.combine(state_arrays, static)
        key = jax.random.fold_in(jax.random.key(seed), state.step)
        key_prepare, key_loss = jax.random.split(key)
        prepared = prepare(batch, key_prepare) if frozen is None else prepare(batch, key_prepare, frozen)
        batch = eqx.filter_shard(prepared, batch_sharding)

        loss, grads = gradients(state.model, batch, key_loss, frozen)
        grad_norm = optax.tree.norm(grads)
        # One reduction instead of one per leaf: a NaN or inf anywhere makes the norm non-finite.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        params = eqx.filter(state.model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        model = eqx.apply_updates(state.model, updates)
        model = model if after_update is None else after_update(model)
        decay = ema_decay(state.step) if callable(ema_decay) else ema_decay  # a schedule: e.g. ema_warmup
        ema_params = jax.tree.map(
            lambda e, p: e + (1 - decay) * (p - e),
            eqx.filter(state.ema, eqx.is_inexact_array),
            eqx.filter(model, eqx.is_inexact_array),
        )
        updated = TrainState(model, eqx.combine(ema_params, state.ema), opt_state, state.step, state.bad_steps)
        kept = TrainState(state.model, state.ema, state.opt_state, state.step, state.bad_steps)  # phema: below
        new_state = _select(finite, updated, kept, guard)
        new_state = TrainState(
            new_state.model,
            new_state.ema,
            new_state.opt_state,
            state.step + 1,
            jnp.where(finite, 0, state.bad_steps + 1).astype(state.bad_steps.dtype),
            update_power_emas(state.phema, new_state.model, phema_gammas, state.step + 1),
        )
        metrics = dict(
            loss=loss,
            grad_norm=grad_norm,
            lr=jnp.asarray(lr_schedule(_updates_applied(state.opt_state, state.step)), jnp.float32),
            finite=finite,
            bad_steps=new_state.bad_steps,
        )
        return eqx.filter(new_state, eqx.is_array), metrics

    # jax.jit on the array half of the state, not eqx.filter_jit: equinox 0.13.8's filter_jit
    # blocks on a marker after every call, which would sync the host on every step.
    replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
    return TrainStep(step, state_shardings, batch_sharding, replicated, frozen_shardings)


class TrainStep:
    """`train_step(state, batch, frozen=None) -> (state, metrics)`; the state's arrays are donated.

    The non-array halves of the state and of `frozen` (module structure, static config) are fixed
    by the first call and closed over, so the jitted function sees only arrays (the static half holds lists,
    which jit's static arguments cannot hash). Each batch signature is lowered once and compiled
    ahead of time: `lower` (for XLA's cost analysis) and the calls share that one lowering —
    jit's own call path would lower the step a second time, adding to start-up.

    The compiled step takes and returns the state's arrays as one flat list: a call flattens the state once
    and unflattens it once (an Equinox module's flatten and unflatten run in Python, and the pytree-shaped
    call flattened and rebuilt it four times: on a 2-core box that host work competes with the step itself).

    `compile(abstract_state, batch_spec)` takes ShapeDtypeStructs, so the step can compile in a
    thread while the state is built or restored (XLA's compiler releases the GIL); a call that
    arrives meanwhile waits for that compile instead of starting its own.
    """

    def __init__(self, step, state_shardings, batch_sharding, metrics_sharding, frozen_shardings=None):
        self._step = step
        self._state_shardings, self._frozen_shardings = state_shardings, frozen_shardings
        self._metrics_sharding = metrics_sharding
        self._state = self._frozen = None  # _Flat of the first call's state and frozen
        self.batch_sharding = batch_sharding
        self.jitted = None
        self._lowered: dict = {}
        self._compiled: dict = {}
        self._lock = threading.RLock()  # one lowering/compile at a time; calls wait for it
        self.traces = 0  # how often jit traced the step: 1 per input shape (tests hold it to that)
        # XLA:CPU's workaround options (eqxdiff.xla_cpu) when it is on and the mesh is on CPU,
        # read when the step is built; else XLA's defaults.
        on_cpu = batch_sharding.mesh.devices.flat[0].platform == "cpu"
        self.compiler_options = xla_cpu.compiler_options() if on_cpu else {}

    def _split(self, state: TrainState, frozen) -> tuple[list, list]:
        """The array leaves of `state` and of `frozen`, in flatten order."""
        state_leaves, state_def = jax.tree.flatten(state)
        frozen_leaves, frozen_def = jax.tree.flatten(frozen)
        if self.jitted is None:
            with self._lock:
                if self.jitted is None:
                    self._state = _Flat(state_leaves, state_def, "state")
                    self._frozen = _Flat(frozen_leaves, frozen_def, "frozen")
                    shardings = self._state.sharding_leaves(self._state_shardings, state)
                    frozen_shardings = self._frozen.sharding_leaves(self._frozen_shardings, frozen)
                    self.jitted = jax.jit(
                        self._traced,
                        donate_argnums=0,
                        in_shardings=(shardings, self.batch_sharding, frozen_shardings),
                        out_shardings=(shardings, self._metrics_sharding),
                    )
        return self._state.arrays(state_leaves, state_def), self._frozen.arrays(frozen_leaves, frozen_def)

    def _traced(self, arrays: list, batch, frozen_arrays: list):
        self.traces += 1  # runs at trace time only
        state_arrays, static = eqx.partition(self._state.rebuild(arrays), is_array_like)
        # The mesh in context lets a Pallas attention run on each device's share of the batch (nn/attention.py).
        with jax.sharding.use_abstract_mesh(self.batch_sharding.mesh.abstract_mesh):
            new_arrays, metrics = self._step(state_arrays, static, batch, self._frozen.rebuild(frozen_arrays))
        new_leaves, new_def = jax.tree.flatten(new_arrays)
        if new_def != jax.tree.structure(state_arrays):
            raise ValueError(
                f"The step returned a state of another structure:\n{new_def}\nnot\n{jax.tree.structure(state_arrays)}"
            )
        return new_leaves, metrics

    def __call__(self, state: TrainState, batch: dict, frozen=None) -> tuple[TrainState, dict]:
        arrays, frozen_arrays = self._split(state, frozen)
        compiled = self._compiled.get(_signature(batch, frozen_arrays)) or self.compile(state, batch, frozen)
        new_arrays, metrics = compiled(arrays, batch, frozen_arrays)
        return self._state.rebuild(new_arrays), metrics

    def compile(self, state: TrainState, batch: dict, frozen=None):
        """The compiled step for this batch signature (compiled once). Arrays or
        ShapeDtypeStructs (e.g. `abstract_train_state`'s) both work, for `frozen` too."""
        _, frozen_arrays = self._split(state, frozen)
        signature = _signature(batch, frozen_arrays)
        with self._lock:
            if signature not in self._compiled:
                self._compiled[signature] = self.lower(state, batch, frozen).compile(self.compiler_options)
            return self._compiled[signature]

    def lower(self, state: TrainState, batch: dict, frozen=None):
        """jax's Lowered for these arguments (cost and memory analysis without running)."""
        arrays, frozen_arrays = self._split(state, frozen)
        signature = _signature(batch, frozen_arrays)
        with self._lock:
            if signature not in self._lowered:
                self._lowered[signature] = self.jitted.lower(arrays, batch, frozen_arrays)
            return self._lowered[signature]


class _Flat:
    """A pytree's structure and non-array leaves, fixed by the first call: `arrays(leaves, treedef)` picks a later
    tree's array leaves (its structure must be the same), `rebuild(arrays)` puts a tree back together."""

    def __init__(self, leaves: list, treedef, what: str):
        self.treedef, self.what = treedef, what
        self.array_at = [i for i, x in enumerate(leaves) if is_array_like(x)]
        self.template = [None if is_array_like(x) else x for x in leaves]

    def arrays(self, leaves: list, treedef) -> list:
        if treedef != self.treedef:
            raise ValueError(
                f"train_step: the {self.what} passed has another structure than at the first call (a changed "
                f"module or static field): build a new step for it (make_train_step).\nnow: {treedef}\n"
                f"first call: {self.treedef}"
            )
        return [leaves[i] for i in self.array_at]

    def rebuild(self, arrays: list):
        leaves = list(self.template)
        for i, x in zip(self.array_at, arrays, strict=True):
            leaves[i] = x
        return jax.tree.unflatten(self.treedef, leaves)

    def sharding_leaves(self, shardings, tree) -> list | None:
        """`shardings` of `tree` as jit takes them, a prefix of it (a sharding, or None: unspecified, for each
        subtree), as one entry per array leaf; None for None."""
        if shardings is None:
            return None
        flat = []  # filled in flatten order: each prefix leaf's sharding once per array of its subtree
        arrays = lambda subtree: sum(map(is_array_like, jax.tree.leaves(subtree)))  # noqa: E731
        jax.tree.map(lambda s, sub: flat.extend([s] * arrays(sub)), shardings, tree, is_leaf=lambda x: x is None)
        if len(flat) != len(self.array_at):
            raise ValueError(f"train_step: {len(flat)} shardings for the {self.what}'s {len(self.array_at)} arrays")
        return flat


def _updates_applied(opt_state, step: jax.Array) -> jax.Array:
    """The optimizer's own update count (the schedule's, when it keeps one): the step at which it
    reads the learning rate. It lags `step` by the skipped non-finite steps, whose optimizer
    state is kept whole. Without a count in the state, `step`."""
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return counts[-1][1] if counts else step


def _signature(batch: dict, frozen_arrays=None) -> tuple:
    # Canonical dtypes: a spec may say int64 where the device array (x64 off) is int32.
    leaves = jax.tree_util.tree_flatten_with_path((batch, frozen_arrays))[0]
    return tuple((path, x.shape, jax.dtypes.canonicalize_dtype(x.dtype)) for path, x in leaves)
