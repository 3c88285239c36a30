"""PNG grids: row labels sit in a left margin and leave the grid itself untouched."""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from eqxdiff.images import save_image_grid


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
