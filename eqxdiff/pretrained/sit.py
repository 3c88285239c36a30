"""willisma/SiT's published checkpoints as eqxdiff `DiT`s.

SiT's `models.py` is DiT's network line for line under DiT's state_dict names (`SiTBlock` is
`DiTBlock`; the same heads table, S 6, B 12, L 16, XL 16), so it loads through `load_dit`'s
machinery (`eqxdiff.pretrained.dit_checkpoints.load_official`). Two differences are in how it is called, not in
the weights: `t` is the interpolant's time in [0, 1], fed to the same sinusoidal embedding
unscaled (DiT feeds the step index 0..999), and with learn_sigma (SiT-XL-2-256x256.pt; the 512²
models have none) the official `forward` drops the second c channels, which SiT's loss never
reaches (they stay at their zero init in a trained checkpoint).

A SiT as an eqxdiff denoiser D(x̃; σ), so eqxdiff's own σ-space samplers (`eqxdiff.diffusion.sample`) run it.

SiT's x_τ = τ·x1 + (1-τ)·ε is eqxdiff's rectified flow with t = 1-τ: `FlowSchedule` (σ = t/(1-t), network
time 1000·t, input scale 1/(1+σ) = τ) and `FlowVelocity` (F predicts ε - x0, the negative of SiT's v = x1 - ε).
`SiTAsFlow` is the network in that contract; `sit_denoiser` the `Denoiser` around it: D = x_τ + (1-τ)·v, the
data estimate. Starting below σ = ∞ (τ > 0): eqxdiff's "euler" is SiT's Euler ODE step exactly (both are
DDIM); its "heun" is EDM's, not torchdiffeq's heun2 (sit_sampling.py's `ode_heun`), and its guidance guides
every channel.
"""

from pathlib import Path

import equinox as eqx
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from eqxdiff.diffusion.denoiser import Denoiser
from eqxdiff.diffusion.parameterization import FlowVelocity
from eqxdiff.diffusion.schedules import FlowSchedule
from eqxdiff.nn.dit import DiT
from eqxdiff.nn.torch_weights import Place
from eqxdiff.pretrained.dit_checkpoints import Family, load_official

SIT = Family("SiT", "willisma/SiT")


def load_sit(
    path: str | Path, num_heads: int | None = None, *, place: Place | None = None, dtype: DTypeLike = np.float32
) -> DiT:
    """An official SiT checkpoint (`SiT-XL-2-256x256.pt`, a train.py `*.pt` — its "ema", as SiT's
    `find_model` — or either as `.safetensors`) as `DiT`: `model(x[b,h,w,c], t[b], labels[b])`
    with t in [0, 1] (SiT's time: noise at 0, data at 1 on its linear path x_t = t·x1 + (1 - t)·x0)
    and label `num_classes` the null class. Its `[..., :c]` is the official `forward(x, t, y)` (the velocity,
    NHWC); with learn_sigma the output has 2c channels, the last c the unused variance head. Heads,
    `place` and `dtype` as in `load_dit`."""
    return load_official(path, SIT, num_heads, place=place, dtype=dtype)


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
