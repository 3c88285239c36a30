"""Sampling a trained model into host images, on every device of every process; latents
decoded by their autoencoder (`generate_images`: both, through a run's codec)."""

import functools
from typing import Any

import equinox as eqx

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqxdiff.autoencoders import auto_batch_size, use_tiling
from eqxdiff.diffusion import (
    AutoGuidance,
    ClassifierFreeGuidance,
    Denoiser,
    Parameterization,
    Schedule,
    flow_time_sigmas,
    karras_sigmas,
    sample,
)
from eqxdiff.nn.vae_tiling import decode_in_pieces
from eqxdiff.sharding import batch_sharding


def global_rows(a: Any, mesh: Mesh) -> jax.Array:
    """A host array as a global one: split over the devices when its rows divide, replicated
    otherwise. Built from the same host values on every process, so a call is the same in 1 or N
    processes."""
    a = np.asarray(a)
    split = a.ndim and a.shape[0] % mesh.size == 0
    sharding = batch_sharding(mesh) if split else NamedSharding(mesh, PartitionSpec())
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


def sampling_grid(method: str, steps: int, schedule: Schedule) -> np.ndarray:
    """The σ grid `method` walks: MeanFlow's steps are uniform in flow time t (its own sampler's grid), every other
    sampler's follow EDM's Karras grid between the schedule's σ_max and σ_min, then 0."""
    if method == "meanflow":
        return flow_time_sigmas(steps, schedule.sigma_max)
    return karras_sigmas(steps, schedule.sigma_min, schedule.sigma_max)


def generate(
    model: Any,
    schedule: Schedule,
    parameterization: Parameterization,
    cond: Any,
    num: int,
    image_shape: tuple[int, ...],
    *,
    mesh: Mesh,
    steps: int,
    method: str = "heun",
    guidance: float = 1.0,
    null_cond: Any = None,
    guidance_interval: tuple[float, float] | None = None,
    weak_denoiser: Any = None,
    guide_scale: float = 1.0,
    seed: int = 0,
) -> np.ndarray:
    """`num` images, host float32 `[num, *image_shape]` in about [-1, 1], from `model` (e.g. the
    EMA) on a Karras grid of `steps` steps with sampler `method`.

    `cond`: a condition pytree of host arrays with `num` rows (labels `(num,)`, ...), or None
    (unconditional). `guidance` != 1 applies classifier-free guidance against `null_cond`
    (default: `model.null_cond(num)`), only for σ in `guidance_interval` (σ_lo, σ_hi] if given. `weak_denoiser`
    (`Denoiser(x, sigma, cond)` of a weaker model of the same task): autoguidance at `guide_scale` instead of
    classifier-free guidance, both models in the one sampler program. Every process must call it with the same
    arguments (the models may be sharded over all of them) and every process gets all the images.
    """
    to_global = functools.partial(global_rows, mesh=mesh)
    denoise = Denoiser(model, schedule, parameterization)
    if weak_denoiser is not None:
        if guidance != 1:
            raise ValueError("Autoguidance (weak_denoiser) replaces classifier-free guidance: pass guidance=1.")
        denoise = AutoGuidance(denoise, weak_denoiser, guide_scale, jax.tree.map(to_global, cond))
    elif cond is not None:
        null_cond = model.null_cond(num) if null_cond is None and guidance != 1 else null_cond
        cond, null_cond = jax.tree.map(to_global, (cond, null_cond))
        denoise = ClassifierFreeGuidance(denoise, cond, guidance, null_cond, interval=guidance_interval)
    sigmas = sampling_grid(method, steps, schedule)
    noise = np.random.default_rng(seed).standard_normal((num, *image_shape), np.float32)
    out = sample(denoise, to_global(np.float32(sigmas[0]) * noise), sigmas, method, jax.random.key(seed))
    return np.asarray(multihost_utils.process_allgather(out, tiled=True))


def generate_images(
    model: Any,
    codec: Any,
    schedule: Schedule,
    parameterization: Parameterization,
    cond: Any,
    num: int,
    sample_shape: tuple[int, ...],
    *,
    mesh: Mesh,
    steps: int,
    method: str = "heun",
    guidance: float = 1.0,
    null_cond: Any = None,
    guidance_interval: tuple[float, float] | None = None,
    weak_denoiser: Any = None,
    guide_scale: float = 1.0,
    seed: int = 0,
    tiling: str = "auto",
) -> tuple[np.ndarray, np.ndarray]:
    """(`num` images, host float32 `[num, h, w, c]` in about [-1, 1]; the samples as the model drew them,
    `[num, *sample_shape]`): `generate`'s samples, decoded by `codec` (eqxdiff/run/codecs.py: pixels are the
    images themselves, the same array; latents go through the autoencoder, `tiling` "auto" | "on" |
    "off"). `guidance` (the classifier-free guidance scale, 1: none), `guidance_interval`, `weak_denoiser`,
    `guide_scale`: `generate`'s. Every process calls it alike and gets all the images."""
    drawn = generate(
        model,
        schedule,
        parameterization,
        cond,
        num,
        sample_shape,
        mesh=mesh,
        steps=steps,
        method=method,
        guidance=guidance,
        null_cond=null_cond,
        guidance_interval=guidance_interval,
        weak_denoiser=weak_denoiser,
        guide_scale=guide_scale,
        seed=seed,
    )
    return codec.decode(drawn, mesh=mesh, tiling=tiling), drawn


@eqx.filter_jit
def _unscale(autoencoder: Any, latents: jax.Array) -> jax.Array:
    return latents / autoencoder.scaling_factor + autoencoder.shift_factor


@eqx.filter_jit
def _decode(autoencoder: Any, latents: jax.Array) -> jax.Array:
    return autoencoder.decode(_unscale(autoencoder, latents))


def decode_latents(
    autoencoder: Any, latents: np.ndarray, *, mesh: Mesh, batch_size: int = 0, tiling: str = "auto"
) -> np.ndarray:
    """Latents as the diffusion model sees them, host `[n, h, w, c]`, -> host float32 images
    `[n, h·f, w·f, channels]` in about [-1, 1]: `decode(z / scaling_factor + shift_factor)`
    (`eqxdiff.autoencoders.Autoencoder`), in chunks of `batch_size` rows (0: as many as
    `auto_batch_size` gives for the image size; rounded up to a multiple of the devices; the last
    chunk padded, so one program serves all). `tiling` "auto" | "on" | "off" (`use_tiling`): tiled
    chunks go through the VAE tile by tile (diffusers' tiling, `eqxdiff.nn.vae_tiling`). Every process
    calls it with the same latents and gets all the images."""
    n, f = len(latents), autoencoder.downsample_factor
    image_hw = (latents.shape[1] * f, latents.shape[2] * f)
    chunk = -(-min(batch_size or auto_batch_size(image_hw), n) // mesh.size) * mesh.size
    tiled = use_tiling(tiling, autoencoder, image_hw)

    def decode(rows: jax.Array) -> jax.Array:
        return decode_in_pieces(autoencoder, _unscale(autoencoder, rows)) if tiled else _decode(autoencoder, rows)

    padded = np.concatenate([latents, np.zeros((-n % chunk, *latents.shape[1:]), latents.dtype)])
    out = [
        multihost_utils.process_allgather(decode(global_rows(padded[i : i + chunk], mesh)), tiled=True)
        for i in range(0, len(padded), chunk)
    ]
    return np.concatenate([np.asarray(o) for o in out])[:n]
