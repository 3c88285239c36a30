"""Images in and out: [-1, 1] floats <-> uint8, and PNG grids of a batch."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8
from PIL import Image


def from_uint8(images: UInt8[Array, "*dims"] | UInt8[np.ndarray, "*dims"]) -> Float[Array, "*dims"]:
    """Map {0, ..., 255} to [-1, 1] in float32 (x/127.5 - 1); on device, e.g. in `prepare`."""
    return jnp.asarray(images).astype(jnp.float32) / 127.5 - 1


def to_uint8(images: Float[np.ndarray, "b h w c"]) -> UInt8[np.ndarray, "b h w c"]:
    """Map [-1, 1] to {0, ..., 255}, clipping what a sampler overshoots."""
    return np.clip(np.round((np.asarray(images, np.float32) + 1) * 127.5), 0, 255).astype(np.uint8)


def image_grid(images: UInt8[np.ndarray, "b h w c"], ncols: int, pad: int = 1) -> UInt8[np.ndarray, "H W c"]:
    """Tile a batch row by row into one image, `pad` pixels of black between tiles."""
    b, h, w, c = images.shape
    nrows = -(-b // ncols)
    grid = np.zeros((nrows * (h + pad) + pad, ncols * (w + pad) + pad, c), np.uint8)
    for i, image in enumerate(images):
        r, col = divmod(i, ncols)
        grid[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + col * (w + pad) : pad + col * (w + pad) + w] = image
    return grid


def save_image_grid(
    path: str | Path, images: Float[np.ndarray, "b h w c"], ncols: int, upscale: int = 1
) -> Path:
    """Write a [-1, 1] batch as a PNG grid (nearest-neighbour upscaled, so 8×8 digits are visible)."""
    grid = image_grid(to_uint8(images), ncols)
    image = Image.fromarray(grid[..., 0] if grid.shape[-1] == 1 else grid)
    if upscale > 1:
        image = image.resize((image.width * upscale, image.height * upscale), Image.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
