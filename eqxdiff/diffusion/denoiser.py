"""A network + schedule + parameterization = the denoiser D(x; σ) that samplers integrate."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .parameterization import Parameterization
from .schedules import Schedule


def per_example(a: Float[Array, " b"], x: Array) -> Array:
    """Reshape a per-example scalar (b,) to broadcast against x (b, ...)."""
    return a.reshape(a.shape + (1,) * (x.ndim - 1))


class Denoiser(eqx.Module):
    """D(x; σ) = c_skip·x + c_out·F(c_in·x, c_noise, cond) (Karras et al. 2022, eq. 7).

    `x` is the unscaled noisy sample x0 + σ·ε, shape (b, ...); `sigma` a scalar or (b,);
    `cond` a condition pytree with batch-first leaves, or None.
    `model(x, t, cond)` is any network with the eqxdiff model signature (`eqxdiff.nn.DiffusionModel`).
    """

    model: Callable
    schedule: Schedule
    parameterization: Parameterization

    def __call__(
        self,
        x: Float[Array, "b *dims"],
        sigma: Float[Array, ""] | Float[Array, " b"],
        cond: Any = None,
    ) -> Float[Array, "b *dims"]:
        sigma = jnp.broadcast_to(sigma, x.shape[:1]).astype(x.dtype)
        c_skip, c_out, c_in = self.parameterization.coefficients(sigma, self.schedule)
        out = self.model(per_example(c_in, x) * x, self.schedule.sigma_to_t(sigma), cond)
        return per_example(c_skip, x) * x + per_example(c_out, x) * out.astype(x.dtype)
