"""The training objective, in pieces a loss function combines: D(x; σ) and its per-example
squared error. The weight λ(σ) is the caller's one line (`loss_weight` gives the textbook one).

    pred = denoising_prediction(model, schedule, parameterization, x0, sigma, noise, cond)
    loss = jnp.mean(loss_weight(sigma, parameterization, schedule) * pred.mse)

is EDM's E λ(σ)‖D(x; σ) - x0‖² (Karras et al. 2022, eq. 2 and 8), and with λ = 1/c_out² it is
each parameterization's own MSE: ε (Ho et al. 2020, eq. 14), v (Salimans & Ho 2022), EDM's
weighted loss, flow matching (Lipman et al. 2022, eq. 23).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .denoiser import per_example
from .parameterization import Parameterization, loss_weight
from .schedules import Schedule


class DenoisingPrediction(NamedTuple):
    """What the network made of x = x0 + σ·ε: `x0_hat` = D(x; σ) (b, ...) and `mse` (b,), the
    mean over each example's elements of (D - x0)², float32; `tokens`: the network's tokens after the block
    `tokens_after` names (REPA), else None."""

    x0_hat: Float[Array, "b *dims"]
    mse: Float[Array, " b"]
    tokens: Float[Array, "b n d"] | None = None


def draw_sigma_and_noise(
    schedule: Schedule, x0: Float[Array, "b *dims"], key: PRNGKeyArray
) -> tuple[Float[Array, " b"], Float[Array, "b *dims"]]:
    """A training draw for a batch: σ per example from the schedule and ε ~ N(0, I), float32.
    Drawn for the whole global batch at once, so micro-batching does not change it."""
    key_sigma, key_noise = jax.random.split(key)
    return schedule.sample_sigma(key_sigma, x0.shape[:1], jnp.float32), jax.random.normal(
        key_noise, x0.shape, jnp.float32
    )


def denoising_prediction(
    model: Callable,
    schedule: Schedule,
    parameterization: Parameterization,
    x0: Float[Array, "b *dims"],
    sigma: Float[Array, " b"],
    noise: Float[Array, "b *dims"],
    cond: Any = None,
    *,
    key: PRNGKeyArray | None = None,
    tokens_after: int | None = None,
) -> DenoisingPrediction:
    """D(x; σ) = c_skip·x + c_out·F(c_in·x, c_noise, cond) at x = x0 + σ·ε, and its error.

    The error is computed in F-space, c_out²·‖F - (x0 - c_skip·x)/c_out‖², which equals
    ‖D - x0‖² but does not cancel x0 against D at small σ (where D - x0 is tiny). Float32
    whatever the model's dtype. `key` drives the model's dropout. `tokens_after=k`: the network is called with it
    and returns (output, its tokens after block k) (eqxdiff.nn.DiT), and the prediction carries those tokens.
    """
    x0, sigma, noise = (a.astype(jnp.float32) for a in (x0, sigma, noise))
    c_skip, c_out, c_in = (per_example(c, x0) for c in parameterization.coefficients(sigma, schedule))
    scaled_noise = per_example(sigma, x0) * noise
    x = x0 + scaled_noise
    extra = {} if tokens_after is None else {"tokens_after": tokens_after}
    out = model(c_in * x, schedule.sigma_to_t(sigma), cond, key=key, **extra)
    out, tokens = (out, None) if tokens_after is None else out
    out = out.astype(jnp.float32)
    # (x0 - c_skip·x)/c_out with x expanded, so no x0 - x0 cancellation at small σ.
    target = ((1 - c_skip) * x0 - c_skip * scaled_noise) / c_out
    f_mse = jnp.mean((out - target) ** 2, axis=tuple(range(1, x0.ndim)))
    return DenoisingPrediction(c_skip * x + c_out * out, c_out.reshape(-1) ** 2 * f_mse, tokens)


def denoising_loss(
    model: Callable,
    schedule: Schedule,
    parameterization: Parameterization,
    x0: Float[Array, "b *dims"],
    key: PRNGKeyArray,
    cond: Any = None,
) -> Float[Array, ""]:
    """The parameterization's textbook loss, mean λ(σ)·‖D - x0‖² with λ = `loss_weight`, at σ
    drawn from the schedule and ε ~ N(0, I). `key` also drives the model's dropout."""
    key_draw, key_model = jax.random.split(key)
    sigma, noise = draw_sigma_and_noise(schedule, x0, key_draw)
    pred = denoising_prediction(model, schedule, parameterization, x0, sigma, noise, cond, key=key_model)
    return jnp.mean(loss_weight(sigma, parameterization, schedule) * pred.mse)


def uncertainty_weighted(model: Any, t: Float[Array, " b"], loss: Float[Array, " b"]) -> Float[Array, " b"]:
    """EDM2's learned per-σ weighting (Karras et al. 2024, eq. 21; EDM2Loss): loss/exp(u) + u per example, where
    u = `model.logvar(t)` is the network's uncertainty head at its time input t (EDM2UNet's; c_noise = ln(σ)/4
    under EDMSchedule). Minimising over u gives u = ln E[loss | σ], so each σ's loss is normalised to about 1.
    A model without a `logvar` head: `loss` unchanged."""
    logvar = getattr(model, "logvar", None)
    if logvar is None:
        return loss
    u = logvar(t).astype(jnp.float32)
    return loss / jnp.exp(u) + u
