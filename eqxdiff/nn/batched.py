"""`Batched`: a model written the Equinox way, for one example, as an eqxdiff model."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray


class Batched(eqx.Module):
    """Wraps an unbatched `module(x[h,w,c], t[], cond, *, key) -> [h,w,c]` with `jax.vmap`, so
    it is called as `model(x[b,h,w,c], t[b], cond, *, key=None)` (`eqxdiff.nn.DiffusionModel`).

    `cond` is vmapped over its leaves' first axis (None stays None); `key`, when given, is split
    into one key per example. If `module` has `null_cond()` (one example's null condition,
    no arguments), `null_cond(b)` stacks it b times; otherwise it is None (unconditional).
    """

    module: Callable

    def __call__(
        self, x: Float[Array, "b h w c"], t: Float[Array, " b"], cond: Any = None, *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "b h w c"]:
        keys = None if key is None else jax.random.split(key, x.shape[0])
        return jax.vmap(lambda x, t, c, k: self.module(x, t, c, key=k))(x, t, cond, keys)

    def null_cond(self, batch_size: int) -> Any:
        one = getattr(self.module, "null_cond", None)
        if one is None:
            return None
        return jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a), (batch_size, *jnp.shape(a))), one())
