"""Images in and out: [-1, 1] floats <-> uint8, and PNG grids of a batch (with row labels if asked)."""

import os
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8
from PIL import Image, ImageDraw, ImageFont

from eqxdiff.paths import as_path, is_url


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
    path: str | os.PathLike,
    images: Float[np.ndarray, "b h w c"],
    ncols: int,
    upscale: int = 1,
    row_labels: Sequence[str] | None = None,
) -> os.PathLike:
    """Write a [-1, 1] batch as a PNG grid (nearest-neighbour upscaled, so 8×8 digits are visible).

    `row_labels` (one str per grid row) adds a black left margin with each label in white, centered
    on its row; the grid to its right is unchanged. The PNG stays grayscale (L) for 1-channel images."""
    grid = image_grid(to_uint8(images), ncols)
    image = Image.fromarray(grid[..., 0] if grid.shape[-1] == 1 else grid)
    if upscale > 1:
        image = image.resize((image.width * upscale, image.height * upscale), Image.NEAREST)
    if row_labels is not None:
        nrows = -(-len(images) // ncols)
        if len(row_labels) != nrows:
            raise ValueError(
                f"save_image_grid got {len(row_labels)} row_labels for a grid of {nrows} rows"
                f" ({len(images)} images, ncols={ncols}); pass one label per row."
            )
        image = add_row_labels(image, row_labels, tile_height=images.shape[1] * upscale, pad=upscale)
    path = as_path(path)  # a local file or an object in a bucket (eqxdiff/paths.py)
    if not is_url(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path)
        return path
    with path.open("wb") as f:  # one upload; PIL names the format from a file name's suffix, not from a stream's
        image.save(f, format=Image.registered_extensions()[path.suffix.lower()])
    return path


def add_row_labels(grid: Image.Image, labels: Sequence[str], tile_height: int, pad: int) -> Image.Image:
    """`grid` (rows `tile_height` px high, `pad` px apart and from the top) to the right of a black
    margin holding each row's label in white (black, like the grid's padding, under white text)."""
    font = ImageFont.load_default()
    boxes = [font.getbbox(label) for label in labels]  # (left, top, right, bottom) drawn at (0, 0)
    gap = 4  # px of black on either side of the longest label
    margin = max(right for _, _, right, _ in boxes) + 2 * gap
    labeled = Image.new(grid.mode, (margin + grid.width, grid.height), 0)  # 0: black in L and RGB
    labeled.paste(grid, (margin, 0))
    draw = ImageDraw.Draw(labeled)
    white = 255 if grid.mode == "L" else (255,) * len(grid.getbands())
    for r, (label, (_, top, _, bottom)) in enumerate(zip(labels, boxes)):
        center = pad + r * (tile_height + pad) + tile_height / 2
        draw.text((gap, center - (top + bottom) / 2), label, fill=white, font=font)
    return labeled
