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


def preconditioned_output(denoiser, x: Array, sigma: Array, cond: Any, sigma_end: Array | None = None) -> tuple:
    """(c_skip, c_out) shaped to broadcast against x, and the raw network output F(c_in·x, c_noise, cond) in x's
    dtype: what `Denoiser` and `LearnedVarianceDenoiser` combine (Karras et al. 2022, eq. 7). With `sigma_end`, a
    network of two times also gets `interval`, the difference of the two σ's times (MeanFlow's t − r)."""
    sigma = jnp.broadcast_to(sigma, x.shape[:1]).astype(x.dtype)
    c_skip, c_out, c_in = denoiser.parameterization.coefficients(sigma, denoiser.schedule)
    t = denoiser.schedule.sigma_to_t(sigma)
    two_times = {}
    if sigma_end is not None:
        sigma_end = jnp.broadcast_to(sigma_end, x.shape[:1]).astype(x.dtype)
        two_times = {"interval": t - denoiser.schedule.sigma_to_t(sigma_end)}
    out = denoiser.model(per_example(c_in, x) * x, t, cond, **two_times)
    return per_example(c_skip, x), per_example(c_out, x), out.astype(x.dtype)


class Denoiser(eqx.Module):
    """D(x; σ) = c_skip·x + c_out·F(c_in·x, c_noise, cond) (Karras et al. 2022, eq. 7).

    `x` is the unscaled noisy sample x0 + σ·ε, shape (b, ...); `sigma` a scalar or (b,);
    `cond` a condition pytree with batch-first leaves, or None.
    `model(x, t, cond)` is any network with the eqxdiff model signature (`eqxdiff.nn.DiffusionModel`).

    `sigma_end` (a network of two times, MeanFlow's): the network's average velocity from σ down to `sigma_end`
    instead of its instantaneous one, `model(..., interval=t(σ) - t(σ_end))`. Under the flow parameterization
    D = z_t - t·u, and the Euler step σ -> σ_end with this D is MeanFlow's z_r = z_t - (t - r)·u (samplers.py's
    `meanflow`).
    """

    model: Callable
    schedule: Schedule
    parameterization: Parameterization

    def __call__(
        self,
        x: Float[Array, "b *dims"],
        sigma: Float[Array, ""] | Float[Array, " b"],
        cond: Any = None,
        *,
        sigma_end: Float[Array, ""] | Float[Array, " b"] | None = None,
    ) -> Float[Array, "b *dims"]:
        c_skip, c_out, out = preconditioned_output(self, x, sigma, cond, sigma_end)
        return c_skip * x + c_out * out


class LearnedVarianceDenoiser(eqx.Module):
    """A discrete-time VP network with iDDPM's learned-range variance (Nichol & Dhariwal 2021, §3.1; ADM, DiT's
    learn_sigma): its output has 2c channels, F in [..., :c] and the variance interpolation v in [..., c:].

    Returns [b, ..., 2c]: D(x; σ) = c_skip·x + c_out·F (as `Denoiser`), then v unchanged — what
    `ddpm_learned_variance` takes. The network's time is the schedule's `sigma_to_t`: on the schedule's own
    σ's (any respaced grid) the integer t it was trained on, as iDDPM's `_WrappedModel` feeds it.
    """

    model: Callable
    schedule: Schedule
    parameterization: Parameterization

    def __call__(
        self,
        x: Float[Array, "b *spatial c"],
        sigma: Float[Array, ""] | Float[Array, " b"],
        cond: Any = None,
    ) -> Float[Array, "b *spatial c2"]:
        c_skip, c_out, out = preconditioned_output(self, x, sigma, cond)
        c = x.shape[-1]
        if out.shape[-1] != 2 * c:
            raise ValueError(
                f"LearnedVarianceDenoiser: the network gives {out.shape[-1]} channels for {c}; a learned variance "
                f"takes 2c = {2 * c} (DiT(learn_sigma=True)); without one use Denoiser."
            )
        denoised = c_skip * x + c_out * out[..., :c]
        return jnp.concatenate([denoised, out[..., c:]], axis=-1)


class WithoutVariance(eqx.Module):
    """D(x; σ) alone, the first c channels of a learned-variance denoiser's 2c (guided or not), for the
    samplers that take no variance (ddim, euler, heun, ...)."""

    denoise: Callable

    def __call__(self, x: Float[Array, "b *spatial c"], sigma: Float[Array, ""]) -> Float[Array, "b *spatial c"]:
        return self.denoise(x, sigma)[..., : x.shape[-1]]
