"""Autoguidance (Karras et al. 2024, "Guiding a Diffusion Model with a Bad Version of Itself") as a denoiser
wrapper: the model extrapolated away from a weaker model of the same task, both on the same condition."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
from jaxtyping import Array, Float


class AutoGuidance(eqx.Module):
    """D = D_w + scale·(D - D_w) (Karras et al. 2024, eq. 2), both denoisers called with the same `cond`.

    `denoiser(x, sigma, cond)` and `weak_denoiser(x, sigma, cond)` give D(x; σ) of one task (e.g. `Denoiser`s
    of two runs: a smaller model, or the same one trained shorter); they may differ in size, parameterization
    and sharding. `cond`: a condition pytree for the b samples, or None (unconditional). `scale == 1`
    (a Python number) is the main model alone. The result is a `denoise(x, sigma)` callable for `sample`,
    so both networks run in the sampler's one compiled program.
    """

    denoiser: Callable
    weak_denoiser: Callable
    scale: float | Float[Array, ""]
    cond: Any = None

    def __call__(
        self, x: Float[Array, "b *dims"], sigma: Float[Array, ""], *, sigma_end: Float[Array, ""] | None = None
    ) -> Float[Array, "b *dims"]:
        end = {} if sigma_end is None else {"sigma_end": sigma_end}  # networks of two times (`Denoiser`'s)
        good = self.denoiser(x, sigma, self.cond, **end)
        if isinstance(self.scale, (int, float)) and self.scale == 1:
            return good
        weak = self.weak_denoiser(x, sigma, self.cond, **end)
        return weak + self.scale * (good - weak)
