"""SDXL's condition: the text (two towers' hidden states and the pooled `text_embeds`) plus the size and
crop micro-conditioning `time_ids` (Podell et al. 2023, §2.2).

The sizes are not text: they come from the image (its size before resizing, where it was cropped) in
training and from the request (the target size) in sampling, so they sit next to the `TextCond` the
towers make rather than inside it. Being leaves of `cond`, they travel with each row through condition
dropout and guidance's cond/uncond concatenation (diffusers' negative_original_size etc. are rows of
the unconditional half), which an extra call argument would not.
"""

from collections.abc import Sequence

import equinox as eqx
import numpy as np
from jaxtyping import Array, Float

from eqxdiff.nn.text_cond import TextCond


class SDXLCond(eqx.Module):
    """`text`: a `TextCond` whose `pooled` [b, p] is SDXL's `text_embeds`; `time_ids` float[b, k]: the
    micro-conditioning numbers, k = 6 for the base model (original h, w, crop top, left, target h, w) and
    5 for the refiner (original h, w, crop top, left, aesthetic score), as diffusers' `add_time_ids`."""

    text: TextCond
    time_ids: Float[Array | np.ndarray, "b k"]


def sdxl_time_ids(
    original_size: Sequence[int], crop_top_left: Sequence[int], target_size: Sequence[int], batch_size: int
) -> np.ndarray:
    """The base model's time_ids float32[batch_size, 6], every row `(*original_size, *crop_top_left,
    *target_size)` with sizes as (height, width), as diffusers' `StableDiffusionXLPipeline._get_add_time_ids`."""
    row = [*original_size, *crop_top_left, *target_size]
    if len(row) != 6:
        raise ValueError(f"sdxl_time_ids: sizes and crop are (height, width) and (top, left) pairs; got {row}")
    return np.tile(np.asarray(row, np.float32), (batch_size, 1))
