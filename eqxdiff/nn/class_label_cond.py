"""The condition of Stable Diffusion UNets with a class embedding: the text plus diffusers' `class_labels`,
which SD's released models use for a second, non-text input: the x4 upscaler's noise level (an index into
`num_class_embeds` rows) and SD 2.x unCLIP's noised image embedding (`class_embed_type="projection"`).

Like SDXL's sizes, the labels are per-example leaves of `cond`, so they travel with each row through
condition dropout and guidance's cond/uncond concatenation.
"""

import equinox as eqx
import numpy as np
from jaxtyping import Array, Float, Int

from eqxdiff.nn.text_cond import TextCond


class ClassLabelCond(eqx.Module):
    """`text`: the `TextCond`; `class_labels`: int32[b] row indices (num_class_embeds: the upscaler's
    noise level) or float[b, p] vectors (class_embed_type "projection", p =
    projection_class_embeddings_input_dim: unCLIP's image embedding and its noise level's embedding)."""

    text: TextCond
    class_labels: Int[Array | np.ndarray, " b"] | Float[Array | np.ndarray, "b p"]
