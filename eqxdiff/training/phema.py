"""Power-function EMA and its post-hoc reconstruction (Karras et al. 2024, "Analyzing and Improving the
Training Dynamics of Diffusion Models", §3 and Appendix C), written from the paper's equations.

A power-function EMA at step t averages the weights θ_τ of steps τ <= t with the profile
p(τ) = (γ+1) τ^γ / t^(γ+1): its width relative to t is σ_rel = sqrt((γ+1) / ((γ+2)² (γ+3))). Training
tracks a few profiles with the per-step decay β_t = (1 - 1/t)^(γ+1) (t = 1, 2, ...: step t's update,
β_1 = 0) and writes their snapshots; any other profile at a snapshot's step is then the least-squares
combination of the snapshots' profiles (`posthoc_coefficients`), in float64 on the host.
"""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

# γ -> 0 (a uniform average over [0, t]) is the widest profile with γ >= 0: σ_rel = sqrt(1/12).
MAX_SIGMA_REL = float(np.sqrt(1 / 12))


def gamma_to_sigma_rel(gamma: float) -> float:
    """σ_rel of the profile (γ+1) τ^γ / t^(γ+1): its standard deviation over τ divided by t."""
    return float(np.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3))))


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The exponent γ >= 0 whose profile has relative width `sigma_rel` (0 < σ_rel < sqrt(1/12)):
    σ_rel⁻² (γ+1) = (γ+2)² (γ+3) is the cubic γ³ + 7γ² + (16 - σ_rel⁻²) γ + (12 - σ_rel⁻²) = 0,
    whose largest real root it is."""
    if not 0 < sigma_rel < MAX_SIGMA_REL:
        raise ValueError(f"sigma_rel must be in (0, {MAX_SIGMA_REL:.4f}) (sqrt(1/12): γ = 0), got {sigma_rel}")
    s = float(sigma_rel) ** -2
    roots = np.roots([1.0, 7.0, 16.0 - s, 12.0 - s])
    return float(roots[np.abs(roots.imag) < 1e-9].real.max())


def parse_sigma_rels(text: str) -> tuple[float, ...]:
    """ "0.05,0.10" -> (0.05, 0.1); "" -> (); each checked by `sigma_rel_to_gamma` (ValueError)."""
    values = tuple(float(v) for v in text.split(",") if v.strip())
    for v in values:
        sigma_rel_to_gamma(v)
    return values


def one_minus_beta(gamma: float, t: Int[Array, ""] | Float[Array, ""]) -> Float[Array, ""]:
    """1 - β_t = 1 - (1 - 1/t)^(γ+1), by log1p/expm1: in float32 `1 - 1/t` rounds off a growing part of
    1/t as t grows (t = 1e6: 1.3% of it, 3e6: 7%)."""
    t = jnp.asarray(t, jnp.float32)
    return -jnp.expm1((gamma + 1) * jnp.log1p(-1 / t))


def update_power_emas(emas: tuple, model: eqx.Module, gammas: Sequence[float], t: Int[Array, ""]) -> tuple:
    """Each EMA of `emas` (a module shaped like `model`) moved to `model` by its profile's step-t update:
    ema + (1 - β_t) (θ - ema); the non-parameter leaves stay the EMA's."""
    params = eqx.filter(model, eqx.is_inexact_array)
    out = []
    for ema, gamma in zip(emas, gammas, strict=True):
        w = one_minus_beta(gamma, t)
        moved = jax.tree.map(
            lambda e, p: e + (w * (p - e)).astype(e.dtype), eqx.filter(ema, eqx.is_inexact_array), params
        )
        out.append(eqx.combine(moved, ema))
    return tuple(out)


def profile_inner_products(t_a, gamma_a, t_b, gamma_b) -> np.ndarray:
    """∫₀^∞ p_a(τ) p_b(τ) dτ of the profiles p(τ) = (γ+1) τ^γ / t^(γ+1) on [0, t] (zero after), broadcast:
    (γa+1)(γb+1)/(γa+γb+1) · m^(γa+γb+1) / (t_a^(γa+1) t_b^(γb+1)), m = min(t_a, t_b), written with the
    ratios m/t (t^γ alone overflows float64 for large t and γ)."""
    t_a, gamma_a, t_b, gamma_b = (np.asarray(x, np.float64) for x in (t_a, gamma_a, t_b, gamma_b))
    m = np.minimum(t_a, t_b)
    scale = (gamma_a + 1) * (gamma_b + 1) / (gamma_a + gamma_b + 1)
    return np.asarray(scale * (m / t_a) ** (gamma_a + 1) * (m / t_b) ** (gamma_b + 1) / m)


def posthoc_coefficients(
    snapshot_steps: Sequence[int], snapshot_sigma_rels: Sequence[float], step: int, sigma_rels: Sequence[float]
) -> np.ndarray:
    """[snapshots, outputs] float64 weights: output k = Σ_i w[i, k] · snapshot i is the least-squares
    fit (over τ, in L²) of the profile of `sigma_rels[k]` at `step` by the snapshots' profiles (snapshot
    i: its EMA of `snapshot_sigma_rels[i]` at `snapshot_steps[i]`), rescaled to sum to 1. Normal
    equations: A w = b with A[i, j] = <p_i, p_j>, b[i, k] = <p_i, q_k>."""
    t_in = np.asarray(snapshot_steps, np.float64)[:, None]
    g_in = np.asarray([sigma_rel_to_gamma(s) for s in snapshot_sigma_rels], np.float64)[:, None]
    g_out = np.asarray([sigma_rel_to_gamma(s) for s in sigma_rels], np.float64)[None, :]
    gram = profile_inner_products(t_in, g_in, t_in.T, g_in.T)
    target = profile_inner_products(t_in, g_in, np.float64(step), g_out)
    weights = np.linalg.solve(gram, target)
    return weights / weights.sum(axis=0, keepdims=True)
