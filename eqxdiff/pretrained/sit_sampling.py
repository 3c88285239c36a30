"""willisma/SiT's sampling protocols (`transport/`, `sample.py`, `sample_ddp.py`) for a `load_sit` model.

Linear path, velocity prediction, SiT's defaults for them (train_eps = sample_eps = 0, so the ODE runs τ
from 0 to 1). `steps` is SiT's `--num-sampling-steps`, the number of points of its time grid
τ = linspace(t0, t1, steps): the fixed-step ODE takes steps - 1 steps (Heun: 2·(steps - 1) network calls);
the SDE takes steps - 1 SDE steps on linspace(0, 1 - last_step_size, steps), then its last step to τ = 1.
SiT-XL/2's published FIDs at cfg 1.5 (the authors' project page, its benchmark table): 2.06 with the SDE,
w(t) = σ_t (here `method="sde"` with its defaults, Euler–Maruyama, sigma, Mean), 2.15 with the ODE, by
default "a 250 steps Heun ODE solver" there and "125 steps (250 NFEs)" in willisma/SiT#18, which is
`--sampling-method heun2 --num-sampling-steps 126` in their PyTorch code (`sampler="heun", steps=126`).
The grid maps onto eqxdiff's σ grid σ = (1-τ)/τ and the fixed-step methods run as one `lax.scan` in
`eqxdiff.diffusion.sample` (the steps below say what maps onto what); dopri5 is diffrax's, set up as
torchdiffeq runs it (`dopri5` below) at SiT's tolerances (atol 1e-6, rtol 1e-3), one adaptive solve for
the whole batch as `odeint` does.

Classifier-free guidance is SiT's `forward_with_cfg` on SiT's own doubled batch, as `sample_ddp.py` runs it
for cfg_scale > 1: the state is [x, x] with labels [y, null]; the network sees [x, x] (first half twice),
the first `guided_channels` (3, SiT's choice "for exact reproducibility") of the velocity are
uncond + s·(cond - uncond) in both halves and the rest stay the network's own, conditional in the first
half and unconditional in the second. Only the first half is returned, but the second is integrated too,
since torchdiffeq's error norm (dopri5's step sizes) and the SDE's noise draws run over both.
"""

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxdiff.diffusion.samplers import Step, sample
from eqxdiff.nn.dit import DiT


# SiT's samplers (willisma/SiT `transport/`, Linear path, velocity prediction) as step functions on a σ grid.
#
# SiT's interpolant is x_τ = τ·x1 + (1-τ)·ε with τ in [0, 1] running from noise to data, and the network
# predicts the velocity v = x1 - ε. That is eqxdiff's rectified flow (`FlowSchedule`) run the other way:
# eqxdiff's t = 1-τ is the noise fraction, σ = (1-τ)/τ, s(σ) = τ, and x_τ = s·(x0 + σ·ε) = τ·x̃. A SiT time
# grid τ_0 < ... < τ_n is the decreasing σ grid σ_i = (1-τ_i)/τ_i (τ = 0 is σ = ∞), so these steps run
# through `eqxdiff.diffusion.sample` as one `lax.scan`, each moving x from `step.sigma` to `step.sigma_next`.
#
# Two things keep them in SiT's coordinates instead of σ-space's denoiser form `D(x̃; σ)`: SiT starts at
# τ = 0, σ = ∞, where the unscaled x̃ = x_τ/τ does not exist; and SiT's Heun averages velocities in τ,
# which is not EDM's Heun in σ (that averages ε̂) — only Euler is the same step in both (it is DDIM). So
# the carried x is SiT's x_τ, the first argument is the velocity `v(x_τ, τ)` with τ = 1/(1+σ) a scalar,
# and these are not entries of `eqxdiff.diffusion.SAMPLERS` (whose methods take a denoiser).
#
# The SDE is SiT's dx = [v + w(τ)·score]dτ + sqrt(2·w(τ))·dW with the Linear path's score
# (τ·v - x)/(1-τ) and diffusion coefficient w(τ) (`diffusion_form` × `diffusion_norm`); a grid whose last
# interval ends at τ = 1 (σ = 0) takes SiT's last step there instead of an SDE step.


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


# SiT's adaptive ODE solve (torchdiffeq's `odeint(method="dopri5")` from τ = 0 to 1) through diffrax.
#
# diffrax's `Dopri5` + `PIDController(rtol, atol)` is torchdiffeq's solver and controller: the same
# Dormand–Prince tableau and error estimate, an RMS norm of error/(atol + rtol·max(|y0|, |y1|)) over the
# whole state, the step scaled by safety 0.9 · err^(-1/5) within [0.2, 10] (no growth past 1 after an
# accepted step), and the same quartic dense output. Two things differ, and are set here as torchdiffeq does:
#
# - the first step: Hairer's rule (Hairer, Nørsett & Wanner, "Solving ODEs I", II.4), which torchdiffeq
#   runs and diffrax 0.7.2 skips once `diffeqsolve` has wrapped the term (it then starts with 0.01);
# - the end: torchdiffeq does not shorten the last step to land on τ = 1; it steps past it (the network
#   sees τ > 1) and reads τ = 1 off that step's interpolant. Here the solve runs towards a far t1, stops
#   at the first step past τ = 1 (an `Event`) and saves τ = 1 from the dense output.
#
# What remains is rounding of the error estimate, a difference of nearly equal stages: it moves step sizes
# in float32, and can flip a step whose error ratio sits at the controller's threshold (tests/pretrained/test_sit_sampling.py
# states the distances measured).


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


ODE_SAMPLERS = {"euler": ode_euler, "heun": ode_heun, "heun2": ode_heun, "dopri5": None}
SDE_SAMPLERS = {"euler": sde_euler, "heun": sde_heun}


class SiTVelocity(eqx.Module):
    """SiT's network as the velocity v(x_τ, τ) its samplers integrate: `model.forward` (the first c
    channels) on b rows, or with `guidance` > 1 `forward_with_cfg` on the doubled batch of 2b rows."""

    model: DiT
    labels: Int[Array, " rows"]
    guidance: float | None = eqx.field(static=True)
    guided_channels: int | None = eqx.field(static=True)

    def __init__(self, model: DiT, labels: Int[Array, " b"], guidance: float = 1.0, guided_channels: int | None = 3):
        self.model, self.guided_channels = model, guided_channels
        if guidance > 1:
            self.guidance, self.labels = float(guidance), jnp.concatenate([labels, model.null_cond(labels.shape[0])])
        else:
            self.guidance, self.labels = None, labels

    def __call__(self, x: Float[Array, "rows h w c"], tau: Float[Array, ""]) -> Float[Array, "rows h w c"]:
        t = jnp.full(x.shape[:1], tau, x.dtype)
        if self.guidance is None:
            return self.model(x, t, self.labels)[..., : x.shape[-1]]
        half = x[: x.shape[0] // 2]
        out = self.model(jnp.concatenate([half, half]), t, self.labels)[..., : x.shape[-1]]
        k = self.guided_channels or x.shape[-1]
        cond, uncond = jnp.split(out[..., :k], 2)
        guided = uncond + self.guidance * (cond - uncond)
        return jnp.concatenate([jnp.concatenate([guided, guided]), out[..., k:]], axis=-1)


def sit_sigmas(taus: np.ndarray) -> np.ndarray:
    """eqxdiff's σ = (1-τ)/τ of a SiT time grid (float64; τ = 0 gives σ = ∞)."""
    taus = np.asarray(taus, np.float64)
    with np.errstate(divide="ignore"):
        return (1 - taus) / taus


def sit_time_grid(steps: int, method: str, last_step: str | None = "Mean", last_step_size: float = 0.04) -> np.ndarray:
    """SiT's τ grid for the Linear path with velocity prediction (Transport.check_interval, then
    linspace(t0, t1, steps)); the SDE's ends at 1 - last_step_size and gets τ = 1 appended for its last step."""
    if method == "ode" or last_step is None:
        return np.linspace(0.0, 1.0, steps)
    return np.append(np.linspace(0.0, 1.0 - last_step_size, steps), 1.0)


def sample_sit(
    model: DiT,
    labels: Int[Array, " b"],
    noise: Float[Array, "b h w c"],
    *,
    steps: int | None = None,
    method: str = "ode",
    sampler: str | None = None,
    guidance: float = 1.0,
    guided_channels: int | None = 3,
    key: PRNGKeyArray | None = None,
    atol: float = 1e-6,
    rtol: float = 1e-3,
    max_steps: int = 4096,
    diffusion_form: str = "sigma",
    diffusion_norm: float = 1.0,
    last_step: str | None = "Mean",
    last_step_size: float = 0.04,
    brownian: Float[Array, "n rows h w c"] | Float[np.ndarray, "n rows h w c"] | None = None,
) -> Float[Array, "b h w c"]:
    """Sample a SiT (`load_sit`) from `noise` (SiT's x at τ = 0, NHWC) to τ = 1, as SiT's sample_ddp.py does.

    `method` "ode" (SiT's `sample_ode`; `sampler` "dopri5" — SiT's default — with `atol`, `rtol` and at
    most `max_steps` steps, or "heun"/"heun2", "euler" on `steps` grid points) or "sde" (`sample_sde`;
    `sampler` "euler" — Euler–Maruyama, SiT's default — or "heun", with `diffusion_form` ("sigma",
    "linear", "decreasing"), `diffusion_norm`, `last_step` ("Mean", "Tweedie", "Euler" or None) and
    `last_step_size`; needs `key`, or `brownian`: the unit normals of each SDE step, [steps - 1 (steps
    without a last step), rows, h, w, c], rows = 2b with cfg). `steps` is SiT's --num-sampling-steps
    (module docstring); dopri5 needs none. `guidance` > 1 guides the first `guided_channels` latent
    channels as SiT's forward_with_cfg (None: all of them). Returns the samples at τ = 1, [b, h, w, c].
    """
    if method not in ("ode", "sde"):
        raise ValueError(f"method {method!r}: SiT samples with 'ode' or 'sde'.")
    samplers = ODE_SAMPLERS if method == "ode" else SDE_SAMPLERS
    sampler = sampler or ("dopri5" if method == "ode" else "euler")
    if sampler not in samplers:
        raise ValueError(f"sampler {sampler!r} for method {method!r}: choose one of {tuple(samplers)}.")
    if noise.ndim != 4 or noise.shape[-1] != model.in_channels or labels.shape != noise.shape[:1]:
        raise ValueError(
            f"noise must be [b, h, w, {model.in_channels}] (NHWC) and labels [b]; got {noise.shape}, {labels.shape}."
        )
    if guidance < 1:
        raise ValueError(f"guidance {guidance}: SiT's sample_ddp.py asserts cfg_scale >= 1 (1: no guidance).")
    velocity = SiTVelocity(model, labels, guidance, guided_channels)
    x = jnp.concatenate([noise, noise]) if velocity.guidance is not None else noise
    if sampler == "dopri5":
        return dopri5(velocity, x, rtol, atol, max_steps)[: noise.shape[0]]
    if not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps={steps!r}: SiT's {method} {sampler} needs a time grid of steps >= 2 points.")
    options = {}
    if method == "sde":
        if last_step is not None and not 0 < last_step_size < 1:
            raise ValueError(f"last_step_size {last_step_size}: SiT's last step runs from 1 - last_step_size to 1.")
        if sampler == "heun" and last_step is None:
            raise ValueError("SiT's Heun SDE without a last step evaluates the score at τ = 1, where it divides by 0.")
        if brownian is not None:
            brownian = jnp.asarray(brownian)
            want = (steps - 1,) + x.shape  # steps - 1 SDE steps, with or without a last step after them
            if brownian.shape != want:
                raise ValueError(f"brownian must be {want} (SDE steps, rows, h, w, c); got {brownian.shape}.")
        elif key is None:
            raise ValueError("SiT's SDE draws noise: pass key=jax.random.key(seed) (or brownian=).")
        options = dict(
            diffusion_form=diffusion_form, diffusion_norm=diffusion_norm, last_step=last_step, brownian=brownian
        )
    taus = sit_time_grid(steps, method, last_step, last_step_size)
    key = None if method == "ode" else key
    return sample(velocity, x, sit_sigmas(taus), samplers[sampler], key, **options)[: noise.shape[0]]
