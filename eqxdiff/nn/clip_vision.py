"""transformers' `CLIPVisionModel` and `CLIPVisionModelWithProjection` (Radford et al. 2021, CLIP's image tower)
in Equinox, loading the folders people have: a vision tower's own (`vision_model.*` keys, with or without the
prefix, `visual_projection.weight`) or a full `CLIPModel` folder's (openai/clip-vit-large-patch14: its
`vision_config`, the text tower's keys left unread; eqxdiff.nn.clip_model reads both towers).

A pre-LayerNorm ViT: a bias-free p×p stride-p patch convolution, a class embedding before the patches, learned
position embeddings, `pre_layrnorm` (transformers' spelling), CLIP's encoder blocks (eqxdiff.nn.clip_text's,
attending to every token), and pooled = post_layernorm(the class token's last state); image_embeds =
visual_projection(pooled), bias-free.
"""

import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.nn.abstract_network import abstract_network
from eqxdiff.nn.bicubic import resize_bicubic
from eqxdiff.nn.clip_text import ACTIVATIONS, IGNORED, CLIPEncoder, CLIPEncoderLayer, LayerNorm
from eqxdiff.nn.conv import conv2d
from eqxdiff.nn.layers import Dense, Embedding, torch_uniform
from eqxdiff.nn.torch_weights import LAYOUTS, Place, load_safetensors
from eqxdiff.weights.weight_files import weight_files

WEIGHTS_FILE = "model.safetensors"
PREFIX = "vision_model."
BUFFERS = ("embeddings.position_ids",)  # transformers 4's saved arange buffer: not a weight
# transformers' CLIPVisionConfig defaults (ViT-B/32), for the fields that shape the network.
DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "projection_dim": 512,
}
# clip_text's ignored fields and the text tokens' ids, which transformers 4 wrote (null) into every sub-config, as
# openai's CLIP folders hold them.
VISION_IGNORED = IGNORED | {"eos_token_id"}
# A full CLIPModel's keys outside the vision tower and its head: left unread.
TEXT = ("text_model.", "text_projection.", "logit_scale")


def parse_config(config: dict) -> dict:
    """transformers' CLIPVisionConfig fields that shape the network, defaults filled in; an option this port does
    not implement raises a ValueError naming it."""
    if config.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(
            f"model_type {config.get('model_type')!r}: only a CLIP vision tower's config "
            "('clip_vision_model') is read here; from_transformers reads a full CLIP folder's "
            "vision_config itself"
        )
    unknown = sorted(k for k in config if k not in DEFAULTS and k not in VISION_IGNORED and not k.startswith("_"))
    if unknown:
        raise ValueError(f"CLIPVisionModel config options not supported: {unknown}")
    cfg = {**DEFAULTS, **{k: v for k, v in config.items() if k in DEFAULTS}}
    if cfg["hidden_act"] not in ACTIVATIONS:
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} not supported: only {sorted(ACTIVATIONS)}")
    for field in ("image_size", "patch_size"):
        if type(cfg[field]) is not int:
            raise ValueError(f"{field} {cfg[field]!r} not supported: one int (square images and patches)")
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise ValueError(
            f"hidden_size {cfg['hidden_size']} is not divisible by num_attention_heads {cfg['num_attention_heads']}"
        )
    return cfg


def vision_config(folder: Path) -> tuple[dict, bool]:
    """(the vision tower's config, whether the folder is a full CLIPModel) from `folder`'s config.json."""
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") == "clip" and isinstance(config.get("vision_config"), dict):
        return config["vision_config"], True
    return config, False


class PatchEmbedding(eqx.Module):
    """A bias-free p×p stride-p convolution, `[b, h, w, c] -> [b, h/p, w/p, d]` (kernel HWIO)."""

    weight: Float[Array, "p p c d"]

    def __call__(self, x: Float[Array, "b h w c"]) -> Float[Array, "b h2 w2 d"]:
        return conv2d(x, self.weight, self.weight.shape[0], 0)


LAYOUTS_WITH_PATCHES = {**LAYOUTS, PatchEmbedding: {"weight": (2, 3, 1, 0)}}  # OIHW -> HWIO, as Conv2d's


class CLIPVisionEmbeddings(eqx.Module):
    """[class_embedding, patches] + position embeddings, `[b, h, w, c] -> [b, 1 + (h/p)(w/p), d]`."""

    class_embedding: Float[Array, " d"]
    patch_embedding: PatchEmbedding
    position_embedding: Embedding

    def __call__(self, x: Float[Array, "b h w c"], interpolate: bool) -> Float[Array, "b n d"]:
        b = x.shape[0]
        grid = self.patch_embedding(x)
        gh, gw, d = grid.shape[1:]
        tokens = jnp.concatenate([jnp.broadcast_to(self.class_embedding, (b, 1, d)), grid.reshape(b, gh * gw, d)], 1)
        stored = self.position_embedding.weight
        side = int(round((stored.shape[0] - 1) ** 0.5))
        if (gh, gw) == (side, side):
            return tokens + stored
        if not interpolate:
            raise ValueError(
                f"CLIPVisionModel: a {gh}×{gw} patch grid, the model's is {side}×{side}: resize the "
                "images, or pass interpolate_pos_encoding=True (transformers' bicubic)"
            )
        patches = resize_bicubic(stored[1:].reshape(1, side, side, d), (gh, gw))  # transformers: size=, no antialias
        return tokens + jnp.concatenate([stored[:1], patches.reshape(gh * gw, d)])


class CLIPVisionModel(eqx.Module):
    """transformers' `CLIPVisionModel`: normalised images `[b, h, w, c]` (NHWC) -> (last_hidden_state
    `[b, 1 + patches, d]`, pooler_output `[b, d]` = post_layernorm of the class token). Field names are its
    attributes, so leaf paths are its state_dict keys (unprefixed, as transformers 5 saves the tower alone)."""

    embeddings: CLIPVisionEmbeddings
    pre_layrnorm: LayerNorm
    encoder: CLIPEncoder
    post_layernorm: LayerNorm

    def __init__(self, config: dict, *, key: PRNGKeyArray):
        cfg = parse_config(config)
        k_class, k_patch, k_pos, *k_layers = jax.random.split(key, 3 + cfg["num_hidden_layers"])
        d, p, c = cfg["hidden_size"], cfg["patch_size"], cfg["num_channels"]
        self.embeddings = CLIPVisionEmbeddings(
            class_embedding=d**-0.5 * jax.random.normal(k_class, (d,)),  # transformers' init std
            patch_embedding=PatchEmbedding(torch_uniform(k_patch, (p, p, c, d), p * p * c)),
            position_embedding=Embedding((cfg["image_size"] // p) ** 2 + 1, d, std=0.02, key=k_pos),
        )
        self.pre_layrnorm = LayerNorm(d, cfg["layer_norm_eps"])
        self.encoder = CLIPEncoder([CLIPEncoderLayer(cfg, key=k) for k in k_layers])
        self.post_layernorm = LayerNorm(d, cfg["layer_norm_eps"])

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray) -> "CLIPVisionModel":
        """Random weights for a transformers CLIPVisionConfig dict."""
        return cls(config, key=key)

    @classmethod
    def from_transformers(
        cls, path: str | Path, *, variant: str | None = None, place: Place | None = None
    ) -> "CLIPVisionModel":
        """A transformers CLIPVisionModel folder (keys with or without "vision_model."), or a full CLIPModel's
        vision tower, as float32 parameters; `variant` and `place` as in `CLIPTextModel.from_transformers`."""
        config, full = vision_config(Path(path))
        abstract = abstract_network(cls, config)

        def rename(key: str) -> str | None:  # a full CLIPModel's text tower and heads: not read
            return None if full and key.startswith((*TEXT, "visual_projection.")) else key.removeprefix(PREFIX)

        return load_safetensors(
            abstract,
            weight_files(path, WEIGHTS_FILE, variant),
            rename=rename,
            ignore=BUFFERS,
            place=place,
            layouts=LAYOUTS_WITH_PATCHES,
        )

    def __call__(
        self, pixel_values: Float[Array | np.ndarray, "b h w c"], *, interpolate_pos_encoding: bool = False
    ) -> tuple[Float[Array, "b n d"], Float[Array, "b d"]]:
        """(last_hidden_state, pooler_output); images of another size than the config's image_size raise unless
        `interpolate_pos_encoding` (transformers' flag: the position embeddings resized bicubically)."""
        x = self.embeddings(jnp.asarray(pixel_values, jnp.float32), interpolate_pos_encoding)
        x = self.pre_layrnorm(x)
        everywhere = jnp.ones((1, 1, x.shape[1], x.shape[1]), bool)  # no mask: every token sees every token
        for layer in self.encoder.layers:
            x = layer(x, everywhere)
        return x, self.post_layernorm(x[:, 0])


class CLIPVisionModelWithProjection(eqx.Module):
    """normalised images `[b, h, w, c]` -> (last_hidden_state, image_embeds `[b, projection_dim]`), as transformers'
    `CLIPVisionModelWithProjection` outputs them; leaf paths are its state_dict keys (`vision_model.…`,
    `visual_projection.weight`)."""

    vision_model: CLIPVisionModel
    visual_projection: Dense

    def __init__(self, config: dict, *, key: PRNGKeyArray):
        k_tower, k_head = jax.random.split(key)
        self.vision_model = CLIPVisionModel(config, key=k_tower)
        cfg = parse_config(config)
        self.visual_projection = Dense(cfg["hidden_size"], cfg["projection_dim"], use_bias=False, key=k_head)

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray) -> "CLIPVisionModelWithProjection":
        """Random weights for a transformers CLIPVisionConfig dict (its `projection_dim` sizes the head)."""
        return cls(config, key=key)

    @classmethod
    def from_transformers(
        cls, path: str | Path, *, variant: str | None = None, place: Place | None = None
    ) -> "CLIPVisionModelWithProjection":
        """A CLIPVisionModelWithProjection folder, or a full CLIPModel's (its vision_config, whose `projection_dim`
        sizes the head, as transformers reads it), as float32 parameters."""
        config, full = vision_config(Path(path))
        abstract = abstract_network(cls, config)

        def rename(key: str) -> str | None:  # transformers 5's unprefixed tower keys get the prefix
            if full and key.startswith(TEXT):
                return None
            return key if key.startswith((PREFIX, "visual_projection.")) else PREFIX + key

        weights = weight_files(Path(path), WEIGHTS_FILE, variant)
        return load_safetensors(
            abstract,
            weights,
            rename=rename,
            ignore=[PREFIX + b for b in BUFFERS],
            place=place,
            layouts=LAYOUTS_WITH_PATCHES,
        )

    def __call__(
        self, pixel_values: Float[Array | np.ndarray, "b h w c"], *, interpolate_pos_encoding: bool = False
    ) -> tuple[Float[Array, "b n d"], Float[Array, "b p"]]:
        hidden, pooled = self.vision_model(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)
        return hidden, self.visual_projection(pooled)
