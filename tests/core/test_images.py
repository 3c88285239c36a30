"""Images out: [-1, 1] -> uint8 rounding and clipping, the grid's tile order, and row labels that
sit in a left margin and leave the grid itself untouched."""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from eqxdiff.images import from_uint8, image_grid, save_image_grid, to_uint8

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)


def test_to_uint8_rounds_to_the_nearest_level_and_clips():
    # v = (x + 1)·127.5, rounded to the nearest integer, then clipped to [0, 255] (no uint8 wrap-around).
    cases = [  # (x, v, expected)
        (-1.0, 0.0, 0),
        (1.0, 255.0, 255),
        (0.5, 191.25, 191),
        (0.0, 127.5, 128),  # the one exact half in float32: rounds up (to even), not down as truncation would
        (-1 + 0.49 / 127.5, 0.49, 0),
        (-1 + 0.51 / 127.5, 0.51, 1),  # either side of level 0's half
        (1 - 0.51 / 127.5, 254.49, 254),
        (1 - 0.49 / 127.5, 254.51, 255),  # either side of 254.5
        (-1.0001, -0.01275, 0),
        (1.0001, 255.01275, 255),  # just outside [-1, 1]
        (-2.0, -127.5, 0),
        (2.0, 382.5, 255),  # far outside: a cast without the clip would wrap to 128, 126
    ]
    x = np.array([c[0] for c in cases], np.float32).reshape(1, 1, -1, 1)
    got = to_uint8(x)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got.ravel(), [c[2] for c in cases])
    levels = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1)
    np.testing.assert_array_equal(to_uint8(np.asarray(from_uint8(levels))), levels)  # every level comes back


def test_grid_tiles_row_by_row_with_black_padding(tmp_path: Path):
    # Five 1×2 tiles, tile i = [10i + 11, 10i + 12], three to a row: written out by hand.
    tiles = np.array([[[[11], [12]]], [[[21], [22]]], [[[31], [32]]], [[[41], [42]]], [[[51], [52]]]], np.uint8)
    expected = np.array(
        [
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            [0, 11, 12, 0, 21, 22, 0, 31, 32, 0],
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            [0, 41, 42, 0, 51, 52, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        ],
        np.uint8,
    )
    np.testing.assert_array_equal(image_grid(tiles, ncols=3)[..., 0], expected)
    # save_image_grid: the same tiles from [-1, 1] (exact levels), each pixel upscaled to 2×2.
    png = save_image_grid(tmp_path / "grid.png", tiles.astype(np.float32) / 127.5 - 1, ncols=3, upscale=2)
    np.testing.assert_array_equal(np.asarray(Image.open(png)), expected.repeat(2, 0).repeat(2, 1))


@pytest.mark.parametrize("channels", [1, 3])
def test_row_labels_add_a_margin_and_keep_the_grid(tmp_path: Path, channels: int):
    images = np.random.default_rng(0).uniform(-1, 1, (6, 8, 8, channels)).astype(np.float32)  # 2 rows of 3
    plain = np.asarray(Image.open(save_image_grid(tmp_path / "plain.png", images, ncols=3, upscale=4)))

    def labeled(labels: list[str], name: str) -> np.ndarray:
        return np.asarray(Image.open(save_image_grid(tmp_path / name, images, ncols=3, upscale=4, row_labels=labels)))

    cat_dog, dog_cat = labeled(["cat", "dog"], "a.png"), labeled(["dog", "cat"], "b.png")
    margin = cat_dog.shape[1] - plain.shape[1]
    assert margin > 0 and cat_dog.shape[0] == plain.shape[0]
    np.testing.assert_array_equal(cat_dog[:, margin:], plain)  # the grid, pixel for pixel
    assert cat_dog[:, :margin].max() > 128  # the labels are drawn, light on the black background
    assert cat_dog.shape == dog_cat.shape and not np.array_equal(cat_dog[:, :margin], dog_cat[:, :margin])
    row_height = plain.shape[0] // 2
    assert cat_dog[:row_height, :margin].any() and cat_dog[row_height:, :margin].any()  # one label per row


def test_row_labels_must_match_the_rows(tmp_path: Path):
    images = np.zeros((5, 4, 4, 1), np.float32)
    with pytest.raises(ValueError, match="got 3 row_labels for a grid of 2 rows"):
        save_image_grid(tmp_path / "x.png", images, ncols=3, row_labels=["a", "b", "c"])
