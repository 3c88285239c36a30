"""A diffusers `scheduler/scheduler_config.json` in eqxdiff's σ-space: the schedule, the parameterization and the
σ grid its scheduler class steps on, sampled by eqxdiff's own samplers (`eqxdiff.diffusion.sample`).

What maps onto what (diffusers' name -> eqxdiff's):
- `beta_schedule` "linear" / "scaled_linear" / "squaredcos_cap_v2" (or `trained_betas`), `beta_start`, `beta_end`,
  `num_train_timesteps`, `rescale_betas_zero_snr` -> `VPSchedule` with diffusers' float32 ᾱ. Zero terminal SNR
  makes ᾱ_T = 0, σ_T = ∞, which x = x0 + σ·ε cannot hold: the schedule's ᾱ_T is 2**-24 (σ_T ≈ 4096), as
  diffusers' Euler, Euler ancestral and DPM-Solver set it (an Euler step x + (σ_next - σ)·slope loses σ·2**-24
  absolutely, so a larger σ_T would cost precision). diffusers' DDIM keeps ᾱ_T = 0 (its first D is exactly -v):
  DDIM's grid starts at σ = 2**20 (ᾱ = 2**-40) instead, which eqxdiff's ddim, written in VP coordinates, steps
  from without loss; 2**-24 there would put 2**-12·x_t into that D (2.6e-5 relative on the test's latents).
- `prediction_type` "epsilon" / "v_prediction" / "sample" -> `EpsilonPrediction` / `VPrediction` / `DataPrediction`;
  `scale_model_input` (Euler's x/sqrt(σ²+1)) and DDIM/DPM's x_t = sqrt(ᾱ)·x are both c_in = `schedule.scale(σ)`.
- The scheduler's timesteps (`timestep_spacing`, `steps_offset`, DPM's `lambda_min_clipped`) and σ's
  (`use_karras_sigmas`, `sigma_min`/`sigma_max`, `interpolation_type`, `final_sigmas_type`, DDIM's
  `set_alpha_to_one`) -> `DiffusersScheduler.sigmas(n)`; the network's t is `schedule.sigma_to_t(σ)` (linear in
  σ for Euler's interpolated timesteps, rounded for DPM's Karras ones), equal to the `t` diffusers feeds.
- DDIMScheduler -> "ddim" (with `sigmas_to` where diffusers steps to t - T//n), EulerDiscreteScheduler -> "euler",
  EulerAncestralDiscreteScheduler -> "euler_ancestral", DPMSolverMultistepScheduler (dpmsolver++, order 2,
  midpoint) -> "dpmpp_2m". PNDMScheduler (SD 1.5's config) maps as `DDIMScheduler.from_config(its config)` does,
  to "ddim" on its leading grid: PNDM's own PLMS/PRK steps are not ported.
- `init_noise_sigma` and the latents a pipeline returns -> `initial_x` and `latents` (DDIM/DPM carry x_t, Euler x).
"""

import json
import math
from pathlib import Path

import equinox as eqx
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.diffusion import (
    DataPrediction,
    EpsilonPrediction,
    Parameterization,
    VPrediction,
    VPSchedule,
    karras_sigmas,
    sample,
)
from eqxdiff.diffusion.samplers import DenoiseFn

# a diffusers scheduler class -> the eqxdiff sampler (`eqxdiff.diffusion.METHODS`) that steps as it does
METHOD_OF_SCHEDULER = {
    "DDIMScheduler": "ddim",
    "PNDMScheduler": "ddim",
    "EulerDiscreteScheduler": "euler",
    "EulerAncestralDiscreteScheduler": "euler_ancestral",
    "DPMSolverMultistepScheduler": "dpmpp_2m",
}
DEFAULT_SPACING = {
    "DDIMScheduler": "leading",
    "PNDMScheduler": "leading",
    "EulerDiscreteScheduler": "linspace",
    "EulerAncestralDiscreteScheduler": "linspace",
    "DPMSolverMultistepScheduler": "linspace",
}
PARAMETERIZATIONS = {"epsilon": EpsilonPrediction, "v_prediction": VPrediction, "sample": DataPrediction}
ZERO_SNR_ALPHA_BAR = 2.0**-24  # diffusers' Euler/DPM stand-in for ᾱ_T = 0
DDIM_ZERO_SNR_SIGMA = 2.0**20  # DDIM's: ᾱ = 2**-40, where its VP-coordinate step equals the ᾱ = 0 one in float32

# key: (the value this mapping reproduces, what it refuses otherwise); a key absent from a config takes its class's
# default, which is the supported value for every one listed here but DDIM's clip_sample (True).
FIXED = {
    "thresholding": (False, "dynamic thresholding is not ported"),
    "clip_sample": (False, "x0 clipping is not ported (Stable Diffusion's configs set it false)"),
    "timestep_type": ("discrete", "continuous EDM-style timesteps are not ported"),
    "use_exponential_sigmas": (False, "only Karras σ's are ported"),
    "use_beta_sigmas": (False, "only Karras σ's are ported"),
    "use_lu_lambdas": (False, "only Karras σ's are ported"),
    "use_flow_sigmas": (False, "flow-matching σ's are not this scheduler's"),
    "use_dynamic_shifting": (False, "flow-matching shifts are not this scheduler's"),
    "variance_type": (None, "a learned variance is sampled by eqxdiff's ddpm_learned_variance instead"),
    "algorithm_type": ("dpmsolver++", "eqxdiff's dpmpp_2m is DPM-Solver++ (data prediction)"),
    "solver_order": (2, "eqxdiff's dpmpp_2m is second order"),
    "solver_type": ("midpoint", "eqxdiff's dpmpp_2m is the midpoint form"),
    "interpolation_type": ("linear", "diffusers' 'log_linear' gives n+2 σ's for n timesteps"),
}


def _refuse(key: str, value, why: str) -> ValueError:
    return ValueError(f"scheduler config {key}={value!r} is not supported: {why}.")


def _torch_linspace(start: float, end: float, n: int) -> np.ndarray:
    """torch.linspace in float32 on CPU: a float32 step, start + step·i (end - step·(n-1-i) past halfway) rounded
    once (a fused multiply-add, emulated in float64)."""
    start32, end32 = np.float32(start), np.float32(end)
    step, i = float((end32 - start32) / np.float32(max(n - 1, 1))), np.arange(n)
    return np.where(i < n // 2, float(start32) + step * i, float(end32) - step * (n - 1 - i)).astype(np.float32)


def _torch_cumprod(a: np.ndarray) -> np.ndarray:
    """torch.cumprod of a float32 tensor on CPU: accumulated in float64, each product rounded to float32."""
    return np.cumprod(a.astype(np.float64)).astype(np.float32).astype(np.float64)


def diffusers_alphas_cumprod(config: dict) -> np.ndarray:
    """ᾱ as diffusers' schedulers compute it: float32 β's, `rescale_zero_terminal_snr` (Lin et al. 2023, Alg. 1)
    in float32, torch's cumulative product. Float64 copy of those float32 values, shape (T,); ᾱ_T = 0 kept."""
    T = config.get("num_train_timesteps", 1000)
    start, end = config.get("beta_start", 1e-4), config.get("beta_end", 0.02)
    kind = config.get("beta_schedule", "linear")
    if config.get("trained_betas") is not None:
        betas = np.asarray(config["trained_betas"], np.float64)
    elif kind == "linear":
        betas = _torch_linspace(start, end, T)
    elif kind == "scaled_linear":
        betas = _torch_linspace(start**0.5, end**0.5, T) ** 2
    elif kind == "squaredcos_cap_v2":
        f = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
        betas = np.array([min(1 - f((i + 1) / T) / f(i / T), 0.999) for i in range(T)])
    else:
        raise _refuse("beta_schedule", kind, "choose 'linear', 'scaled_linear' or 'squaredcos_cap_v2'")
    betas = betas.astype(np.float32)
    if config.get("rescale_betas_zero_snr", False):
        root = np.sqrt(_torch_cumprod(1 - betas).astype(np.float32))
        root = (root - root[-1]) * (root[0] / (root[0] - root[-1]))
        alpha_bar = root**2
        betas = 1 - np.concatenate([alpha_bar[:1], alpha_bar[1:] / alpha_bar[:-1]])
    return _torch_cumprod(1 - betas)


class DiffusersScheduler(eqx.Module):
    """A diffusers scheduler config as eqxdiff objects: `schedule` and `parameterization` make the denoiser
    (`Denoiser(unet, schedule, parameterization)`), `sigmas(n)` the grid, `method` and `options(n)` the sampler.
    Fields are the config's values after its class's defaults."""

    class_name: str = eqx.field(static=True)
    schedule: VPSchedule
    parameterization: Parameterization
    method: str = eqx.field(static=True)
    spacing: str = eqx.field(static=True)
    steps_offset: int = eqx.field(static=True)
    karras: bool = eqx.field(static=True)
    karras_range: tuple = eqx.field(static=True)  # Euler's config sigma_min, sigma_max (None: from the grid)
    final_sigma: float = eqx.field(static=True)  # the σ after the last step: 0, or σ at t = 0 ("sigma_min")
    lower_order_final: bool = eqx.field(static=True)
    euler_at_final: bool = eqx.field(static=True)
    last_timestep: int = eqx.field(static=True)  # DPM's T minus its lambda_min_clipped cut
    zero_snr: bool = eqx.field(static=True)  # rescale_betas_zero_snr: ᾱ_T = 0 in diffusers

    @property
    def num_train_timesteps(self) -> int:
        return self.schedule.num_timesteps

    def timesteps(self, n: int) -> np.ndarray:
        """The n timesteps diffusers' `set_timesteps(n)` makes before any σ conversion, decreasing, float64."""
        T, off = self.num_train_timesteps, self.steps_offset
        if not isinstance(n, int) or not 1 <= n <= T:
            raise ValueError(f"steps must be an integer from 1 to num_train_timesteps={T}, got {n!r}.")
        if self.class_name == "DPMSolverMultistepScheduler":  # n+1 points, the last (0) dropped
            last = self.last_timestep
            if self.spacing == "linspace":
                return np.linspace(0, last - 1, n + 1).round()[::-1][:-1]
            if self.spacing == "leading":
                return (np.arange(0, n + 1) * (last // (n + 1))).round()[::-1][:-1] + off
            return np.arange(last, 0, -T / n).round() - 1
        if self.spacing == "linspace":
            if self.method in ("euler", "euler_ancestral"):  # fractional: σ interpolated between timesteps
                return np.linspace(0, T - 1, n, dtype=np.float32)[::-1].astype(np.float64)
            return np.linspace(0, T - 1, n).round()[::-1]
        if self.spacing == "leading":
            return (np.arange(0, n) * (T // n)).round()[::-1] + off
        return np.round(np.arange(T, 0, -T / n)) - 1

    def sigmas(self, n: int) -> Float[np.ndarray, " n_plus_1"]:
        """The decreasing σ grid diffusers' scheduler steps on after `set_timesteps(n)`, then its final σ."""
        t = self.timesteps(n)
        table = self.schedule.sigmas
        sigmas = np.interp(t, np.arange(len(table)), table)
        if self.karras:
            low, high = self.karras_range
            if self.class_name == "DPMSolverMultistepScheduler":  # DPM's range is the whole table's
                low, high = table[0], table[-1]
            low, high = sigmas[-1] if low is None else low, sigmas[0] if high is None else high
            sigmas = karras_sigmas(n, low, high)[:-1]
        if self.zero_snr and self.method == "ddim":
            sigmas = np.where(t == self.num_train_timesteps - 1, DDIM_ZERO_SNR_SIGMA, sigmas)
        return np.append(sigmas, self._ddim_landing(n)[-1] if self.method == "ddim" else self.final_sigma)

    def _ddim_landing(self, n: int) -> np.ndarray:
        """The σ each DDIM step lands on: diffusers steps from t to t - T//n, below 0 to the final ᾱ."""
        to = self.timesteps(n) - self.num_train_timesteps // n
        return np.where(to >= 0, self.schedule.sigmas[np.maximum(to, 0).astype(int)], self.final_sigma)

    def options(self, n: int) -> dict:
        """The sampler options that make `method` step as the scheduler class does on `sigmas(n)`."""
        if self.method == "ddim":
            return dict(sigmas_to=self._ddim_landing(n))
        if self.method == "dpmpp_2m":
            lower = self.euler_at_final or (self.lower_order_final and n < 15)
            return dict(first_order_last=lower and self.final_sigma > 0)
        return {}

    def initial_x(self, noise: Float[Array, "b *dims"], sigmas: np.ndarray) -> Float[Array, "b *dims"]:
        """x = x0 + σ·ε at sigmas[0] from a pipeline's unit latents: diffusers scales them by `init_noise_sigma`
        (Euler: σ_0 for linspace/trailing, sqrt(σ_0² + 1) for leading) or takes them as x_t (DDIM, DPM)."""
        if self.method in ("euler", "euler_ancestral") and self.spacing != "leading":
            return noise * np.float32(sigmas[0])
        return noise * np.float32(np.sqrt(1 + sigmas[0] ** 2))

    def latents(self, x: Float[Array, "b *dims"], sigmas: np.ndarray) -> Float[Array, "b *dims"]:
        """What diffusers' loop returns for the final x: x itself (Euler), x_t = sqrt(ᾱ)·x (DDIM, DPM)."""
        if self.method in ("euler", "euler_ancestral"):
            return x
        return x * np.float32(1 / np.sqrt(1 + sigmas[-1] ** 2))

    def sample(
        self,
        denoise: DenoiseFn,
        noise: Float[Array, "b *dims"],
        steps: int,
        key: PRNGKeyArray | None = None,
        **options,
    ) -> Float[Array, "b *dims"]:
        """A pipeline's latents from its unit `noise`, `steps` steps of this scheduler with eqxdiff's sampler;
        `options` over the mapped ones (e.g. euler_ancestral's `noises`)."""
        sigmas = self.sigmas(steps)
        options = {**self.options(steps), **options}
        x = sample(denoise, self.initial_x(noise, sigmas), sigmas, self.method, key, **options)
        return self.latents(x, sigmas)


def _read_config(folder_or_config) -> dict:
    if isinstance(folder_or_config, dict):
        return dict(folder_or_config)
    path = Path(folder_or_config).expanduser()
    for candidate in (path / "scheduler" / "scheduler_config.json", path / "scheduler_config.json", path):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    raise FileNotFoundError(
        f"No scheduler config at {path}: give a pipeline folder (scheduler/scheduler_config.json), "
        "its scheduler/ folder or the json file."
    )


def scheduler_from_diffusers(folder_or_config: str | Path | dict) -> DiffusersScheduler:
    """A diffusers scheduler config (a pipeline folder, its `scheduler/` folder, the json file or the dict) as a
    `DiffusersScheduler`; a value this mapping does not reproduce is refused naming its key."""
    config = _read_config(folder_or_config)
    name = config.get("_class_name")
    if name not in METHOD_OF_SCHEDULER:
        raise _refuse("_class_name", name, f"choose one of {sorted(METHOD_OF_SCHEDULER)}")
    defaults = dict(clip_sample=name == "DDIMScheduler")
    for key, (value, why) in FIXED.items():
        if config.get(key, defaults.get(key, value)) != value:
            raise _refuse(key, config[key] if key in config else defaults[key], why)
    prediction = config.get("prediction_type", "epsilon")
    if prediction not in PARAMETERIZATIONS:
        raise _refuse("prediction_type", prediction, f"choose one of {sorted(PARAMETERIZATIONS)}")
    spacing = config.get("timestep_spacing", DEFAULT_SPACING[name])
    if spacing not in ("leading", "trailing", "linspace"):
        raise _refuse("timestep_spacing", spacing, "choose 'leading', 'trailing' or 'linspace'")
    final = config.get("final_sigmas_type", "zero")
    if final not in ("zero", "sigma_min") or (
        final != "zero" and name not in ("EulerDiscreteScheduler", "DPMSolverMultistepScheduler")
    ):
        raise _refuse("final_sigmas_type", final, "'zero', or 'sigma_min' for Euler and DPM-Solver")
    karras = bool(config.get("use_karras_sigmas", False))
    if karras and name not in ("EulerDiscreteScheduler", "DPMSolverMultistepScheduler"):
        raise _refuse("use_karras_sigmas", True, f"{name} has no Karras σ's")
    if karras and name == "DPMSolverMultistepScheduler" and config.get("beta_schedule") == "squaredcos_cap_v2":
        raise _refuse(
            "use_karras_sigmas", True, "DPM-Solver truncates squaredcos_cap_v2's Karras timesteps to repeated integers"
        )

    alpha_bar = diffusers_alphas_cumprod(config)
    if alpha_bar[-1] == 0:
        alpha_bar[-1] = ZERO_SNR_ALPHA_BAR
    interpolation = "linear" if name.startswith("Euler") and not karras else "log"
    round_time = name == "DPMSolverMultistepScheduler" and karras
    schedule = VPSchedule(alpha_bar, interpolation=interpolation, round_time=round_time)
    table = schedule.sigmas
    if name in ("DDIMScheduler", "PNDMScheduler"):
        final_sigma = 0.0 if config.get("set_alpha_to_one", True) else float(table[0])
    else:
        final_sigma = 0.0 if final == "zero" else float(table[0])
    lambda_min = config.get("lambda_min_clipped", -math.inf)
    lambdas = np.log(np.sqrt(alpha_bar.astype(np.float32))) - np.log(np.sqrt(1 - alpha_bar.astype(np.float32)))
    last_timestep = len(table) - int(np.searchsorted(lambdas[::-1], lambda_min))
    euler = name == "EulerDiscreteScheduler"  # only Euler reads sigma_min/sigma_max; DPM's Karras range is its table's
    sigma_range = (config.get("sigma_min"), config.get("sigma_max")) if euler else (None, None)
    return DiffusersScheduler(
        class_name=name,
        schedule=schedule,
        parameterization=PARAMETERIZATIONS[prediction](),
        method=METHOD_OF_SCHEDULER[name],
        spacing=spacing,
        steps_offset=int(config.get("steps_offset", 0)),
        karras=karras,
        karras_range=sigma_range,
        final_sigma=final_sigma,
        lower_order_final=bool(config.get("lower_order_final", True)),
        euler_at_final=bool(config.get("euler_at_final", False)),
        last_timestep=last_timestep,
        zero_snr=bool(config.get("rescale_betas_zero_snr", False)),
    )


__all__ = ["DiffusersScheduler", "diffusers_alphas_cumprod", "scheduler_from_diffusers"]
