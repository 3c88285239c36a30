"""How a run's model is sampled, decided once from flags: `Sampling` (the sampler, its steps, the guidance and the
σ where it applies, autoguidance's scale, a latent decode's tiling) and `Sampling.images`, the one call the scripts
sample through; `run_sampling` makes it from a run's flags and what a script's flags override."""

import dataclasses
from typing import Any

import numpy as np
from jax.sharding import Mesh

from eqxdiff.diffusion import Parameterization, Schedule
from eqxdiff.generate import generate_images


def parse_interval(text: str) -> tuple[float, float] | None:
    """ "LO,HI" -> (LO, HI), the σ interval (LO, HI] where classifier-free guidance applies; "" -> None (every σ).
    Anything else raises ValueError naming the form."""
    if not text:
        return None
    try:
        lo, hi = (float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--guidance_interval must be LO,HI (two σ, e.g. 0.28,2.9), got {text!r}") from None
    if not 0 <= lo < hi:
        raise ValueError(f"--guidance_interval LO,HI needs 0 <= LO < HI, got {text!r}")
    return lo, hi


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How samples are drawn, whatever model draws them: `steps` of sampler `method` on the Karras grid between
    the schedule's σ_max and σ_min, then 0 (eqxdiff/generate.py's `generate`), guided, decoded by the run's codec."""

    method: str = "heun"  # eqxdiff/diffusion/samplers.py's METHODS
    steps: int = 18
    guidance: float = 1.0  # classifier-free guidance scale (1: none)
    guidance_interval: tuple[float, float] | None = None  # guide only for σ in (lo, hi]; None: at every σ
    guide_scale: float | None = None  # autoguidance (Karras et al. 2024): D_w + S·(D - D_w); None: none
    tiling: str = "auto"  # a latent run's decode, tile by tile: "auto" | "on" | "off"

    def images(
        self,
        model: Any,
        codec: Any,
        schedule: Schedule,
        parameterization: Parameterization,
        sample_shape: tuple[int, ...],
        cond: Any,
        num: int,
        *,
        mesh: Mesh,
        null_cond: Any = None,
        weak_denoiser: Any = None,
        seed: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(`num` images, host float32 `[num, h, w, c]` in about [-1, 1]; the samples as the model drew them,
        `[num, *sample_shape]`) of `model` (the run's EMA) with the run's `codec`, `schedule` and
        `parameterization`, conditioned on `cond` (`num` rows, or None) against `null_cond` (a condition's
        `for_sampling`), from noise `seed`. `weak_denoiser`: autoguidance's weak model, with `guide_scale`.
        Every process calls it alike and gets all the images."""
        if (weak_denoiser is None) != (self.guide_scale is None):
            raise ValueError("Autoguidance needs both a weak_denoiser and Sampling.guide_scale; pass both or neither.")
        return generate_images(
            model,
            codec,
            schedule,
            parameterization,
            cond,
            num,
            sample_shape,
            mesh=mesh,
            steps=self.steps,
            method=self.method,
            guidance=self.guidance,
            null_cond=null_cond,
            guidance_interval=self.guidance_interval,
            weak_denoiser=weak_denoiser,
            guide_scale=1.0 if self.guide_scale is None else self.guide_scale,
            seed=seed,
            tiling=self.tiling,
        )

    def interval_text(self) -> str:
        """The guidance interval as --guidance_interval spells it, "LO,HI"; "" for every σ."""
        return "" if self.guidance_interval is None else "{:g},{:g}".format(*self.guidance_interval)

    def record(self) -> dict:
        """What decides the samples, for a record of how they were made (FID's JSON line, ADM's batch flags): the
        sampler, its steps, the guidance, and the interval and autoguidance scale where set."""
        record = {"method": self.method, "steps": self.steps, "guidance": self.guidance}
        if self.guidance_interval is not None:
            record["guidance_interval"] = self.interval_text()
        if self.guide_scale is not None:
            record["guide_scale"] = self.guide_scale
        return record


def run_sampling(
    flags: Any,
    *,
    method: str | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    interval: str = "",
    guide_scale: float | None = None,
    tiling: str = "auto",
) -> Sampling:
    """A run's sampling: what its flags (`flags`: train/main.py's Config, or a checkpoint's `stored_flags`) say its
    sample grids use, --sample_method, --sample_steps, --guidance, --guidance_interval, with what a script's flags
    override (None or "": the run's). `guide_scale`: autoguidance instead of classifier-free guidance (guidance 1,
    at every σ). A bad interval is a ValueError naming the form."""
    autoguided = guide_scale is not None
    return Sampling(
        method=method or flags.sample_method,
        steps=steps or flags.sample_steps,
        guidance=1.0 if autoguided else flags.guidance if guidance is None else guidance,
        guidance_interval=None if autoguided else parse_interval(interval or flags.guidance_interval),
        guide_scale=guide_scale,
        tiling=tiling,
    )
