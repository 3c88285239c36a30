"""SiT's adaptive ODE solve (torchdiffeq's `odeint(method="dopri5")` from τ = 0 to 1) through diffrax.

diffrax's `Dopri5` + `PIDController(rtol, atol)` is torchdiffeq's solver and controller: the same
Dormand–Prince tableau and error estimate, an RMS norm of error/(atol + rtol·max(|y0|, |y1|)) over the
whole state, the step scaled by safety 0.9 · err^(-1/5) within [0.2, 10] (no growth past 1 after an
accepted step), and the same quartic dense output. Two things differ, and are set here as torchdiffeq does:

- the first step: Hairer's rule (Hairer, Nørsett & Wanner, "Solving ODEs I", II.4), which torchdiffeq
  runs and diffrax 0.7.2 skips once `diffeqsolve` has wrapped the term (it then starts with 0.01);
- the end: torchdiffeq does not shorten the last step to land on τ = 1; it steps past it (the network
  sees τ > 1) and reads τ = 1 off that step's interpolant. Here the solve runs towards a far t1, stops
  at the first step past τ = 1 (an `Event`) and saves τ = 1 from the dense output.

What remains is float32 rounding of the error estimate, a difference of nearly equal stages, which
moves step sizes by a fraction of a percent (tests/test_sit_sampling.py states the distance measured).
"""

from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

FAR = 1e3  # the solve's nominal end, never reached: it stops once past τ = 1


def _rms(a: Array) -> Array:
    return jnp.sqrt(jnp.mean(jnp.square(a)))


def first_step(velocity: Callable, x: Array, rtol: float, atol: float, order: int = 5) -> Float[Array, ""]:
    """torchdiffeq's `_select_initial_step` at τ = 0 (Hairer et al., II.4): h0 = 0.01·‖x‖/‖f0‖ and
    h1 = (0.01/max(‖f0‖, ‖f(h0) - f0‖/h0))^(1/order), norms scaled by atol + rtol·|x|; min(100·h0, h1)."""
    scale = atol + jnp.abs(x) * rtol
    f0 = velocity(x, jnp.zeros((), x.dtype))
    d0, d1 = _rms(x / scale), _rms(f0 / scale)
    h0 = jnp.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / d1)
    d2 = _rms((velocity(x + h0 * f0, h0) - f0) / scale) / h0
    d = jnp.maximum(d1, d2)
    h1 = jnp.where(d <= 1e-15, jnp.maximum(1e-6, h0 * 1e-3), (0.01 / d) ** (1 / order))
    return jnp.minimum(100 * h0, h1)


@eqx.filter_jit
def dopri5(velocity: Callable, x: Float[Array, "rows h w c"], rtol: float, atol: float, max_steps: int) -> Array:
    """x at τ = 1 from x at τ = 0 under dx/dτ = velocity(x, τ), as SiT's `sample_ode` (dopri5) computes it."""
    import diffrax  # here, not at the top: a heavy import that only this solver needs

    past_one = diffrax.Event(lambda t, y, args, **kwargs: t >= 1.0)
    solution = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda tau, y, args: velocity(y, tau)),
        diffrax.Dopri5(),
        t0=0.0,
        t1=FAR,
        dt0=first_step(velocity, x, rtol, atol),
        y0=x,
        saveat=diffrax.SaveAt(ts=jnp.ones((1,))),
        stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
        event=past_one,
        max_steps=max_steps,
    )
    return solution.ys[0]
