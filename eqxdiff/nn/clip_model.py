"""transformers' full `CLIPModel`: the text and vision towers, their projections into one embedding space and
`logit_scale`, loaded whole from a CLIPModel folder (openai/clip-vit-large-patch14 as transformers saves it:
`text_config`, `vision_config` and `projection_dim` in one config.json, every tensor in one file).

Field names are CLIPModel's attributes (`text_model`, `vision_model`, `text_projection`, `visual_projection`,
`logit_scale`), so leaf paths are its saved keys; every key is read.
"""

import json
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqxdiff.nn.abstract_network import abstract_network
from eqxdiff.nn.clip_text import BUFFERS as TEXT_BUFFERS
from eqxdiff.nn.clip_text import CLIPTextModel
from eqxdiff.nn.clip_text import parse_config as text_parse_config
from eqxdiff.nn.clip_vision import BUFFERS as VISION_BUFFERS
from eqxdiff.nn.clip_vision import LAYOUTS_WITH_PATCHES, WEIGHTS_FILE, CLIPVisionModel
from eqxdiff.nn.clip_vision import parse_config as vision_parse_config
from eqxdiff.nn.layers import Dense
from eqxdiff.nn.torch_weights import Place, load_safetensors
from eqxdiff.weights.weight_files import weight_files

PROJECTION_DIM = 512  # transformers' CLIPConfig default
LOGIT_SCALE = 2.6592  # its logit_scale_init_value: log(1 / 0.07)
IGNORED = {
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "initializer_factor",
    "logit_scale_init_value",
    "text_config_dict",
    "vision_config_dict",
}


class CLIPModel(eqx.Module):
    """CLIP's two towers and their heads: `get_text_features(ids, mask)` and `get_image_features(pixels)` give
    embeddings `[b, projection_dim]` in one space (transformers' methods of those names); `logit_scale` is the
    log of the temperature CLIP's contrastive logits use."""

    text_model: CLIPTextModel
    vision_model: CLIPVisionModel
    visual_projection: Dense
    text_projection: Dense
    logit_scale: Float[Array, ""]

    def __init__(self, config: dict, *, key: PRNGKeyArray):
        unknown = sorted(
            k
            for k in config
            if k not in {"text_config", "vision_config", "projection_dim"} | IGNORED and not k.startswith("_")
        )
        if config.get("model_type", "clip") != "clip" or unknown:
            raise ValueError(
                f"CLIPModel config: model_type {config.get('model_type')!r}, options not supported {unknown}"
            )
        k_text, k_vision, k_vp, k_tp = jax.random.split(key, 4)
        text, vision = config.get("text_config", {}), config.get("vision_config", {})
        dim = config.get("projection_dim", PROJECTION_DIM)
        self.text_model = CLIPTextModel(text, key=k_text)
        self.vision_model = CLIPVisionModel(vision, key=k_vision)
        self.visual_projection = Dense(vision_parse_config(vision)["hidden_size"], dim, use_bias=False, key=k_vp)
        self.text_projection = Dense(text_parse_config(text)["hidden_size"], dim, use_bias=False, key=k_tp)
        self.logit_scale = jax.device_put(np.float32(config.get("logit_scale_init_value", LOGIT_SCALE)))

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray) -> "CLIPModel":
        """Random weights for a transformers CLIPConfig dict (`text_config`, `vision_config`, `projection_dim`)."""
        return cls(config, key=key)

    @classmethod
    def from_transformers(
        cls, path: str | Path, *, variant: str | None = None, place: Place | None = None
    ) -> "CLIPModel":
        """A transformers CLIPModel folder, every tensor read, as float32 parameters; `variant` and `place` as in
        `CLIPTextModel.from_transformers`."""
        config = json.loads((Path(path) / "config.json").read_text())
        abstract = abstract_network(cls, config)
        ignore = [f"text_model.{b}" for b in TEXT_BUFFERS] + [f"vision_model.{b}" for b in VISION_BUFFERS]
        return load_safetensors(
            abstract,
            weight_files(path, WEIGHTS_FILE, variant),
            ignore=ignore,
            place=place,
            layouts=LAYOUTS_WITH_PATCHES,
        )

    def get_text_features(
        self,
        input_ids: Int[Array | np.ndarray, "b n"],
        attention_mask: Int[Array | np.ndarray, "b n"] | Bool[Array | np.ndarray, "b n"] | None = None,
    ) -> Float[Array, "b p"]:
        """text_projection(the text tower's pooled vector), unnormalised."""
        return self.text_projection(self.text_model(input_ids, attention_mask)[1])

    def get_image_features(
        self, pixel_values: Float[Array | np.ndarray, "b h w c"], *, interpolate_pos_encoding: bool = False
    ) -> Float[Array, "b p"]:
        """visual_projection(the vision tower's pooled vector) of normalised NHWC images, unnormalised."""
        _, pooled = self.vision_model(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)
        return self.visual_projection(pooled)
