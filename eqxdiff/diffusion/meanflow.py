"""MeanFlow (Geng, Deng, Bai, Kolter, He 2025, "Mean Flows for One-step Generative Modeling"): a network of two
times learns the average velocity u(z_t, r, t) = 1/(t − r)·∫_r^t v(z_τ, τ) dτ along the flow
z_t = (1 − t)·x0 + t·ε, so that one step z_r = z_t − (t − r)·u goes from noise to data (samplers.py's `meanflow`).

Training regresses u on the MeanFlow identity u = v − (t − r)·du/dt (eq. 6), the total derivative
du/dt = v·∂_z u + ∂_t u taken by ONE `jax.jvp` along (v, 1, 0) in (z, t, r), the target under stop-gradient
(eq. 10). Here are the draws and the (prediction, target) pair; the loss with its adaptive weight is a visible line
in train/main.py's `meanflow_loss_fn`. Both equal Gsunshine/meanflow's `MeanFlow.forward` in value and gradient
(tests/core/test_meanflow.py, against fixtures tools/make_meanflow_fixtures.py writes from the official code).

In σ-space (schedules.py's FlowSchedule): t is the flow time, σ = t/(1 − t), z_t = s(σ)·(x0 + σ·ε) with
s = 1 − t, and the network sees FlowSchedule's time 1000·t and the interval t − r in the same units, 1000·(t − r)
(the official DiT embeds t and t − r unscaled; the scale is the network's input convention, not the objective's).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..nn.attention import forward_mode
from .denoiser import per_example
from .guidance import condition_where

TIME_SCALE = 1000.0  # FlowSchedule.sigma_to_t(t/(1 - t)) = 1000·t: the network's time of flow time t


def draw_times(
    key: PRNGKeyArray, batch: int, *, p_mean: float = -0.4, p_std: float = 1.0, r_neq_t: float = 0.25
) -> tuple[Float[Array, " b"], Float[Array, " b"]]:
    """MeanFlow's (t, r), t ≥ r: two logit-normal draws, logit ~ N(p_mean, p_std²), sorted (the paper's ImageNet
    defaults, §4.3 and Table 2), then r = t on all but `r_neq_t` of the batch. As the official `sample_tr`: the first
    int(b·(1 − r_neq_t)) examples have r = t (a fixed count, a prefix of the batch, whose order is random)."""
    key_a, key_b = jax.random.split(key)
    a = jax.nn.sigmoid(p_mean + p_std * jax.random.normal(key_a, (batch,), jnp.float32))
    b = jax.nn.sigmoid(p_mean + p_std * jax.random.normal(key_b, (batch,), jnp.float32))
    t, r = jnp.maximum(a, b), jnp.minimum(a, b)
    return t, jnp.where(jnp.arange(batch) < int(batch * (1 - r_neq_t)), t, r)


def draw_condition_drop(key: PRNGKeyArray, batch: int, p: float) -> Bool[Array, " b"]:
    """Which examples train unconditionally (classifier-free guidance's dropout, probability `p` each). As the
    official `cond_drop`: a Binomial(b, p) count of them, the first ones of the batch (with `draw_times`' prefix
    of r = t, dropped examples have r = t while the count stays below it)."""
    count = jnp.sum(jax.random.uniform(key, (batch,)) < p)
    return jnp.arange(batch) < count


def average_velocity(
    model: Callable,
    z: Float[Array, "b *dims"],
    t: Float[Array, " b"],
    r: Float[Array, " b"],
    cond: Any,
    *,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "b *dims"]:
    """u(z_t, r, t): the network of two times at flow time t and interval t − r, in FlowSchedule's time units."""
    return model(z, TIME_SCALE * t, cond, key=key, interval=TIME_SCALE * (t - r))


def guided_velocity(
    model: Callable,
    z: Float[Array, "b *dims"],
    t: Float[Array, " b"],
    v: Float[Array, "b *dims"],
    cond: Any,
    null_cond: Any,
    *,
    omega: float,
    kappa: float,
    t_range: tuple[float, float] = (0.0, 1.0),
) -> Float[Array, "b *dims"]:
    """Classifier-free guidance folded into the target (MeanFlow §4.2, eq. 13 and 19-21): the conditional velocity
    v = ε − x0 mixed with the network's own instantaneous velocities (r = t, no dropout) at z_t,
    v_g = ω·v + (1 − ω − κ)·u(z_t, t, t | ∅) + κ·u(z_t, t, t | c), for t in `t_range` (ω = 1, κ = 0 outside), the
    effective guidance scale ω/(1 − κ). κ = 0 is written v_u + ω·(v − v_u), one network call, as the official
    `guidance_fn`; ω = 1, κ = 0 is v itself, no call."""
    if omega == 1 and kappa == 0:
        return v
    inside = (t >= t_range[0]) & (t <= t_range[1])
    w = per_example(jnp.where(inside, omega, 1.0).astype(v.dtype), v)
    v_uncond = average_velocity(model, z, t, t, null_cond).astype(v.dtype)
    if kappa == 0:
        return v_uncond + w * (v - v_uncond)
    v_cond = average_velocity(model, z, t, t, cond).astype(v.dtype)
    k = per_example(jnp.where(inside, kappa, 0.0).astype(v.dtype), v)
    return w * v + (1 - w - k) * v_uncond + k * v_cond


def meanflow_prediction(
    model: Callable,
    x0: Float[Array, "b *dims"],
    noise: Float[Array, "b *dims"],
    t: Float[Array, " b"],
    r: Float[Array, " b"],
    cond: Any = None,
    null_cond: Any = None,
    drop: Bool[Array, " b"] | None = None,
    *,
    omega: float = 1.0,
    kappa: float = 0.0,
    t_range: tuple[float, float] = (0.0, 1.0),
    key: PRNGKeyArray | None = None,
) -> tuple[Float[Array, "b *dims"], Float[Array, "b *dims"]]:
    """(u, u_tgt), float32: the network's average velocity at z_t = (1 − t)·x0 + t·ε and MeanFlow's target
    u_tgt = v_g − (t − r)·du/dt (eq. 10 with guidance, eq. 21), du/dt = v_g·∂_z u + ∂_t u by one `jax.jvp`
    along (v_g, 1, 0) in (z, t, r), under stop-gradient. `cond`/`null_cond` (b rows each, or None for an unconditional
    network): guidance `omega`, `kappa` (`guided_velocity`); where `drop`, the example trains unconditionally: the
    null condition and the plain v (the official `cond_drop`). `key` drives the network's dropout in u."""
    x0, noise = x0.astype(jnp.float32), noise.astype(jnp.float32)
    t_, r_ = per_example(t, x0), per_example(r, x0)
    z = (1 - t_) * x0 + t_ * noise
    v = noise - x0
    if cond is not None:
        v_g = guided_velocity(model, z, t, v, cond, null_cond, omega=omega, kappa=kappa, t_range=t_range)
        if drop is not None:
            v_g = jnp.where(drop.reshape(drop.shape + (1,) * (v.ndim - 1)), v, v_g)
            cond = condition_where(drop, null_cond, cond)
    else:
        v_g = v
    v_g = jax.lax.stop_gradient(v_g)  # a tangent and part of the target: no gradient flows through it either way

    def u_of(z, t, r):
        return average_velocity(model, z, t, r, cond, key=key)

    with forward_mode():  # the Pallas attention forms have no jvp rule
        u, du_dt = jax.jvp(u_of, (z, t, r), (v_g, jnp.ones_like(t), jnp.zeros_like(r)))
    u_tgt = v_g - jnp.clip(t_ - r_, 0.0, 1.0) * du_dt.astype(jnp.float32)
    return u.astype(jnp.float32), jax.lax.stop_gradient(u_tgt)


__all__ = [
    "TIME_SCALE",
    "draw_times",
    "draw_condition_drop",
    "average_velocity",
    "guided_velocity",
    "meanflow_prediction",
]
