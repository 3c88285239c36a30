"""transformers' `CLIPTextModelWithProjection`: CLIP's text tower and its projection head, the text
embedding CLIP compares with images (SDXL's `text_encoder_2` gives its pooled vector this way).

text_embeds = text_projection(pooler_output), a bias-free linear map to `projection_dim`. It loads
the folders transformers' `CLIPTextModelWithProjection.from_pretrained` does: a text tower with its
head (SDXL's `text_encoder_2/`, keys `text_model.*` and `text_projection.weight`) or a full
`CLIPModel` folder (its `text_config`, the vision tower's keys left unread).
"""

from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqxdiff.nn.abstract_network import abstract_network
from eqxdiff.nn.clip_text import BUFFERS, PREFIX, WEIGHTS_FILE, CLIPTextModel, parse_config, text_config
from eqxdiff.nn.layers import Dense
from eqxdiff.nn.torch_weights import Place, load_safetensors
from eqxdiff.weights.weight_files import weight_files

PROJECTION_DIM = 512  # transformers' CLIPTextConfig default
# A full CLIPModel's keys outside the text tower and its head: left unread.
VISION = ("vision_model.", "visual_projection.", "logit_scale")


class CLIPTextModelWithProjection(eqx.Module):
    """token ids `[b, n]` -> (last_hidden_state `[b, n, d]`, text_embeds `[b, projection_dim]`), as
    transformers' `CLIPTextModelWithProjection` outputs them. Field names are its attributes, so leaf
    paths are its state_dict keys (`text_model.…`, `text_projection.weight`)."""

    text_model: CLIPTextModel
    text_projection: Dense

    def __init__(self, config: dict, *, key: PRNGKeyArray, causal: bool = True):
        k_text, k_head = jax.random.split(key)
        self.text_model = CLIPTextModel(config, key=k_text, causal=causal)
        width = parse_config(config)["hidden_size"]
        self.text_projection = Dense(width, config.get("projection_dim", PROJECTION_DIM), use_bias=False, key=k_head)

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, causal: bool = True) -> "CLIPTextModelWithProjection":
        """Random weights for a transformers CLIPTextConfig dict (its `projection_dim` sizes the head)."""
        return cls(config, key=key, causal=causal)

    @classmethod
    def from_transformers(
        cls, path: str | Path, *, variant: str | None = None, place: Place | None = None
    ) -> "CLIPTextModelWithProjection":
        """A transformers folder holding the text tower and `text_projection.weight` (a
        CLIPTextModelWithProjection's, or a full CLIPModel's, whose `text_config` gives the sizes: its
        `projection_dim` as transformers reads it), as float32 parameters; `variant` and `place`
        as in `CLIPTextModel.from_transformers`."""
        config, full = text_config(Path(path))
        abstract = abstract_network(cls, config)

        def rename(key: str) -> str | None:  # transformers 5's unprefixed tower keys get the prefix
            if full and key.startswith(VISION):
                return None
            return key if key.startswith((PREFIX, "text_projection.")) else PREFIX + key

        weights = weight_files(Path(path), WEIGHTS_FILE, variant)
        ignore = [PREFIX + b for b in BUFFERS]
        return load_safetensors(abstract, weights, rename=rename, ignore=ignore, place=place)

    def __call__(
        self,
        input_ids: Int[Array | np.ndarray, "b n"],
        attention_mask: Int[Array | np.ndarray, "b n"] | Bool[Array | np.ndarray, "b n"] | None = None,
        *,
        hidden_layer: int | None = None,
    ) -> tuple[Float[Array, "b n d"], Float[Array, "b p"]]:
        """(hidden states, text_embeds): `CLIPTextModel.__call__`'s hidden states (`hidden_layer` as
        there) and the projection of its pooled vector."""
        hidden, pooled = self.text_model(input_ids, attention_mask, hidden_layer=hidden_layer)
        return hidden, self.text_projection(pooled)
