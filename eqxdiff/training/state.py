"""TrainState: everything a training step reads and writes, created directly in its sharded layout."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Int, PRNGKeyArray

from eqxdiff.sharding import state_shardings


class TrainState(eqx.Module):
    """Model, its EMA, the optimizer state, the step count and the current run of bad steps.

    No RNG lives here: a step's randomness is fold_in(key(seed), step), so a restored state
    continues bit-exactly.
    """

    model: eqx.Module
    ema: eqx.Module
    opt_state: optax.OptState
    step: Int[Array, ""]
    bad_steps: Int[Array, ""]  # consecutive non-finite steps; 0 after a good one


def init_train_state(make_model: Callable[[PRNGKeyArray], eqx.Module], optimizer, key: PRNGKeyArray) -> TrainState:
    """A fresh state; `make_model(key)` builds the network."""
    model = make_model(key)
    params = eqx.filter(model, eqx.is_inexact_array)
    ema = jax.tree.map(lambda p: p if p is None else p + 0, params)  # its own buffers: both are donated
    return TrainState(
        model=model,
        ema=eqx.combine(ema, model),
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        bad_steps=jnp.zeros((), jnp.int32),
    )


def abstract_train_state(make_model, optimizer, mesh: Mesh, min_size: int):
    """(abstract state, shardings) without allocating anything: the state's structure as
    ShapeDtypeStructs (eqx.filter_eval_shape) and the FSDP NamedSharding of every array leaf
    (None at the non-array leaves). Restoring a checkpoint needs exactly these two."""
    abstract = eqx.filter_eval_shape(init_train_state, make_model, optimizer, jax.random.key(0))
    return abstract, state_shardings(abstract, mesh, min_size)


def create_train_state(make_model, optimizer, key: PRNGKeyArray, mesh: Mesh, min_size: int):
    """Build the state inside one jit whose outputs carry the FSDP shardings, so no leaf is ever
    materialised whole on one device. Returns (state, shardings); shardings has None at the
    non-array leaves and comes from the abstract state (eqx.filter_eval_shape), not from data."""
    _, shardings = abstract_train_state(make_model, optimizer, mesh, min_size)

    @eqx.filter_jit
    def init(key):
        return eqx.filter_shard(init_train_state(make_model, optimizer, key), shardings)

    return init(key), shardings
