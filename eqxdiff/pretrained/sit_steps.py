"""SiT's samplers (willisma/SiT `transport/`, Linear path, velocity prediction) as step functions on a σ grid.

SiT's interpolant is x_τ = τ·x1 + (1-τ)·ε with τ in [0, 1] running from noise to data, and the network
predicts the velocity v = x1 - ε. That is eqxdiff's rectified flow (`FlowSchedule`) run the other way:
eqxdiff's t = 1-τ is the noise fraction, σ = (1-τ)/τ, s(σ) = τ, and x_τ = s·(x0 + σ·ε) = τ·x̃. A SiT time
grid τ_0 < ... < τ_n is the decreasing σ grid σ_i = (1-τ_i)/τ_i (τ = 0 is σ = ∞), so these steps run
through `eqxdiff.diffusion.sample` as one `lax.scan`, each moving x from `step.sigma` to `step.sigma_next`.

Two things keep them in SiT's coordinates instead of σ-space's denoiser form `D(x̃; σ)`: SiT starts at
τ = 0, σ = ∞, where the unscaled x̃ = x_τ/τ does not exist; and SiT's Heun averages velocities in τ,
which is not EDM's Heun in σ (that averages ε̂) — only Euler is the same step in both (it is DDIM). So
the carried x is SiT's x_τ, the first argument is the velocity `v(x_τ, τ)` with τ = 1/(1+σ) a scalar,
and these are not entries of `eqxdiff.diffusion.SAMPLERS` (whose methods take a denoiser).

The SDE is SiT's dx = [v + w(τ)·score]dτ + sqrt(2·w(τ))·dW with the Linear path's score
(τ·v - x)/(1-τ) and diffusion coefficient w(τ) (`diffusion_form` × `diffusion_norm`); a grid whose last
interval ends at τ = 1 (σ = 0) takes SiT's last step there instead of an SDE step.
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from eqxdiff.diffusion.samplers import Step

Velocity = Callable[[Array, Array], Array]  # v(x_τ [rows, h, w, c], τ scalar) -> [rows, h, w, c]

# w(τ) of SiT's ICPlan.compute_diffusion that run on the Linear path from τ = 0: its "constant" returns a
# float that integrators.py's th.sqrt refuses, "SBDM" is infinite at τ = 0, "increasing-decreasing" is
# spelled "inccreasing-decreasing" in its table (so the official code raises on the documented name).
DIFFUSION_FORMS = {
    "sigma": lambda tau, norm: norm * (1 - tau),
    "linear": lambda tau, norm: norm * (1 - tau),
    "decreasing": lambda tau, norm: 0.25 * (norm * jnp.cos(math.pi * tau) + 1) ** 2,
}
LAST_STEPS = ("Mean", "Tweedie", "Euler", None)


def sit_time(sigma: Float[Array, ""]) -> Float[Array, ""]:
    """SiT's τ of a σ: 1/(1+σ) (σ = ∞ is τ = 0, σ = 0 is τ = 1)."""
    return 1 / (1 + sigma)


def _interval(step: Step) -> tuple[Array, Array]:
    tau = sit_time(step.sigma)
    return tau, sit_time(step.sigma_next) - tau


def score(v: Array, x: Array, tau: Array) -> Array:
    """∇log p_τ(x) from the velocity on the Linear path (ICPlan.get_score_from_velocity): (τ·v - x)/var
    with var = σ_τ² - (α_τ/α'_τ)·σ'_τ·σ_τ = (1-τ)² + τ·(1-τ)."""
    return (tau * v - x) / ((1 - tau) ** 2 + tau * (1 - tau))


def ode_euler(velocity: Velocity, x: Array, step: Step) -> tuple[Array, Array]:
    """torchdiffeq's "euler" on SiT's grid: x + dτ·v(x, τ)."""
    tau, dt = _interval(step)
    v = velocity(x, tau)
    return x + dt * v, v


def ode_heun(velocity: Velocity, x: Array, step: Step) -> tuple[Array, Array]:
    """torchdiffeq's "heun2" on SiT's grid: k1 = v(x, τ), k2 = v(x + dτ·k1, τ + dτ), x + dτ·(k1/2 + k2/2)."""
    tau, dt = _interval(step)
    k1 = velocity(x, tau)
    k2 = velocity(x + dt * k1, tau + dt)
    return x + dt * (k1 * 0.5 + k2 * 0.5), k1


def _sde_drift(velocity: Velocity, x: Array, tau: Array, w: Array) -> tuple[Array, Array]:
    """SiT's SDE drift v + w(τ)·score, and v."""
    v = velocity(x, tau)
    return v + w * score(v, x, tau), v


def _last_step(velocity: Velocity, x: Array, tau: Array, size: Array, w: Array, last_step: str) -> tuple[Array, Array]:
    """SiT's last step from τ to 1 (Sampler.__get_last_step): "Mean" the drift without noise, "Euler" the
    velocity, "Tweedie" E[x1 | x_τ] = x/τ + (1-τ)²/τ·score."""
    drift, v = _sde_drift(velocity, x, tau, w)
    if last_step == "Mean":
        return x + drift * size, v
    if last_step == "Euler":
        return x + v * size, v
    return x / tau + (1 - tau) ** 2 / tau * score(v, x, tau), v


def _sde(one_step, velocity, x, step, diffusion_form, diffusion_norm, last_step, brownian):
    if diffusion_form not in DIFFUSION_FORMS:
        raise ValueError(f"diffusion_form {diffusion_form!r}: SiT's Linear path runs {tuple(DIFFUSION_FORMS)}.")
    if last_step not in LAST_STEPS:
        raise ValueError(f"last_step {last_step!r}: SiT's are {LAST_STEPS}.")
    tau, dt = _interval(step)
    form = DIFFUSION_FORMS[diffusion_form]
    diffusion = lambda t: form(t, diffusion_norm)  # noqa: E731

    def sde_step():
        noise = step.noise(x) if brownian is None else brownian[step.index].astype(x.dtype)
        return one_step(velocity, x, tau, dt, noise * jnp.sqrt(dt), diffusion)

    if last_step is None:
        return sde_step()
    last = lambda: _last_step(velocity, x, tau, dt, diffusion(tau), last_step)  # noqa: E731
    return jax.lax.cond(step.index == step.num_steps - 1, last, sde_step)


def _euler_maruyama(velocity, x, tau, dt, dw, diffusion):
    drift, v = _sde_drift(velocity, x, tau, diffusion(tau))
    return x + drift * dt + jnp.sqrt(2 * diffusion(tau)) * dw, v


def _heun(velocity, x, tau, dt, dw, diffusion):
    x_hat = x + jnp.sqrt(2 * diffusion(tau)) * dw
    k1, v = _sde_drift(velocity, x_hat, tau, diffusion(tau))
    k2, _ = _sde_drift(velocity, x_hat + dt * k1, tau + dt, diffusion(tau + dt))
    return x_hat + 0.5 * dt * (k1 + k2), v


def sde_euler(
    velocity: Velocity,
    x: Array,
    step: Step,
    *,
    diffusion_form: str = "sigma",
    diffusion_norm: float = 1.0,
    last_step: str | None = "Mean",
    brownian: Array | None = None,
) -> tuple[Array, Array]:
    """SiT's Euler–Maruyama step (sde.__Euler_Maruyama_step): x + drift·dτ + sqrt(2·w(τ))·sqrt(dτ)·ξ, or its
    last step on the grid's last interval. ξ ~ N(0, I) from the step's key, or `brownian[step.index]`
    (`[steps, rows, h, w, c]`: given normals, e.g. those a torch run drew)."""
    return _sde(_euler_maruyama, velocity, x, step, diffusion_form, diffusion_norm, last_step, brownian)


def sde_heun(
    velocity: Velocity,
    x: Array,
    step: Step,
    *,
    diffusion_form: str = "sigma",
    diffusion_norm: float = 1.0,
    last_step: str | None = "Mean",
    brownian: Array | None = None,
) -> tuple[Array, Array]:
    """SiT's Heun SDE step (sde.__Heun_step): the noise first, x̂ = x + sqrt(2·w(τ))·sqrt(dτ)·ξ, then Heun on
    the drift from x̂: k1 at (x̂, τ), k2 at (x̂ + dτ·k1, τ + dτ), x̂ + dτ·(k1 + k2)/2. Options as `sde_euler`."""
    return _sde(_heun, velocity, x, step, diffusion_form, diffusion_norm, last_step, brownian)
