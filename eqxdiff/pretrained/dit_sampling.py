"""facebookresearch/DiT's sampling protocol (its `diffusion/` package and `sample.py`) in eqxdiff's σ-space.

What maps onto what (DiT's name -> eqxdiff's):
- `get_named_beta_schedule("linear", T)` -> `dit_schedule(T)`, a `VPSchedule` (β from 1e-4 to 0.02, ×1000/T);
- `space_timesteps(T, steps)` and `SpacedDiffusion`'s recomputed β's -> `spaced_sigmas(schedule, steps)`: the
  kept timesteps' σ's (a step's β = 1 - ᾱ/ᾱ_next is what each VP step computes from its two σ's), then 0;
- `_WrappedModel` (the original timestep fed) and ε-prediction with `ModelVarType.LEARNED_RANGE` ->
  `LearnedVarianceDenoiser(model, schedule, EpsilonPrediction())`: D(x; σ) and v, the network at the kept t;
- `forward_with_cfg` (ε of the first 3 channels guided, the rest from the conditional half) ->
  `ClassifierFreeGuidance(..., channels=3)`; guidance on D equals guidance on ε (D = x - σ·ε at one x, σ);
- `p_sample_loop` -> `sample(..., "ddpm_learned_variance")`, `p_mean_variance` -> `learned_range_posterior`;
  `ddim_sample_loop` -> `sample(WithoutVariance(...), ..., "ddim")`; `clip_denoised=False` as sample.py.
x = x_t/sqrt(ᾱ) throughout: the official x_T (`noise`) is x·sqrt(ᾱ_T), and the result at σ = 0 is x_0.
"""

import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxdiff.diffusion import (
    ClassifierFreeGuidance,
    EpsilonPrediction,
    LearnedVarianceDenoiser,
    VPSchedule,
    WithoutVariance,
    sample,
    spaced_sigmas,
)
from eqxdiff.nn.dit import DiT

DIT_METHODS = ("ddpm", "ddim")  # the samplers of DiT's protocol (its p_sample_loop, ddim_sample_loop)


def dit_schedule(diffusion_steps: int = 1000) -> VPSchedule:
    """`create_diffusion`'s noise: iDDPM's "linear" β's, from 1e-4 to 0.02 scaled by 1000/T (T = 1000 in DiT)."""
    scale = 1000 / diffusion_steps
    return VPSchedule.linear(diffusion_steps, scale * 1e-4, scale * 0.02)


def dit_denoiser(
    model: DiT,
    labels: Int[Array, " b"],
    guidance: float = 1.0,
    guided_channels: int | None = 3,
    diffusion_steps: int = 1000,
) -> ClassifierFreeGuidance:
    """DiT's guided model as a σ-space denoiser: `(x [b, h, w, c], σ) -> [b, h, w, 2c]`, D(x; σ) then the learned
    variance's v, the first `guided_channels` of D guided at `guidance` (`forward_with_cfg`; None: all c)."""
    if not isinstance(model, DiT) or not model.learn_sigma or model.num_classes < 1:
        raise ValueError(
            "DiT's protocol samples a class-conditional DiT with learn_sigma=True (load_dit's); for "
            "another model use eqxdiff.diffusion.sample."
        )
    c = model.in_channels
    if guided_channels is not None and not 1 <= guided_channels <= c:
        raise ValueError(
            f"guided_channels={guided_channels}: guide 1 to {c} latent channels (DiT's 3), or None for all."
        )
    denoiser = LearnedVarianceDenoiser(model, dit_schedule(diffusion_steps), EpsilonPrediction())
    channels = c if guided_channels is None else guided_channels
    return ClassifierFreeGuidance(denoiser, labels, guidance, model.null_cond(labels.shape[0]), channels)


def sample_dit(
    model: DiT,
    labels: Int[Array, " b"],
    noise: Float[Array, "b h w c"],
    *,
    steps: int | str,
    method: str = "ddpm",
    guidance: float = 1.0,
    key: PRNGKeyArray | None = None,
    guided_channels: int | None = 3,
    eta: float = 0.0,
    diffusion_steps: int = 1000,
    noises: Float[Array, "n b h w c"] | None = None,
) -> Float[Array, "b h w c"]:
    """Latents [b, h, w, c] from DiT's protocol: `noise` is the official x_T (sample.py's z, NHWC), `labels`
    class ids (`model.num_classes` is the null one), `steps` a respacing (250, "250", "ddim50", "10,15,20").

    `method`: "ddpm", ancestral with the learned variance (`p_sample_loop`; needs `key`), or "ddim"
    (`ddim_sample_loop`, deterministic at `eta` 0). `guidance` > 1 evaluates the batch and its null-class copy
    in one call and guides the first `guided_channels` latent channels (DiT's 3; None: all c), the rest of the
    output from the conditional half. Decode with the SD VAE at `latents / 0.18215`, as sample.py does.
    `noises` [steps, b, h, w, c] (ddpm): each step's unit noise given instead of drawn from `key`, e.g. the
    official loop's draws, to replay it.
    """
    guided = dit_denoiser(model, labels, guidance, guided_channels, diffusion_steps)
    if method not in DIT_METHODS:
        raise ValueError(f"Unknown method {method!r}; DiT's protocol has {DIT_METHODS}.")
    size, c = model.image_size, model.in_channels
    if noise.ndim != 4 or noise.shape[1:] != (size, size, c) or labels.shape != noise.shape[:1]:
        raise ValueError(
            f"noise must be [b, {size}, {size}, {c}] (NHWC) and labels [b]; got {noise.shape} and {labels.shape}."
        )
    if method == "ddpm" and key is None and noises is None:
        raise ValueError('method="ddpm" draws noise every step: pass key=jax.random.key(seed).')
    sigmas = spaced_sigmas(dit_schedule(diffusion_steps), steps)
    if noises is not None and (method != "ddpm" or noises.shape != (len(sigmas) - 1, *noise.shape)):
        raise ValueError(
            f"noises (method='ddpm' only) are one [b, h, w, c] per step, "
            f"{(len(sigmas) - 1, *noise.shape)}; got {noises.shape} for {method!r}."
        )
    x = noise * np.sqrt(1 + sigmas[0] ** 2).astype(noise.dtype)  # x_T -> x = x_T/sqrt(ᾱ_T)
    if method == "ddim":
        return sample(WithoutVariance(guided), x, sigmas, "ddim", key, eta=eta)
    return sample(guided, x, sigmas, "ddpm_learned_variance", key, noises=noises)


__all__ = ["dit_denoiser", "dit_schedule", "sample_dit"]
