"""What a run's x0 is: pixels, or the latents of an autoencoder (EDM2's training/encoders.py).

A codec turns a batch of records into the x0 the diffusion model learns (`x0(batch, key)`, inside
the training step), turns the model's samples back into images in [-1, 1] (`decode`), says the
data's standard deviation EDM's preconditioning assumes (`sigma_data`), and describes itself for a
checkpoint (`to_config`; `codec_from_config` rebuilds it) and the pretrained module it loaded
(`pretrained`, by its name in SHARDING_RULES). A new kind of x0 (another autoencoder's latents, a
different scaling) is a class here.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from eqxdiff.autoencoders import open_autoencoder
from eqxdiff.generate import decode_latents
from eqxdiff.images import from_uint8


class Pixels:
    """x0 is the records' uint8 `image`, mapped to [-1, 1]."""

    sigma_data = 0.5  # EDM's: images in [-1, 1]

    def x0(self, batch: dict, key: jax.Array) -> jax.Array:
        del key  # nothing to draw
        return from_uint8(batch["image"])

    def decode(self, x: np.ndarray, *, mesh: Mesh, tiling: str = "auto") -> np.ndarray:
        del mesh, tiling
        return x

    def image_shape(self, sample_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The [h, w, c] of the images a sample of `sample_shape` decodes to."""
        return tuple(sample_shape)

    def pretrained(self) -> dict:
        """The pretrained modules it loaded into the mesh, by the first name of their leaves' paths in
        train/main.py's SHARDING_RULES: {} (latents: {"autoencoder": the VAE})."""
        return {}

    def to_config(self) -> dict:
        return {"kind": "pixels"}


class Latents:
    """x0 is a draw from each record's posterior N(`mean`, exp(`logvar`)) (train/encode.py), scaled as
    the autoencoder's latent diffusion was: `(z - shift_factor) · scaling_factor`; samples decode with
    `decode(z / scaling_factor + shift_factor)`. `spec` names the autoencoder (`open_autoencoder`)."""

    sigma_data = 1.0  # latents scaled to std ≈ 1

    def __init__(self, autoencoder: Any, spec: str):
        self.autoencoder, self.spec = autoencoder, spec
        self.scaling_factor, self.shift_factor = autoencoder.scaling_factor, autoencoder.shift_factor

    def x0(self, batch: dict, key: jax.Array) -> jax.Array:
        mean, logvar = batch["mean"].astype(jnp.float32), batch["logvar"].astype(jnp.float32)
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
        return (z - self.shift_factor) * self.scaling_factor

    def decode(self, x: np.ndarray, *, mesh: Mesh, tiling: str = "auto") -> np.ndarray:
        """`tiling` "auto" | "on" | "off": through the VAE tile by tile (`eqxdiff.generate.decode_latents`)."""
        return decode_latents(self.autoencoder, x, mesh=mesh, tiling=tiling)

    def image_shape(self, sample_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The decoder's output shape for one latent (traced, not run)."""
        latent = jax.ShapeDtypeStruct((1, *sample_shape), np.float32)
        return tuple(jax.eval_shape(self.autoencoder.decode, latent).shape[1:])

    def pretrained(self) -> dict:
        return {"autoencoder": self.autoencoder}

    def to_config(self) -> dict:
        return {"kind": "latents", "autoencoder": self.spec}


def codec_from_config(config: dict | None, *, mesh: Mesh | None = None, min_size: int = 2**12, rules: Sequence = ()):
    """The codec a checkpoint's `codec` entry describes (None, as before codecs were stored: pixels), its
    autoencoder laid out over `mesh` by `min_size` and `rules` (`open_autoencoder`). Raises what
    `open_autoencoder` raises when the autoencoder cannot be read."""
    if not config or config["kind"] == "pixels":
        return Pixels()
    if config["kind"] == "latents":
        vae = open_autoencoder(config["autoencoder"], mesh=mesh, min_size=min_size, rules=rules)
        return Latents(vae, config["autoencoder"])
    raise ValueError(f"Unknown codec kind {config['kind']!r} (pixels | latents).")
