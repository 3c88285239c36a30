"""willisma/SiT's sampling protocols (`transport/`, `sample.py`, `sample_ddp.py`) for a `load_sit` model.

Linear path, velocity prediction, SiT's defaults for them (train_eps = sample_eps = 0, so the ODE runs τ
from 0 to 1). `steps` is SiT's `--num-sampling-steps`, the number of points of its time grid
τ = linspace(t0, t1, steps): the fixed-step ODE takes steps - 1 steps (Heun: 2·(steps - 1) network calls);
the SDE takes steps - 1 SDE steps on linspace(0, 1 - last_step_size, steps), then its last step to τ = 1.
SiT-XL/2's published FIDs at cfg 1.5 (the authors' project page, its benchmark table): 2.06 with the SDE,
w(t) = σ_t (here `method="sde"` with its defaults, Euler–Maruyama, sigma, Mean), 2.15 with the ODE, by
default "a 250 steps Heun ODE solver" there and "125 steps (250 NFEs)" in willisma/SiT#18, which is
`--sampling-method heun2 --num-sampling-steps 126` in their PyTorch code (`sampler="heun", steps=126`).
The grid maps onto eqxdiff's σ grid σ = (1-τ)/τ and the fixed-step methods run as one `lax.scan` in
`eqxdiff.diffusion.sample` (see `sit_steps` for what maps onto what); dopri5 is diffrax's, set up as
torchdiffeq runs it (`sit_dopri5`) at SiT's tolerances (atol 1e-6, rtol 1e-3), one adaptive solve for
the whole batch as `odeint` does.

Classifier-free guidance is SiT's `forward_with_cfg` on SiT's own doubled batch, as `sample_ddp.py` runs it
for cfg_scale > 1: the state is [x, x] with labels [y, null]; the network sees [x, x] (first half twice),
the first `guided_channels` (3, SiT's choice "for exact reproducibility") of the velocity are
uncond + s·(cond - uncond) in both halves and the rest stay the network's own, conditional in the first
half and unconditional in the second. Only the first half is returned, but the second is integrated too,
since torchdiffeq's error norm (dopri5's step sizes) and the SDE's noise draws run over both.
"""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxdiff.diffusion.samplers import sample
from eqxdiff.nn.dit import DiT
from eqxdiff.pretrained.sit_dopri5 import dopri5
from eqxdiff.pretrained.sit_steps import ode_euler, ode_heun, sde_euler, sde_heun

ODE_SAMPLERS = {"euler": ode_euler, "heun": ode_heun, "heun2": ode_heun, "dopri5": None}
SDE_SAMPLERS = {"euler": sde_euler, "heun": sde_heun}


class SiTVelocity(eqx.Module):
    """SiT's network as the velocity v(x_τ, τ) its samplers integrate: `model.forward` (the first c
    channels) on b rows, or with `cfg_scale` > 1 `forward_with_cfg` on the doubled batch of 2b rows."""

    model: DiT
    labels: Int[Array, " rows"]
    cfg_scale: float | None = eqx.field(static=True)
    guided_channels: int | None = eqx.field(static=True)

    def __init__(self, model: DiT, labels: Int[Array, " b"], cfg_scale: float = 1.0, guided_channels: int | None = 3):
        self.model, self.guided_channels = model, guided_channels
        if cfg_scale > 1:
            self.cfg_scale, self.labels = float(cfg_scale), jnp.concatenate([labels, model.null_cond(labels.shape[0])])
        else:
            self.cfg_scale, self.labels = None, labels

    def __call__(self, x: Float[Array, "rows h w c"], tau: Float[Array, ""]) -> Float[Array, "rows h w c"]:
        t = jnp.full(x.shape[:1], tau, x.dtype)
        if self.cfg_scale is None:
            return self.model(x, t, self.labels)[..., : x.shape[-1]]
        half = x[: x.shape[0] // 2]
        out = self.model(jnp.concatenate([half, half]), t, self.labels)[..., : x.shape[-1]]
        k = self.guided_channels or x.shape[-1]
        cond, uncond = jnp.split(out[..., :k], 2)
        guided = uncond + self.cfg_scale * (cond - uncond)
        return jnp.concatenate([jnp.concatenate([guided, guided]), out[..., k:]], axis=-1)


def sit_sigmas(taus: np.ndarray) -> np.ndarray:
    """eqxdiff's σ = (1-τ)/τ of a SiT time grid (float64; τ = 0 gives σ = ∞)."""
    taus = np.asarray(taus, np.float64)
    with np.errstate(divide="ignore"):
        return (1 - taus) / taus


def sit_time_grid(steps: int, method: str, last_step: str | None = "Mean", last_step_size: float = 0.04) -> np.ndarray:
    """SiT's τ grid for the Linear path with velocity prediction (Transport.check_interval, then
    linspace(t0, t1, steps)); the SDE's ends at 1 - last_step_size and gets τ = 1 appended for its last step."""
    if method == "ode" or last_step is None:
        return np.linspace(0.0, 1.0, steps)
    return np.append(np.linspace(0.0, 1.0 - last_step_size, steps), 1.0)


def sample_sit(
    model: DiT,
    labels: Int[Array, " b"],
    noise: Float[Array, "b h w c"],
    *,
    steps: int | None = None,
    method: str = "ode",
    sampler: str | None = None,
    cfg_scale: float = 1.0,
    guided_channels: int | None = 3,
    key: PRNGKeyArray | None = None,
    atol: float = 1e-6,
    rtol: float = 1e-3,
    max_steps: int = 4096,
    diffusion_form: str = "sigma",
    diffusion_norm: float = 1.0,
    last_step: str | None = "Mean",
    last_step_size: float = 0.04,
    brownian: Float[Array, "n rows h w c"] | Float[np.ndarray, "n rows h w c"] | None = None,
) -> Float[Array, "b h w c"]:
    """Sample a SiT (`load_sit`) from `noise` (SiT's x at τ = 0, NHWC) to τ = 1, as SiT's sample_ddp.py does.

    `method` "ode" (SiT's `sample_ode`; `sampler` "dopri5" — SiT's default — with `atol`, `rtol` and at
    most `max_steps` steps, or "heun"/"heun2", "euler" on `steps` grid points) or "sde" (`sample_sde`;
    `sampler` "euler" — Euler–Maruyama, SiT's default — or "heun", with `diffusion_form` ("sigma",
    "linear", "decreasing"), `diffusion_norm`, `last_step` ("Mean", "Tweedie", "Euler" or None) and
    `last_step_size`; needs `key`, or `brownian`: the unit normals of each SDE step, [steps - 1 (steps
    without a last step), rows, h, w, c], rows = 2b with cfg). `steps` is SiT's --num-sampling-steps
    (module docstring); dopri5 needs none. `cfg_scale` > 1 guides the first `guided_channels` latent
    channels as SiT's forward_with_cfg (None: all of them). Returns the samples at τ = 1, [b, h, w, c].
    """
    if method not in ("ode", "sde"):
        raise ValueError(f"method {method!r}: SiT samples with 'ode' or 'sde'.")
    samplers = ODE_SAMPLERS if method == "ode" else SDE_SAMPLERS
    sampler = sampler or ("dopri5" if method == "ode" else "euler")
    if sampler not in samplers:
        raise ValueError(f"sampler {sampler!r} for method {method!r}: choose one of {tuple(samplers)}.")
    if noise.ndim != 4 or noise.shape[-1] != model.in_channels or labels.shape != noise.shape[:1]:
        raise ValueError(
            f"noise must be [b, h, w, {model.in_channels}] (NHWC) and labels [b]; got {noise.shape}, {labels.shape}."
        )
    if cfg_scale < 1:
        raise ValueError(f"cfg_scale {cfg_scale}: SiT's sample_ddp.py asserts cfg_scale >= 1 (1: no guidance).")
    velocity = SiTVelocity(model, labels, cfg_scale, guided_channels)
    x = jnp.concatenate([noise, noise]) if velocity.cfg_scale is not None else noise
    if sampler == "dopri5":
        return dopri5(velocity, x, rtol, atol, max_steps)[: noise.shape[0]]
    if not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps={steps!r}: SiT's {method} {sampler} needs a time grid of steps >= 2 points.")
    options = {}
    if method == "sde":
        if last_step is not None and not 0 < last_step_size < 1:
            raise ValueError(f"last_step_size {last_step_size}: SiT's last step runs from 1 - last_step_size to 1.")
        if sampler == "heun" and last_step is None:
            raise ValueError("SiT's Heun SDE without a last step evaluates the score at τ = 1, where it divides by 0.")
        if brownian is not None:
            brownian = jnp.asarray(brownian)
            want = (steps - 1,) + x.shape  # steps - 1 SDE steps, with or without a last step after them
            if brownian.shape != want:
                raise ValueError(f"brownian must be {want} (SDE steps, rows, h, w, c); got {brownian.shape}.")
        elif key is None:
            raise ValueError("SiT's SDE draws noise: pass key=jax.random.key(seed) (or brownian=).")
        options = dict(diffusion_form=diffusion_form, diffusion_norm=diffusion_norm, last_step=last_step,
                       brownian=brownian)  # fmt: skip
    taus = sit_time_grid(steps, method, last_step, last_step_size)
    key = None if method == "ode" else key
    return sample(velocity, x, sit_sigmas(taus), samplers[sampler], key, **options)[: noise.shape[0]]
