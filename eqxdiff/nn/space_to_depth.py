"""A weightless, exact "autoencoder": pixel-unshuffle (space-to-depth) with AutoencoderKL's
interface, so the latent-diffusion path can be checked end to end where decode loses nothing.

Channel order (that of `tf.nn.space_to_depth` in NHWC): for factor f and c channels,
`mean[b, i, j, (di*f + dj)*c + k] = x[b, i*f + di, j*f + dj, k]`, di, dj in [0, f).
"""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

LOGVAR = -30.0  # AutoencoderKL's lower clamp: a posterior with (numerically) no spread


class SpaceToDepth(eqx.Module):
    """Images `[b, h, w, c]` <-> latents `[b, h/f, w/f, c*f*f]`; `decode(encode(x)[0]) == x` exactly."""

    factor: int = eqx.field(static=True)
    scaling_factor = 1.0  # the latents are the pixels: already about unit scale, no shift
    shift_factor = 0.0

    def __init__(self, factor: int):
        if factor < 1:
            raise ValueError(f"SpaceToDepth factor must be >= 1, got {factor}")
        self.factor = factor

    @property
    def downsample_factor(self) -> int:
        return self.factor

    def encode(self, x: Float[Array, "b h w c"]) -> tuple[Float[Array, "b hl wl cl"], Float[Array, "b hl wl cl"]]:
        """Images -> (mean, logvar): mean is x unshuffled, logvar is -30 everywhere."""
        b, h, w, c = x.shape
        f = self.factor
        if h % f or w % f:
            raise ValueError(f"SpaceToDepth.encode: image size {(h, w)} must be divisible by {f}")
        mean = x.reshape(b, h // f, f, w // f, f, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, h // f, w // f, f * f * c)
        return mean, jnp.full_like(mean, LOGVAR)

    def decode(self, z: Float[Array, "b hl wl cl"]) -> Float[Array, "b h w c"]:
        """Latents -> images: the exact inverse of `encode`'s mean."""
        b, hl, wl, cl = z.shape
        f = self.factor
        if cl % (f * f):
            raise ValueError(f"SpaceToDepth.decode: {cl} channels are not a multiple of factor² = {f * f}")
        c = cl // (f * f)
        return z.reshape(b, hl, wl, f, f, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, hl * f, wl * f, c)
