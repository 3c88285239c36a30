"""Samplers: integrate a denoiser down a decreasing σ grid, as ONE `lax.scan` in one jit.

Every method works on the unscaled sample x = x0 + σ·ε and a denoiser
`denoise(x, sigma) -> x0_hat` (sigma a scalar array). The probability-flow ODE is
dx/dσ = (x - D(x; σ))/σ (Karras et al. 2022, eq. 3 with s = 1, σ(t) = t).

A sampler is one step function `step_fn(denoise, x, step, *, options...) -> (x_next, denoised)`
that moves x from `step.sigma` to `step.sigma_next`; its keyword-only parameters are its options,
with their defaults. Add one to `SAMPLERS` to call it by name, or pass it to `sample` directly.
"""

import inspect
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

DenoiseFn = Callable[[Array, Array], Array]


class Step(eqx.Module):
    """One grid interval σ → σ_next of `num_steps`, with what multistep methods carry over.

    `previous_denoised` is D(x; sigma_prev) from the step before (zeros on the first step, where
    sigma_prev = sigma). `key` is this step's own key, None when `sample` got no key.
    """

    sigma_prev: Float[Array, ""]
    sigma: Float[Array, ""]
    sigma_next: Float[Array, ""]
    index: Int[Array, ""]
    previous_denoised: Array
    key: PRNGKeyArray | None
    num_steps: int = eqx.field(static=True)
    method: str = eqx.field(static=True)  # the sampler's name, for error messages

    @property
    def first(self) -> Bool[Array, ""]:
        return self.index == 0

    def noise(self, like: Array) -> Array:
        """Unit Gaussian noise shaped like `like`; the same draw on every call within one step."""
        if self.key is None:
            raise ValueError(
                f"Sampler {self.method!r} is stochastic with these options: pass key=jax.random.key(seed)."
            )
        return jax.random.normal(self.key, like.shape, like.dtype)


def pf_ode_slope(x, denoised, sigma):
    """dx/dσ of the probability-flow ODE (Karras et al. 2022, eq. 3)."""
    return (x - denoised) / sigma


def euler(denoise: DenoiseFn, x: Array, step: Step) -> tuple[Array, Array]:
    """First-order step of the PF-ODE (DDIM(η=0) in σ-space; Song et al. 2021, Karras eq. 3)."""
    denoised = denoise(x, step.sigma)
    return x + (step.sigma_next - step.sigma) * pf_ode_slope(x, denoised, step.sigma), denoised


def heun(
    denoise: DenoiseFn,
    x: Array,
    step: Step,
    *,
    s_churn: float = 0.0,
    s_tmin: float = 0.0,
    s_tmax: float = float("inf"),
    s_noise: float = 1.0,
) -> tuple[Array, Array]:
    """EDM Algorithm 2 (Alg. 1 when s_churn = 0); the step to σ = 0 is plain Euler.

    Churn raises σ by γ = min(s_churn/num_steps, √2 - 1) where s_tmin ≤ σ ≤ s_tmax, adding noise
    of std σ·sqrt(γ(2+γ))·s_noise (Karras et al. 2022, Alg. 2 lines 4-6).
    """
    sigma = step.sigma
    if s_churn > 0:
        gamma = min(s_churn / step.num_steps, math.sqrt(2) - 1)
        in_range = (sigma >= s_tmin) & (sigma <= s_tmax)
        gamma = jnp.where(in_range, gamma, 0.0).astype(sigma.dtype)
        # sqrt(σ_hat² - σ²) written as σ·sqrt(γ(2+γ)): never the sqrt of a rounded negative.
        x = x + sigma * jnp.sqrt(gamma * (2 + gamma)) * s_noise * step.noise(x)
        sigma = sigma * (1 + gamma)
    denoised = denoise(x, sigma)
    slope = pf_ode_slope(x, denoised, sigma)
    x_euler = x + (step.sigma_next - sigma) * slope

    def correct():
        slope_next = pf_ode_slope(x_euler, denoise(x_euler, step.sigma_next), step.sigma_next)
        return x + (step.sigma_next - sigma) * (slope + slope_next) / 2

    return jax.lax.cond(step.sigma_next > 0, correct, lambda: x_euler), denoised


def dpmpp_2m(denoise: DenoiseFn, x: Array, step: Step, *, first_order_last: bool = False) -> tuple[Array, Array]:
    """DPM-Solver++(2M) (Lu et al. 2022, Alg. 2) in λ = -ln σ; first order on the first step and onto σ = 0.

    `first_order_last`: the last step is first order also onto a σ > 0 (diffusers' `DPMSolverMultistepScheduler`
    with `final_sigmas_type="sigma_min"` does so below 15 steps, `lower_order_final`, or with `euler_at_final`).
    """
    denoised = denoise(x, step.sigma)
    ratio = step.sigma_next / step.sigma  # = exp(-h)
    first_order = ratio * x + (1 - ratio) * denoised
    safe_next = jnp.where(step.sigma_next > 0, step.sigma_next, step.sigma)
    h = jnp.log(step.sigma) - jnp.log(safe_next)
    r = (jnp.log(step.sigma_prev) - jnp.log(step.sigma)) / h
    corrected = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * step.previous_denoised
    second_order = ratio * x - jnp.expm1(-h) * corrected
    use_first = step.first | (step.sigma_next == 0) | (first_order_last & (step.index == step.num_steps - 1))
    return jnp.where(use_first, first_order, second_order), denoised


def dpmpp_2m_sde(
    denoise: DenoiseFn, x: Array, step: Step, *, eta: float = 1.0, s_noise: float = 1.0
) -> tuple[Array, Array]:
    """DPM-Solver++(2M) SDE, midpoint variant (Lu et al. 2022; k-diffusion `sample_dpmpp_2m_sde`).

    eta = 0 is the deterministic DPM-Solver++(2M) midpoint ODE step; eta > 0 needs a key.
    """
    denoised = denoise(x, step.sigma)
    safe_next = jnp.where(step.sigma_next > 0, step.sigma_next, step.sigma)
    h = jnp.log(step.sigma) - jnp.log(safe_next)
    eta_h = eta * h
    decay = -jnp.expm1(-h - eta_h)
    x_next = (safe_next / step.sigma) * jnp.exp(-eta_h) * x + decay * denoised
    r = (jnp.log(step.sigma_prev) - jnp.log(step.sigma)) / h
    x_next = jnp.where(step.first, x_next, x_next + 0.5 * decay * (denoised - step.previous_denoised) / r)
    if eta > 0:
        std = safe_next * jnp.sqrt(-jnp.expm1(-2 * eta_h)) * s_noise
        x_next = x_next + std * step.noise(x)
    return jnp.where(step.sigma_next > 0, x_next, denoised), denoised


def euler_ancestral(
    denoise: DenoiseFn, x: Array, step: Step, *, eta: float = 1.0, s_noise: float = 1.0, noises: Array | None = None
) -> tuple[Array, Array]:
    """Ancestral Euler (k-diffusion `sample_euler_ancestral`): step to σ_down, add σ_up noise.

    σ_up = min(σ_next, eta·sqrt(σ_next²(σ² - σ_next²)/σ²)), σ_down = sqrt(σ_next² - σ_up²).
    `noises` [num_steps, *x.shape]: every step's unit noise given (e.g. diffusers' draws, to replay them), no key.
    """
    denoised = denoise(x, step.sigma)
    sigma, sigma_next = step.sigma, step.sigma_next
    sigma_up = jnp.minimum(sigma_next, eta * jnp.sqrt(sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2))
    sigma_down = jnp.sqrt(sigma_next**2 - sigma_up**2)
    x = x + pf_ode_slope(x, denoised, sigma) * (sigma_down - sigma)
    if eta > 0:
        x = x + sigma_up * s_noise * (step.noise(x) if noises is None else noises[step.index].astype(x.dtype))
    return x, denoised


def meanflow(denoise: DenoiseFn, x: Array, step: Step) -> tuple[Array, Array]:
    """MeanFlow's step z_r = z_t - (t - r)·u(z_t, r, t) (Geng et al. 2025, Alg. 2), t and r the flow times of σ and
    σ_next: the Euler step with the denoiser of the network's average velocity over the step, D = z_t - t·u
    (`denoise(x, σ, sigma_end=σ_next)`, eqxdiff.diffusion.Denoiser's, under the flow parameterization), since
    Euler in σ is Euler in t for x = z_t/(1 - t). One step onto σ = 0 is z_0 = z_t - t·u: one network call. Its grid
    is uniform in t (eqxdiff/generate.py, grids.py's `flow_time_sigmas`)."""
    denoised = denoise(x, step.sigma, sigma_end=step.sigma_next)
    return x + (step.sigma_next - step.sigma) * pf_ode_slope(x, denoised, step.sigma), denoised


def _vp_coords(sigma):
    """ᾱ and sqrt(ᾱ) of a σ: ᾱ = 1/(1+σ²)."""
    alpha_bar = 1 / (1 + sigma**2)
    return alpha_bar, jnp.sqrt(alpha_bar)


def ddim(
    denoise: DenoiseFn, x: Array, step: Step, *, eta: float = 0.0, sigmas_to: Array | None = None
) -> tuple[Array, Array]:
    """DDIM (Song et al. 2021, eq. 12), written in VP coordinates x_t = sqrt(ᾱ)·x.

    eta = 0 is deterministic (the PF-ODE's Euler step in σ); eta = 1 is DDPM's posterior.
    `sigmas_to` [num_steps]: the σ each step lands on where it is not the next grid σ. diffusers'
    `DDIMScheduler` steps from t to t - T//n, which is not the next timestep when n does not divide T
    (linspace/trailing spacing), and the next step takes that x_t as if at its own t: x_t is kept, so in
    σ-space x is rescaled from sigmas_to[i] to the grid's next σ.
    """
    denoised = denoise(x, step.sigma)
    alpha_bar, sqrt_alpha_bar = _vp_coords(step.sigma)
    sigma_to = step.sigma_next if sigmas_to is None else sigmas_to[step.index].astype(x.dtype)
    alpha_bar_next, sqrt_alpha_bar_next = _vp_coords(sigma_to)
    x_t = sqrt_alpha_bar * x
    eps = (x_t - sqrt_alpha_bar * denoised) / jnp.sqrt(1 - alpha_bar)
    std = eta * jnp.sqrt((1 - alpha_bar_next) / (1 - alpha_bar) * (1 - alpha_bar / alpha_bar_next))
    direction = jnp.sqrt(jnp.maximum(1 - alpha_bar_next - std**2, 0.0)) * eps
    x_prev = sqrt_alpha_bar_next * denoised + direction
    if eta > 0:
        x_prev = x_prev + std * step.noise(x)
    return x_prev / _vp_coords(step.sigma_next)[1], denoised


def ddpm(denoise: DenoiseFn, x: Array, step: Step) -> tuple[Array, Array]:
    """Ancestral sampling from the posterior q(x_{t-1} | x_t, x0_hat) (Ho et al. 2020, eq. 6-7)."""
    denoised = denoise(x, step.sigma)
    alpha_bar, sqrt_alpha_bar = _vp_coords(step.sigma)
    alpha_bar_prev, sqrt_alpha_bar_prev = _vp_coords(step.sigma_next)
    alpha = alpha_bar / alpha_bar_prev
    beta = 1 - alpha
    mean = (sqrt_alpha_bar_prev * beta / (1 - alpha_bar)) * denoised + (
        jnp.sqrt(alpha) * (1 - alpha_bar_prev) / (1 - alpha_bar)
    ) * (sqrt_alpha_bar * x)
    var = (1 - alpha_bar_prev) / (1 - alpha_bar) * beta
    return (mean + jnp.sqrt(var) * step.noise(x)) / sqrt_alpha_bar_prev, denoised


def _vp_step_variances(sigma, sigma_next):
    """(β, β̃) of one VP step σ → σ_next, ᾱ = 1/(1+σ²): β = 1 - ᾱ/ᾱ_next and the posterior variance
    β̃ = β·(1-ᾱ_next)/(1-ᾱ), both written from σ² - σ_next² so that short steps do not cancel."""
    drop = (sigma - sigma_next) * (sigma + sigma_next)
    return drop / (1 + sigma**2), drop * sigma_next**2 / (sigma**2 * (1 + sigma_next**2))


def learned_range_posterior(x, denoised, v, sigma_prev, sigma, sigma_next) -> tuple[Array, Array]:
    """iDDPM's p(x_next | x) with the learned-range variance (Nichol & Dhariwal 2021, eq. 15), one step σ → σ_next.

    mean = D + (σ_next/σ)²·(x - D): DDPM's posterior mean (eq. 7) of q(x_next | x, x0 = D) in σ-space.
    log_variance is in the units of x_t = sqrt(ᾱ)·x, as iDDPM reports it: frac·log β + (1-frac)·log β̃ with
    frac = (v+1)/2 and the step's own β, β̃ (a respaced grid's recomputed ones); on the step to σ = 0, where
    β̃ = 0, β̃ is the step before's (sigma_prev → sigma): iDDPM's `posterior_log_variance_clipped`.
    """
    beta, posterior = _vp_step_variances(sigma, sigma_next)
    _, posterior_before = _vp_step_variances(sigma_prev, sigma)
    log_min = jnp.log(jnp.where(sigma_next > 0, posterior, posterior_before))
    frac = (v + 1) / 2
    return denoised + (sigma_next / sigma) ** 2 * (x - denoised), frac * jnp.log(beta) + (1 - frac) * log_min


def ddpm_learned_variance(
    denoise: DenoiseFn, x: Array, step: Step, *, noises: Array | None = None
) -> tuple[Array, Array]:
    """DDPM's ancestral step with iDDPM's learned-range variance (`learned_range_posterior`), as ADM and DiT sample.

    `denoise(x, sigma)` gives 2c channels, D(x; σ) then the network's v in [-1, 1] (`LearnedVarianceDenoiser`);
    a denoiser of c channels has no learned variance: v = -1, the posterior β̃ (`ddpm`). No noise on the step to
    σ = 0.
    `noises` [num_steps, *x.shape]: every step's unit noise given (another implementation's draws), no key.
    """
    out = denoise(x, step.sigma)
    c = x.shape[-1]
    if out.shape[-1] not in (c, 2 * c):
        raise ValueError(
            f"ddpm_learned_variance: the denoiser gives {out.shape[-1]} channels for {c}; it gives c "
            "(D alone) or 2c (D, then the learned-variance interpolation v)."
        )
    denoised = out[..., :c]
    v = out[..., c:] if out.shape[-1] == 2 * c else -jnp.ones_like(denoised)
    mean, log_variance = learned_range_posterior(x, denoised, v, step.sigma_prev, step.sigma, step.sigma_next)
    noise = step.noise(x) if noises is None else noises[step.index].astype(x.dtype)
    std = jnp.sqrt(1 + step.sigma_next**2) * jnp.exp(0.5 * log_variance)  # x_t's std in units of x = x_t/sqrt(ᾱ)
    return jnp.where(step.sigma_next > 0, mean + std * noise, mean), denoised


# The one list of methods: `sample(..., method=name)` looks names up here.
SAMPLERS = {
    "euler": euler,
    "heun": heun,
    "dpmpp_2m": dpmpp_2m,
    "dpmpp_2m_sde": dpmpp_2m_sde,
    "euler_ancestral": euler_ancestral,
    "ddim": ddim,
    "ddpm": ddpm,
    "ddpm_learned_variance": ddpm_learned_variance,
    "meanflow": meanflow,  # a network of two times (--objective meanflow): one step, or a few
}
METHODS = SAMPLERS.keys()  # a live view: a sampler added to SAMPLERS later (from train/) is a method too

StepFn = Callable[..., tuple[Array, Array]]


def _option_defaults(step_fn: StepFn) -> dict:
    """A step function's options: its keyword-only parameters and their defaults."""
    params = inspect.signature(step_fn).parameters.values()
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}


def _bind_options(step_fn: StepFn, name: str, options: dict) -> dict:
    """Every option of `step_fn`, the given ones over its defaults; an unknown one raises."""
    defaults = _option_defaults(step_fn)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(step_fn).parameters.values())
    for option in options:
        if option not in defaults and not takes_any:
            users = tuple(m for m, fn in SAMPLERS.items() if option in _option_defaults(fn))
            raise ValueError(
                f"{option} applies to {users or 'no built-in sampler'}, not {name!r}, "
                f"whose options are {tuple(defaults) or 'none'}."
            )
    bound = {**defaults, **options}
    missing = tuple(option for option, value in bound.items() if value is inspect.Parameter.empty)
    if missing:
        raise ValueError(f"Sampler {name!r} needs the options {missing}.")
    try:
        inspect.signature(step_fn).bind(None, None, None, **bound)
    except TypeError as error:
        raise ValueError(f"A step function is called as {name}(denoise, x, step, **options): {error}.") from None
    return bound


def _sample_scan(denoise, x, sigmas, key, step_fn, name, options):
    num_steps = sigmas.shape[0] - 1
    per_step = dict(
        sigma_prev=jnp.concatenate([sigmas[:1], sigmas[:-2]]),
        sigma=sigmas[:-1],
        sigma_next=sigmas[1:],
        index=jnp.arange(num_steps),
        key=None if key is None else jax.random.split(key, num_steps),
    )

    def body(carry, this_step):
        x, previous_denoised = carry
        step = Step(**this_step, previous_denoised=previous_denoised, num_steps=num_steps, method=name)
        x, denoised = step_fn(denoise, x, step, **options)
        return (x, denoised), None

    (x, _), _ = jax.lax.scan(body, (x, jnp.zeros_like(x)), per_step)
    return x


# Counts traces (= compiles) without limiting them; tests read it with eqx.debug.get_num_traces.
_sample_traced = eqx.debug.assert_max_traces(_sample_scan, max_traces=None)
_sample_jit = eqx.filter_jit(_sample_traced)


def sample(
    denoise: DenoiseFn,
    x_init: Float[Array, "b *dims"],
    sigmas: Float[Array, " n_plus_1"] | Float[np.ndarray, " n_plus_1"],
    method: str | StepFn = "heun",
    key: PRNGKeyArray | None = None,
    **options,
) -> Float[Array, "b *dims"]:
    """Integrate `denoise` from σ = sigmas[0] down to sigmas[-1] (usually 0).

    `x_init` is sigmas[0]·(unit noise) in the unscaled space; the result has its dtype.
    `method` is a name in `SAMPLERS` (`METHODS`) or a step function of the same form; `options`
    are that function's keyword-only parameters (e.g. heun's s_churn, ddim's eta), defaulting to
    its signature. A method that draws noise with these options needs `key`.
    Compiles once per (denoise structure, shapes, method, options); the steps are one scan.
    """
    if callable(method):
        step_fn, name = method, getattr(method, "__name__", repr(method))
    elif method in SAMPLERS:
        step_fn, name = SAMPLERS[method], method
    else:
        raise ValueError(f"Unknown sampler {method!r}; choose one of {tuple(SAMPLERS)} or pass a step function.")
    sigmas = jnp.asarray(sigmas, x_init.dtype)
    if sigmas.ndim != 1 or sigmas.shape[0] < 2:
        raise ValueError(f"sigmas must be a 1-D grid of n+1 >= 2 levels, got shape {sigmas.shape}.")
    options = _bind_options(step_fn, name, options)
    return _sample_jit(denoise, x_init, sigmas, key, step_fn, name, options)
