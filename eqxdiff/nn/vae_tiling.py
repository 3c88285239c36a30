"""Encoding and decoding images too large for one pass, as diffusers' `AutoencoderKL` does with
`enable_tiling()` and `enable_slicing()` (diffusers 0.42.1, `autoencoder_kl.py`).

Tiling: an image larger than `tile` (the config's `sample_size`, 512 for SD's VAE) is cut into
`tile`² tiles at a stride of `tile·(1 - overlap)`; each is encoded on its own, blended linearly into
the tile above (`blend_v`) and the one to its left (`blend_h`) over `overlap` of a tile, and its
top-left `tile - blend` kept. Decoding cuts the latent the same way (`tile / f`). diffusers blends in
place, row by row, so a tile is blended with neighbours that were blended already: so is it here.
A tiled result differs from the untiled one (a tile sees only its part of the image), as diffusers'.
Slicing: a batch one image at a time.

Each tile or slice is one call of a jitted function from the host (one compile per tile shape, at
most four), so peak memory is one tile's, whatever the image size. These functions are therefore
called outside `jit`: inside one, the loop would become one program holding every tile.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from eqxdiff.nn.autoencoder_kl import AutoencoderKL, posterior

OVERLAP = 0.25  # diffusers' tile_overlap_factor


@functools.partial(jax.jit, static_argnums=2)  # one small program per tile shape, not one per eager op
def blend_v(a: Float[Array, "b ha w c"], b: Float[Array, "b hb w c"], extent: int) -> Float[Array, "b hb w c"]:
    """`b` with its first `extent` rows faded in from `a`'s last ones: row y = a[-extent + y]·(1 - y/extent)
    + b[y]·(y/extent) (diffusers' `blend_v`; the extent shrinks to fit the shorter tile)."""
    extent = min(a.shape[1], b.shape[1], extent)
    w = np.arange(extent) / extent  # the weights as diffusers forms them: Python floats, then float32
    w_b, w_a = (jnp.asarray(v.astype(np.float32))[None, :, None, None] for v in (w, 1 - w))
    return b.at[:, :extent].set(a[:, a.shape[1] - extent :] * w_a + b[:, :extent] * w_b)


@functools.partial(jax.jit, static_argnums=2)
def blend_h(a: Float[Array, "b h wa c"], b: Float[Array, "b h wb c"], extent: int) -> Float[Array, "b h wb c"]:
    """`blend_v` across columns: `b`'s first `extent` columns faded in from `a`'s last (diffusers' `blend_h`)."""
    swap = lambda t: t.swapaxes(1, 2)  # noqa: E731
    return swap(blend_v(swap(a), swap(b), extent))


def tiled(run_tile, x: Float[Array, "b h w c"], tile: int, tile_out: int, overlap: float = OVERLAP) -> Array:
    """diffusers' tile loop: `run_tile` (input tiles of at most `tile`², outputs of at most `tile_out`²)
    over tiles of `x` at stride `int(tile·(1 - overlap))`, blended over `int(tile_out·overlap)` and
    cropped to `tile_out - blend`, then put together."""
    stride, extent = int(tile * (1 - overlap)), int(tile_out * overlap)
    keep = tile_out - extent
    above: list = []  # the previous row's blended tiles (blend_v reads them as diffusers' in-place loop does)
    rows = []
    for i in range(0, x.shape[1], stride):
        row: list = []
        for j in range(0, x.shape[2], stride):
            out = run_tile(x[:, i : i + tile, j : j + tile])
            if above:
                out = blend_v(above[len(row)], out, extent)
            if row:
                out = blend_h(row[-1], out, extent)
            row.append(out)
        rows.append(jnp.concatenate([t[:, :keep, :keep] for t in row], axis=2))
        above = row
    return jnp.concatenate(rows, axis=1)


@eqx.filter_jit
def _moments(vae: AutoencoderKL, x):
    return vae.encode_moments(x)


@eqx.filter_jit
def _decode(vae: AutoencoderKL, z):
    return vae.decode(z)


def _check_tile(vae: AutoencoderKL, tile: int, overlap: float) -> None:
    f = vae.downsample_factor
    if tile % f or int(tile * (1 - overlap)) % f:
        raise ValueError(
            f"tile {tile} with overlap {overlap}: the tile and its stride {int(tile * (1 - overlap))} "
            f"must be multiples of the VAE's downsampling factor {f}"
        )


def encode_in_pieces(
    vae: AutoencoderKL,
    x: Float[Array | np.ndarray, "b h w ci"],
    *,
    tiling: bool = True,
    slicing: bool = False,
    tile: int | None = None,
    overlap: float = OVERLAP,
) -> tuple[Float[Array, "b hl wl c"], Float[Array, "b hl wl c"]]:
    """`vae.encode(x)` as diffusers computes it with `enable_tiling()` (`tiling`: images larger than
    `tile`, default the config's sample_size, go tile by tile) and `enable_slicing()` (`slicing`: one
    image at a time): (mean, logvar clamped), logvar clamped after the blend, as diffusers does."""
    tile, x = tile or vae.tile_sample_size, jnp.asarray(x)
    _check_tile(vae, tile, overlap)

    def one(x):
        if tiling and max(x.shape[1], x.shape[2]) > tile:
            return tiled(functools.partial(_moments, vae), x, tile, tile // vae.downsample_factor, overlap)
        return _moments(vae, x)

    pieces = [one(x[i : i + 1]) for i in range(x.shape[0])] if slicing and x.shape[0] > 1 else [one(x)]
    return posterior(jnp.concatenate(pieces))


def decode_in_pieces(
    vae: AutoencoderKL,
    z: Float[Array | np.ndarray, "b hl wl c"],
    *,
    tiling: bool = True,
    slicing: bool = False,
    tile: int | None = None,
    overlap: float = OVERLAP,
) -> Float[Array, "b h w co"]:
    """`vae.decode(z)` as diffusers computes it with `enable_tiling()` (`tiling`: latents larger than
    `tile / f` go tile by tile) and `enable_slicing()` (`slicing`: one latent at a time)."""
    tile, z = tile or vae.tile_sample_size, jnp.asarray(z)
    _check_tile(vae, tile, overlap)
    tile_latent = tile // vae.downsample_factor

    def one(z):
        if tiling and max(z.shape[1], z.shape[2]) > tile_latent:
            return tiled(functools.partial(_decode, vae), z, tile_latent, tile, overlap)
        return _decode(vae, z)

    pieces = [one(z[i : i + 1]) for i in range(z.shape[0])] if slicing and z.shape[0] > 1 else [one(z)]
    return jnp.concatenate(pieces)
