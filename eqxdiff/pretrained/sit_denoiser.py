"""A SiT as an eqxdiff denoiser D(x̃; σ), so eqxdiff's own σ-space samplers (`eqxdiff.diffusion.sample`) run it.

SiT's x_τ = τ·x1 + (1-τ)·ε is eqxdiff's rectified flow with t = 1-τ: `FlowSchedule` (σ = t/(1-t), network
time 1000·t, input scale 1/(1+σ) = τ) and `FlowVelocity` (F predicts ε - x0, the negative of SiT's v = x1 - ε).
`SiTAsFlow` is the network in that contract; `sit_denoiser` the `Denoiser` around it: D = x_τ + (1-τ)·v, the
data estimate. Starting below σ = ∞ (τ > 0): eqxdiff's "euler" is SiT's Euler ODE step exactly (both are
DDIM); its "heun" is EDM's, not torchdiffeq's heun2 (`sit_steps`), and its guidance guides every channel.
"""

import equinox as eqx
from jaxtyping import Array, Float, Int

from eqxdiff.diffusion.denoiser import Denoiser
from eqxdiff.diffusion.parameterization import FlowVelocity
from eqxdiff.diffusion.schedules import FlowSchedule
from eqxdiff.nn.dit import DiT


class SiTAsFlow(eqx.Module):
    """`model(x, t, labels)` with eqxdiff's flow time t = 1000·(1-τ) and output ε - x0 = -v (first c channels)."""

    model: DiT

    def __call__(self, x: Float[Array, "b h w c"], t: Float[Array, " b"], labels: Int[Array, " b"]) -> Array:
        tau = 1 - t / 1000
        return -self.model(x, tau, labels)[..., : x.shape[-1]]

    def null_cond(self, batch_size: int) -> Int[Array, " b"] | None:
        return self.model.null_cond(batch_size)


def sit_denoiser(model: DiT) -> Denoiser:
    """D(x̃; σ, labels) of a `load_sit` model under `FlowSchedule` + `FlowVelocity` (the t_min/t_max of the
    schedule only bound training draws, not what D accepts)."""
    return Denoiser(SiTAsFlow(model), FlowSchedule(), FlowVelocity())

