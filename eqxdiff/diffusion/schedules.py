"""Noise schedules in sigma-space.

Every process is written as `x = s(σ)·(x0 + σ·ε)` (Karras et al. 2022, eq. 7 with
σ-parameterised time). The sampler works on `x / s(σ) = x0 + σ·ε`; the schedule only says

- how training draws σ (`sample_sigma`),
- what time input the network sees for a σ (`sigma_to_t`, inverse `t_to_sigma`),
- the scale `s(σ)` of the network's input (`scale`),
- the σ range a sampler should cover (`sigma_min`, `sigma_max`).

σ is a plain array in the data's units (pixels in [-1, 1]).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray


def linear_betas(num_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02) -> np.ndarray:
    """DDPM's linear β_t (Ho et al. 2020, §4), float64, shape (T,)."""
    return np.linspace(beta_start, beta_end, num_timesteps, dtype=np.float64)


def cosine_alpha_bar(t: np.ndarray, s: float = 0.008) -> np.ndarray:
    """ᾱ(t) = f(t)/f(0), f(t) = cos²((t + s)/(1 + s)·π/2), t in [0, 1] (Nichol & Dhariwal 2021, eq. 17)."""
    f = lambda u: np.cos((u + s) / (1 + s) * np.pi / 2) ** 2  # noqa: E731
    return f(np.asarray(t, np.float64)) / f(0.0)


def cosine_betas(num_timesteps: int = 1000, s: float = 0.008, max_beta: float = 0.999) -> np.ndarray:
    """β_i = min(1 - ᾱ((i+1)/T)/ᾱ(i/T), 0.999): the discretisation of Nichol & Dhariwal 2021,
    identical to diffusers' "squaredcos_cap_v2". Float64, shape (T,)."""
    i = np.arange(num_timesteps, dtype=np.float64)
    ratio = cosine_alpha_bar((i + 1) / num_timesteps, s) / cosine_alpha_bar(i / num_timesteps, s)
    return np.minimum(1.0 - ratio, max_beta)


class VPSchedule(eqx.Module):
    """A discrete variance-preserving schedule (DDPM, iDDPM), T timesteps.

    σ_t = sqrt((1 - ᾱ_t)/ᾱ_t), s(σ) = 1/sqrt(1 + σ²) = sqrt(ᾱ). Training draws t uniformly
    from {0, ..., T-1} (Ho et al. 2020, Alg. 1). The network's time input is the timestep
    index; for a σ between grid points it is interpolated in log σ (k-diffusion's
    `DiscreteSchedule.sigma_to_t`), or, with `interpolation="linear"`, linearly in σ: the inverse of
    diffusers' `EulerDiscreteScheduler`, whose σ at a fractional t is `np.interp(t, range(T), σ)`.
    `round_time` rounds that t to the nearest integer (diffusers' `DPMSolverMultistepScheduler` feeds a
    Karras σ's t rounded).
    """

    # A tuple, not an array: static fields must be hashable for jit's cache.
    alphas_cumprod: tuple[float, ...] = eqx.field(static=True, converter=lambda a: tuple(map(float, a)))
    interpolation: str = eqx.field(static=True, default="log")
    round_time: bool = eqx.field(static=True, default=False)

    @classmethod
    def linear(cls, num_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02) -> "VPSchedule":
        return cls.from_betas(linear_betas(num_timesteps, beta_start, beta_end))

    @classmethod
    def cosine(cls, num_timesteps: int = 1000, s: float = 0.008) -> "VPSchedule":
        return cls.from_betas(cosine_betas(num_timesteps, s))

    @classmethod
    def from_betas(cls, betas: np.ndarray) -> "VPSchedule":
        return cls(np.cumprod(1.0 - np.asarray(betas, np.float64)))

    def __check_init__(self):
        a = np.asarray(self.alphas_cumprod)
        if a.size < 2 or not np.all(np.diff(a) < 0) or not (0 < a[-1] and a[0] < 1):
            raise ValueError("VPSchedule needs a strictly decreasing alphas_cumprod inside (0, 1).")
        if self.interpolation not in ("log", "linear"):
            raise ValueError(f"VPSchedule interpolation {self.interpolation!r}: choose 'log' (in log σ) or 'linear'.")

    @property
    def num_timesteps(self) -> int:
        return len(self.alphas_cumprod)

    @property
    def sigmas(self) -> np.ndarray:
        """σ of every discrete timestep, increasing, float64, shape (T,)."""
        a = np.asarray(self.alphas_cumprod)
        return np.sqrt((1.0 - a) / a)

    @property
    def sigma_min(self) -> float:
        return float(self.sigmas[0])

    @property
    def sigma_max(self) -> float:
        return float(self.sigmas[-1])

    def sample_sigma(self, key: PRNGKeyArray, shape: tuple[int, ...], dtype=jnp.float32) -> Float[Array, "..."]:
        t = jax.random.randint(key, shape, 0, self.num_timesteps)
        return jnp.asarray(self.sigmas, dtype)[t]

    def sigma_to_t(self, sigma: Float[Array, "*s"]) -> Float[Array, "*s"]:
        steps = jnp.arange(self.num_timesteps, dtype=sigma.dtype)
        if self.interpolation == "linear":
            t = jnp.interp(sigma, jnp.asarray(self.sigmas, sigma.dtype), steps)
        else:
            t = jnp.interp(jnp.log(sigma), jnp.log(jnp.asarray(self.sigmas, sigma.dtype)), steps)
        return jnp.round(t) if self.round_time else t

    def t_to_sigma(self, t: Float[Array, "*s"]) -> Float[Array, "*s"]:
        steps = jnp.arange(self.num_timesteps, dtype=t.dtype)
        if self.interpolation == "linear":
            return jnp.interp(t, steps, jnp.asarray(self.sigmas, t.dtype))
        return jnp.exp(jnp.interp(t, steps, jnp.log(jnp.asarray(self.sigmas, t.dtype))))

    def scale(self, sigma: Float[Array, "*s"]) -> Float[Array, "*s"]:
        return jax.lax.rsqrt(1.0 + sigma**2)


class EDMSchedule(eqx.Module):
    """Karras et al. 2022 ("EDM"): a VE process (s = 1) with log-normal training σ,
    ln σ ~ N(P_mean, P_std²) (Table 1). The network time is c_noise = ln(σ)/4.

    The defaults are EDM's for images in [-1, 1] (data std σ_data = 0.5). σ_data itself lives in
    the preconditioning (`EDMPreconditioning(sigma_data)`, train/main.py's `--sigma_data`): VAE
    latents multiplied by their `scaling_factor` have std ≈ 1, so latent runs set it to 1.0."""

    p_mean: float = eqx.field(static=True, default=-1.2)
    p_std: float = eqx.field(static=True, default=1.2)
    sigma_min: float = eqx.field(static=True, default=0.002)
    sigma_max: float = eqx.field(static=True, default=80.0)

    def sample_sigma(self, key: PRNGKeyArray, shape: tuple[int, ...], dtype=jnp.float32) -> Float[Array, "..."]:
        return jnp.exp(self.p_mean + self.p_std * jax.random.normal(key, shape, dtype))

    def sigma_to_t(self, sigma: Float[Array, "*s"]) -> Float[Array, "*s"]:
        return jnp.log(sigma) / 4

    def t_to_sigma(self, t: Float[Array, "*s"]) -> Float[Array, "*s"]:
        return jnp.exp(4 * t)

    def scale(self, sigma: Float[Array, "*s"]) -> Float[Array, "*s"]:
        return jnp.ones_like(sigma)


class FlowSchedule(eqx.Module):
    """Rectified flow / flow matching: x_t = (1 - t)·x0 + t·ε (Liu et al. 2022; Lipman et al. 2022).

    In σ-space σ = t/(1 - t) and s = 1 - t = 1/(1 + σ). Training t is logit-normal,
    logit(t) ~ N(mean, std²) (Esser et al. 2024, "SD3", §3.1). The network time is 1000·t,
    the scale SD3 uses, so sinusoidal embeddings resolve it.
    """

    logit_mean: float = eqx.field(static=True, default=0.0)
    logit_std: float = eqx.field(static=True, default=1.0)
    t_min: float = eqx.field(static=True, default=1e-3)
    t_max: float = eqx.field(static=True, default=1.0 - 1e-3)

    @property
    def sigma_min(self) -> float:
        return self.t_min / (1 - self.t_min)

    @property
    def sigma_max(self) -> float:
        return self.t_max / (1 - self.t_max)

    def sample_sigma(self, key: PRNGKeyArray, shape: tuple[int, ...], dtype=jnp.float32) -> Float[Array, "..."]:
        t = jax.nn.sigmoid(self.logit_mean + self.logit_std * jax.random.normal(key, shape, dtype))
        t = jnp.clip(t, self.t_min, self.t_max)  # keep σ finite and positive
        return t / (1 - t)

    def sigma_to_t(self, sigma: Float[Array, "*s"]) -> Float[Array, "*s"]:
        return 1000 * sigma / (1 + sigma)

    def t_to_sigma(self, t: Float[Array, "*s"]) -> Float[Array, "*s"]:
        u = t / 1000
        return u / (1 - u)

    def scale(self, sigma: Float[Array, "*s"]) -> Float[Array, "*s"]:
        return 1 / (1 + sigma)


Schedule = VPSchedule | EDMSchedule | FlowSchedule

SCHEDULES = {
    "vp_linear": VPSchedule.linear,
    "vp_cosine": VPSchedule.cosine,
    "edm": EDMSchedule,
    "flow": FlowSchedule,
}


def schedule_by_name(name: str) -> Schedule:
    """The schedule a CLI name stands for; an unknown name lists the valid ones."""
    if name not in SCHEDULES:
        raise ValueError(f"Unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}.")
    return SCHEDULES[name]()


__all__ = [
    "VPSchedule",
    "EDMSchedule",
    "FlowSchedule",
    "Schedule",
    "SCHEDULES",
    "schedule_by_name",
    "linear_betas",
    "cosine_betas",
    "cosine_alpha_bar",
]
