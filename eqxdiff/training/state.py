"""TrainState: everything a training step reads and writes, created directly in its sharded layout."""

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Int, PRNGKeyArray

from eqxdiff.sharding import Rule, state_shardings


class TrainState(eqx.Module):
    """Model, its EMA, the optimizer state, the step count, the current run of bad steps and the
    power-function EMAs of post-hoc EMA (eqxdiff/training/phema.py; () when none are tracked).

    No RNG lives here: a step's randomness is fold_in(key(seed), step), so a restored state
    continues bit-exactly.
    """

    model: eqx.Module
    ema: eqx.Module
    opt_state: optax.OptState
    step: Int[Array, ""]
    bad_steps: Int[Array, ""]  # consecutive non-finite steps; 0 after a good one
    phema: tuple = ()  # one model-shaped EMA per tracked σ_rel (the step knows their γ)


def init_train_state(
    make_model: Callable[[PRNGKeyArray], eqx.Module], optimizer, key: PRNGKeyArray, num_phema: int = 0
) -> TrainState:
    """A fresh state; `make_model(key)` builds the network; `num_phema` power-function EMAs."""
    return state_from_model(make_model(key), optimizer, num_phema)


def state_from_model(model: eqx.Module, optimizer, num_phema: int = 0) -> TrainState:
    """The state around a freshly built `model`: EMA (and each of `num_phema` power-function EMAs) = a
    copy of it, fresh optimizer state."""
    params = eqx.filter(model, eqx.is_inexact_array)

    def copy():  # its own buffers: all are donated
        return eqx.combine(jax.tree.map(lambda p: p if p is None else p + 0, params), model)

    return TrainState(
        model=model,
        ema=copy(),
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        bad_steps=jnp.zeros((), jnp.int32),
        phema=tuple(copy() for _ in range(num_phema)),
    )


def abstract_train_state(
    make_model,
    optimizer,
    mesh: Mesh,
    min_size: int,
    *,
    rules: Sequence[Rule] = (),
    strict: bool = True,
    num_phema: int = 0,
):
    """(abstract state, shardings) without allocating anything: the state's structure as
    ShapeDtypeStructs (eqx.filter_eval_shape) and the NamedSharding of every array leaf (None at
    the non-array leaves): `rules` by parameter name first, then FSDP (`state_shardings`, `strict`
    as there). Restoring a checkpoint needs exactly these two. The power-function EMAs (`num_phema`)
    are laid out like the parameters they copy."""
    abstract = eqx.filter_eval_shape(init_train_state, make_model, optimizer, jax.random.key(0), num_phema)
    return abstract, state_shardings(abstract, mesh, min_size, rules=rules, strict=strict)


def create_train_state(
    make_model,
    optimizer,
    key: PRNGKeyArray,
    mesh: Mesh,
    min_size: int,
    *,
    rules: Sequence[Rule] = (),
    shardings=None,
    num_phema: int = 0,
):
    """A fresh state laid out in its shardings (`rules`, then FSDP: `state_shardings`). Returns
    (state, shardings); shardings has None at the non-array leaves and comes from the abstract
    state (eqx.filter_eval_shape).

    The network is drawn eagerly on this host's CPU backend (its draws share a few small
    compiled programs: eqxdiff.nn.layers), each leaf then goes straight into its shards, and one
    small jit adds the EMA and optimizer state with the state's output shardings. So no
    accelerator ever holds a whole copy, and start-up compiles no per-parameter random draws
    (one jit over the whole init would inline hundreds of them into one slow compile). Pass `shardings` when `abstract_train_state` already gave them
    (then the rules are already in them, and passing `rules` too is an error, and they say how many
    power-function EMAs the state has: `num_phema` is theirs).
    """
    if shardings is None:
        _, shardings = abstract_train_state(make_model, optimizer, mesh, min_size, rules=rules, num_phema=num_phema)
    elif rules:
        raise ValueError("Pass either `rules` or `shardings` (which already carry their rules), not both.")
    host = jax.local_devices(backend="cpu")[0]
    with jax.default_device(host):
        model = make_model(jax.device_put(key, host))
    arrays, static = eqx.partition(model, eqx.is_array)
    model = eqx.combine(jax.tree.map(_into_shards, arrays, shardings.model), static)
    return state_around(model, optimizer, shardings), shardings


def state_around(model: eqx.Module, optimizer, shardings) -> TrainState:
    """The fresh state around `model` (already in `shardings.model`: a pretrained network read straight into
    its shards), its EMA and optimizer state made by one jit in the state's `shardings`; `model` is donated."""

    @eqx.filter_jit(donate="all")
    def finish(model):
        return eqx.filter_shard(state_from_model(model, optimizer, len(shardings.phema)), shardings)

    return finish(model)


def _into_shards(leaf: jax.Array, sharding: NamedSharding) -> jax.Array:
    """A global array in `sharding` built from a host copy of `leaf`: each device receives only
    its shard (make_array_from_callback also covers devices of other processes)."""
    value = np.asarray(leaf)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
