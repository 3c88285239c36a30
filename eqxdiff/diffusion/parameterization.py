"""Parameterizations: how the raw network output F becomes a denoiser D(x; σ) ≈ E[x0 | x].

All are written in the preconditioned form of Karras et al. 2022 (eq. 7, Table 1):

    D(x; σ) = c_skip(σ)·x + c_out(σ)·F(c_in(σ)·x, c_noise(σ))

with x = x0 + σ·ε the unscaled noisy sample. `c_in` defaults to the schedule's scale s(σ)
(so the network sees the process's own x_t) and `c_noise` is the schedule's time. The
regression target of F is (x0 - c_skip·x)/c_out, and the loss weight that makes the plain
MSE on F equal a weighted MSE on D is λ(σ) = 1/c_out² (EDM eq. 2 and 8).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .schedules import Schedule

Coefficients = tuple[Array, Array, Array]  # (c_skip, c_out, c_in), each shaped like σ


class EpsilonPrediction(eqx.Module):
    """F predicts ε: D = x - σ·F (Ho et al. 2020)."""

    def coefficients(self, sigma: Float[Array, "*s"], schedule: Schedule) -> Coefficients:
        return jnp.ones_like(sigma), -sigma, schedule.scale(sigma)


class DataPrediction(eqx.Module):
    """F predicts x0 directly: D = F."""

    def coefficients(self, sigma: Float[Array, "*s"], schedule: Schedule) -> Coefficients:
        return jnp.zeros_like(sigma), jnp.ones_like(sigma), schedule.scale(sigma)


class VPrediction(eqx.Module):
    """F predicts v = α·ε - σ_t·x0 with α = 1/sqrt(1+σ²), σ_t = σ/sqrt(1+σ²)
    (Salimans & Ho 2022, §4): D = x/(1+σ²) - σ/sqrt(1+σ²)·F."""

    def coefficients(self, sigma: Float[Array, "*s"], schedule: Schedule) -> Coefficients:
        return 1 / (1 + sigma**2), -sigma * jax.lax.rsqrt(1 + sigma**2), schedule.scale(sigma)


class EDMPreconditioning(eqx.Module):
    """Karras et al. 2022, Table 1: c_skip = σ_d²/(σ²+σ_d²), c_out = σ·σ_d/sqrt(σ²+σ_d²),
    c_in = 1/sqrt(σ²+σ_d²). (c_noise = ln(σ)/4 is `EDMSchedule.sigma_to_t`.)"""

    sigma_data: float = eqx.field(static=True, default=0.5)

    def coefficients(self, sigma: Float[Array, "*s"], schedule: Schedule) -> Coefficients:
        sd2 = self.sigma_data**2
        c_in = jax.lax.rsqrt(sigma**2 + sd2)
        return sd2 / (sigma**2 + sd2), sigma * self.sigma_data * c_in, c_in


class FlowVelocity(eqx.Module):
    """F predicts the flow velocity u = ε - x0 of x_t = (1-t)·x0 + t·ε (Lipman et al. 2022;
    Liu et al. 2022). With t = σ/(1+σ): D = x_t - t·F = x/(1+σ) - σ/(1+σ)·F."""

    def coefficients(self, sigma: Float[Array, "*s"], schedule: Schedule) -> Coefficients:
        return 1 / (1 + sigma), -sigma / (1 + sigma), schedule.scale(sigma)


Parameterization = EpsilonPrediction | DataPrediction | VPrediction | EDMPreconditioning | FlowVelocity

PARAMETERIZATIONS = {
    "eps": EpsilonPrediction,
    "x0": DataPrediction,
    "v": VPrediction,
    "edm": EDMPreconditioning,
    "flow": FlowVelocity,
}


def parameterization_by_name(name: str, sigma_data: float = 0.5) -> Parameterization:
    """The parameterization a CLI name stands for; an unknown name lists the valid ones.
    `sigma_data`, the data's standard deviation, is EDM's (0.5 suits images in [-1, 1]; VAE
    latents multiplied by their `scaling_factor` have std ≈ 1); the others take none."""
    if name not in PARAMETERIZATIONS:
        raise ValueError(f"Unknown parameterization {name!r}; choose one of {sorted(PARAMETERIZATIONS)}.")
    if name == "edm":
        return EDMPreconditioning(sigma_data)
    return PARAMETERIZATIONS[name]()


def loss_weight(
    sigma: Float[Array, "*s"], parameterization: Parameterization, schedule: Schedule
) -> Float[Array, "*s"]:
    """λ(σ) = 1/c_out(σ)²: the weight under which E λ(σ)‖D - x0‖² (EDM eq. 2) equals the
    parameterization's own MSE on F — ε-MSE, v-MSE, EDM's λ = (σ²+σ_d²)/(σ·σ_d)², flow matching."""
    _, c_out, _ = parameterization.coefficients(sigma, schedule)
    return 1 / c_out**2
