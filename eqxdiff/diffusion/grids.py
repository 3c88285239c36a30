"""Decreasing σ grids for samplers: n steps give n+1 levels, the last one 0.

Grids are host constants (float64 numpy); `sample` casts them to the data's dtype.
"""

import numpy as np
from jaxtyping import Float

from .schedules import VPSchedule

SPACINGS = ("leading", "trailing", "linspace")


def _check_steps(n: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"A σ grid needs n >= 1 steps, got {n!r}.")


def karras_sigmas(
    n: int, sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0
) -> Float[np.ndarray, " n_plus_1"]:
    """σ_i = (σ_max^(1/ρ) + i/(n-1)·(σ_min^(1/ρ) - σ_max^(1/ρ)))^ρ for i < n, then σ_n = 0
    (Karras et al. 2022, eq. 5). Shape (n+1,), decreasing."""
    _check_steps(n)
    if not 0 < sigma_min < sigma_max:
        raise ValueError(f"Need 0 < sigma_min < sigma_max, got {sigma_min}, {sigma_max}.")
    ramp = np.linspace(0.0, 1.0, n)
    inv_rho_min, inv_rho_max = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    sigmas = (inv_rho_max + ramp * (inv_rho_min - inv_rho_max)) ** rho
    return np.append(sigmas, 0.0)


def flow_time_sigmas(n: int, sigma_max: float) -> Float[np.ndarray, " n_plus_1"]:
    """n steps uniform in flow time t = σ/(1 + σ), from σ_max's t down to 0 (MeanFlow's sampling grid, t from 1 in
    the official code; σ-space holds t < 1 only, FlowSchedule's t_max = 0.999). Shape (n+1,), decreasing, last 0."""
    _check_steps(n)
    if not sigma_max > 0:
        raise ValueError(f"Need sigma_max > 0, got {sigma_max}.")
    t = np.linspace(sigma_max / (1 + sigma_max), 0.0, n + 1)
    return t / (1 - t)


def logsnr_sigmas(n: int, sigma_min: float = 0.002, sigma_max: float = 80.0) -> Float[np.ndarray, " n_plus_1"]:
    """Uniform in log-SNR λ = -2 ln σ between σ_max and σ_min, then 0. Shape (n+1,)."""
    _check_steps(n)
    if not 0 < sigma_min < sigma_max:
        raise ValueError(f"Need 0 < sigma_min < sigma_max, got {sigma_min}, {sigma_max}.")
    return np.append(np.exp(np.linspace(np.log(sigma_max), np.log(sigma_min), n)), 0.0)


def vp_timesteps(num_train_timesteps: int, n: int, spacing: str = "leading") -> np.ndarray:
    """The n timesteps a VP sampler visits, decreasing, as diffusers' schedulers define them
    (`timestep_spacing`, steps_offset 0; Lin et al. 2023, Table 2)."""
    _check_steps(n)
    T = num_train_timesteps
    if n > T:
        raise ValueError(f"Cannot take {n} steps on a schedule of {T} timesteps.")
    if spacing == "linspace":
        t = np.linspace(0, T - 1, n).round()[::-1]
    elif spacing == "leading":
        t = (np.arange(0, n) * (T // n)).round()[::-1]
    elif spacing == "trailing":
        t = np.round(np.arange(T, 0, -T / n)) - 1
    else:
        raise ValueError(f"Unknown spacing {spacing!r}; choose one of {SPACINGS}.")
    return t.astype(np.int64)


def vp_sigmas(schedule: VPSchedule, n: int, spacing: str = "leading") -> Float[np.ndarray, " n_plus_1"]:
    """σ at the schedule's own timesteps (see `vp_timesteps`), then 0. Shape (n+1,)."""
    return np.append(schedule.sigmas[vp_timesteps(schedule.num_timesteps, n, spacing)], 0.0)


def spaced_timesteps(num_timesteps: int, section_counts: int | str) -> np.ndarray:
    """The timesteps iDDPM's respacing keeps, increasing (Nichol & Dhariwal 2021, §4; `space_timesteps` of
    openai/improved-diffusion, as ADM and DiT use it). `"ddimN"`: the one integer stride giving exactly N steps,
    range(0, T, stride) (Song et al. 2021); `N` or `"N1,N2,..."`: the T steps cut into equal sections (the first
    T mod k one longer), section i giving Ni steps at a fractional stride, rounded as Python's round does."""
    T = num_timesteps
    spec = str(section_counts)
    if spec.startswith("ddim"):
        count = spec[len("ddim") :]
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"Respacing {spec!r}: write 'ddimN' with N >= 1 steps, e.g. 'ddim50'.")
        for stride in range(1, T):
            if len(range(0, T, stride)) == int(count):
                return np.arange(0, T, stride)
        raise ValueError(
            f"Respacing {spec!r}: no stride gives exactly {count} steps as range(0, {T}, stride); "
            f"'{count}' spaces {count} steps evenly instead."
        )
    try:
        counts = [int(c) for c in spec.split(",")]
    except ValueError:
        message = f"Respacing {spec!r}: give a step count ('250'), section counts ('10,15,20') or 'ddimN'."
        raise ValueError(message) from None
    size_per, extra = divmod(T, len(counts))
    start, kept = 0, []
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        if not 1 <= count <= size:
            raise ValueError(
                f"Respacing {spec!r}: section {i} has {size} of the {T} timesteps; {count} steps "
                f"must be between 1 and {size}."
            )
        stride = 1 if count == 1 else (size - 1) / (count - 1)
        position = 0.0  # accumulated in float64 as the reference does: its rounding decides the ties
        for _ in range(count):
            kept.append(start + round(position))
            position += stride
        start += size
    return np.array(sorted(set(kept)), dtype=np.int64)


def spaced_sigmas(schedule: VPSchedule, section_counts: int | str) -> Float[np.ndarray, " n_plus_1"]:
    """σ at the kept timesteps of `spaced_timesteps`, decreasing, then 0. Shape (n+1,). A respaced
    process's β_i = 1 - ᾱ_i/ᾱ_(i-1) over the kept ᾱ's is what any VP step computes from two adjacent σ's."""
    return np.append(schedule.sigmas[spaced_timesteps(schedule.num_timesteps, section_counts)[::-1]], 0.0)
