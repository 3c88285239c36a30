"""The training objective: the parameterization's own regression MSE at a random σ."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .denoiser import per_example
from .parameterization import Parameterization
from .schedules import Schedule


def denoising_loss(
    model: Callable,
    schedule: Schedule,
    parameterization: Parameterization,
    x0: Float[Array, "b *dims"],
    key: PRNGKeyArray,
    labels: Int[Array, " b"] | None = None,
) -> Float[Array, ""]:
    """The loss at σ drawn from the schedule and ε ~ N(0, I); see `denoising_loss_at`.
    `key` also drives the model's dropout."""
    key_draw, key_model = jax.random.split(key)
    sigma, noise = draw_sigma_and_noise(schedule, x0, key_draw)
    return denoising_loss_at(model, schedule, parameterization, x0, sigma, noise, labels, key=key_model)


def draw_sigma_and_noise(
    schedule: Schedule, x0: Float[Array, "b *dims"], key: PRNGKeyArray
) -> tuple[Float[Array, " b"], Float[Array, "b *dims"]]:
    """A training draw for a batch: σ per example from the schedule and ε ~ N(0, I), float32.
    Drawn for the whole global batch at once, so micro-batching does not change it."""
    key_sigma, key_noise = jax.random.split(key)
    return schedule.sample_sigma(key_sigma, x0.shape[:1], jnp.float32), jax.random.normal(key_noise, x0.shape, jnp.float32)


def denoising_loss_at(
    model: Callable,
    schedule: Schedule,
    parameterization: Parameterization,
    x0: Float[Array, "b *dims"],
    sigma: Float[Array, " b"],
    noise: Float[Array, "b *dims"],
    labels: Int[Array, " b"] | None = None,
    *,
    key: PRNGKeyArray | None = None,
) -> Float[Array, ""]:
    """mean ‖F(c_in·x, c_noise) - (x0 - c_skip·x)/c_out‖² with x = x0 + σ·ε.

    This is EDM's E λ(σ)‖D(x; σ) - x0‖² with λ = 1/c_out² (Karras et al. 2022, eq. 2, 8),
    written in F-space, where it is numerically stable at small σ. Per parameterization it is
    exactly the textbook objective: ε-MSE (Ho et al. 2020, eq. 14), v-MSE (Salimans & Ho 2022),
    EDM's weighted loss, flow-matching MSE (Lipman et al. 2022, eq. 23). Computed in float32
    whatever the model's dtype.
    """
    x0, sigma, noise = (a.astype(jnp.float32) for a in (x0, sigma, noise))
    c_skip, c_out, c_in = (per_example(c, x0) for c in parameterization.coefficients(sigma, schedule))
    s = per_example(sigma, x0)
    x = x0 + s * noise
    out = model(c_in * x, schedule.sigma_to_t(sigma), labels, key=key)
    # (x0 - c_skip·x)/c_out with x expanded, so no x0 - x0 cancellation at small σ.
    target = ((1 - c_skip) * x0 - c_skip * s * noise) / c_out
    return jnp.mean((out.astype(jnp.float32) - target) ** 2)
