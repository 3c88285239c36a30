"""transformers' `Dinov2Model` and `Dinov2WithRegistersModel` (Oquab et al. 2023; Darcet et al. 2024, DINOv2's
vision towers) in Equinox, loading the folders people have (config.json + model.safetensors as transformers
saves them: facebook/dinov2-{small,base,large,giant}, facebook/dinov2-with-registers-*).

A pre-LayerNorm ViT: patch embedding (a stride-`patch_size` conv), a CLS token, the position embeddings (resized
bicubically when the image's patch grid is not the stored one), registers after the CLS token, blocks of
`x + ls1·attn(norm1(x))`, `x + ls2·mlp(norm2(x))` (the MLP GELU, or SwiGLU for ViT-g), a final LayerNorm. Field
names are the saved keys (`encoder.layer.<i>.attention.attention.query`, SwiGLU's fused `mlp.weights_in`), so
leaf paths are state_dict keys.

The position embeddings are resized as transformers 5 does (`size=`: torch's bicubic without antialias; with
antialias for the registers model), or, with `interpolate_offset=0.1`, as facebookresearch/dinov2's hub models do
(the `scale_factor` (n + 0.1)/M kludge: another sampling step), which is what EDM2's FD-DINOv2 and REPA run.
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
from eqxdiff.nn.clip_text import LayerNorm, gelu
from eqxdiff.nn.layers import Conv2d, Dense
from eqxdiff.nn.torch_weights import Place, load_safetensors
from eqxdiff.weights.weight_files import weight_files

WEIGHTS_FILE = "model.safetensors"
MODEL_TYPES = ("dinov2", "dinov2_with_registers")
# transformers' Dinov2Config defaults, for the fields that shape the network (registers: its own config's).
DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "mlp_ratio": 4,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-6,
    "image_size": 224,
    "patch_size": 14,
    "num_channels": 3,
    "qkv_bias": True,
    "layerscale_value": 1.0,
    "use_swiglu_ffn": False,
    "use_mask_token": True,
    "num_register_tokens": 0,
}
REGISTER_DEFAULTS = {"patch_size": 16, "num_register_tokens": 4}  # Dinov2WithRegistersConfig's own
# Fields with no effect on this forward pass: metadata, init and dropout (inference only), and the backbone's
# outputs (Dinov2Backbone's feature maps, not this model's).
IGNORED = {
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "initializer_range",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "drop_path_rate",
    "apply_layernorm",
    "reshape_hidden_states",
    "out_features",
    "out_indices",
    "stage_names",
    "id2label",
    "label2id",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "torchscript",
    "use_bfloat16",
    "pruned_heads",
    "tie_word_embeddings",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "problem_type",
}


def parse_config(config: dict) -> dict:
    """transformers' Dinov2Config (or Dinov2WithRegistersConfig) fields that shape the network, defaults filled
    in; an option this port does not implement raises a ValueError naming it."""
    model_type = config.get("model_type", "dinov2")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r}: only DINOv2 towers ({', '.join(MODEL_TYPES)}) load here")
    unknown = sorted(k for k in config if k not in DEFAULTS and k not in IGNORED and not k.startswith("_"))
    if unknown:
        raise ValueError(f"Dinov2Model config options not supported: {unknown}")
    defaults = DEFAULTS | (REGISTER_DEFAULTS if model_type == "dinov2_with_registers" else {})
    cfg = {**defaults, **{k: v for k, v in config.items() if k in DEFAULTS}, "model_type": model_type}
    if model_type == "dinov2":
        cfg["num_register_tokens"] = 0  # Dinov2Model has none, whatever the field says
    else:
        cfg["use_mask_token"] = True  # the registers model always carries its mask token
    if cfg["hidden_act"] != "gelu" and not cfg["use_swiglu_ffn"]:
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} not supported: DINOv2's MLP is 'gelu' (or SwiGLU)")
    for field in ("image_size", "patch_size"):
        if type(cfg[field]) is not int:
            raise ValueError(f"{field} {cfg[field]!r} not supported: one int (square images and patches)")
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise ValueError(
            f"hidden_size {cfg['hidden_size']} is not divisible by num_attention_heads {cfg['num_attention_heads']}"
        )
    return cfg


def mlp_width(cfg: dict) -> int:
    """The MLP's hidden width: hidden_size·mlp_ratio; SwiGLU keeps 2/3 of it, rounded up to a multiple of 8."""
    width = int(cfg["hidden_size"] * cfg["mlp_ratio"])
    return (int(width * 2 / 3) + 7) // 8 * 8 if cfg["use_swiglu_ffn"] else width


class Dinov2PatchEmbeddings(eqx.Module):
    """`[b, h, w, c] -> [b, (h/p)(w/p), d]`: a p×p stride-p convolution, patches in row-major order."""

    projection: Conv2d

    def __call__(self, x: Float[Array, "b h w c"]) -> Float[Array, "b n d"]:
        y = self.projection(x)
        return y.reshape(y.shape[0], -1, y.shape[-1])


class Dinov2Embeddings(eqx.Module):
    """CLS token, patch embeddings + (resized) position embeddings, then the registers after the CLS token."""

    cls_token: Float[Array, "1 1 d"]
    mask_token: Float[Array, "1 d"] | None  # masked-image pre-training's token: loaded, never used here
    position_embeddings: Float[Array, "1 m d"]
    register_tokens: Float[Array, "1 r d"] | None
    patch_embeddings: Dinov2PatchEmbeddings
    patch_size: int = eqx.field(static=True)
    antialias: bool = eqx.field(static=True)
    interpolate_offset: float = eqx.field(static=True)

    def positions(self, grid_h: int, grid_w: int) -> Float[Array, "1 m2 d"]:
        """The position embeddings for a grid_h × grid_w patch grid: the stored ones on their own (square) grid,
        else their patch part resized bicubically as transformers (offset 0) or dinov2's hub (offset 0.1) does."""
        stored = self.position_embeddings
        side = int(round((stored.shape[1] - 1) ** 0.5))
        if grid_h == grid_w == side:
            return stored
        grid = stored[:, 1:].reshape(1, side, side, -1)
        if self.interpolate_offset:  # torch gets scale_factor (n + offset)/M: n outputs, sampled at M/(n + offset)
            factors = ((grid_h + self.interpolate_offset) / side, (grid_w + self.interpolate_offset) / side)
            sizes = tuple(int(np.floor(side * f)) for f in factors)
            if sizes != (grid_h, grid_w):
                raise ValueError(
                    f"interpolate_offset {self.interpolate_offset} gives a {sizes} grid, not {(grid_h, grid_w)}"
                )
            resized = resize_bicubic(grid, (grid_h, grid_w), scale_factor=factors, antialias=self.antialias)
        else:
            resized = resize_bicubic(grid, (grid_h, grid_w), antialias=self.antialias)
        return jnp.concatenate([stored[:, :1], resized.reshape(1, grid_h * grid_w, -1)], axis=1)

    def __call__(self, x: Float[Array, "b h w c"]) -> Float[Array, "b n d"]:
        b, h, w, _ = x.shape
        patches = self.patch_embeddings(x)
        tokens = jnp.concatenate([jnp.broadcast_to(self.cls_token, (b, 1, patches.shape[-1])), patches], axis=1)
        tokens = tokens + self.positions(h // self.patch_size, w // self.patch_size)
        if self.register_tokens is None:
            return tokens
        registers = jnp.broadcast_to(self.register_tokens, (b, *self.register_tokens.shape[1:]))
        return jnp.concatenate([tokens[:, :1], registers, tokens[:, 1:]], axis=1)


class Dinov2SelfAttention(eqx.Module):
    """The query, key and value projections (a module of their own: keys read `attention.attention.query`)."""

    query: Dense
    key: Dense
    value: Dense


class Dinov2SelfOutput(eqx.Module):
    dense: Dense


class Dinov2Attention(eqx.Module):
    """Multi-head self-attention over all tokens, `[b, n, d] -> [b, n, d]`; softmax in float32."""

    attention: Dinov2SelfAttention
    output: Dinov2SelfOutput
    num_heads: int = eqx.field(static=True)

    def __call__(self, x: Float[Array, "b n d"]) -> Float[Array, "b n d"]:
        b, n, d = x.shape
        heads = lambda t: t.reshape(b, n, self.num_heads, d // self.num_heads)  # noqa: E731
        q, k, v = (heads(p(x)) for p in (self.attention.query, self.attention.key, self.attention.value))
        return self.output.dense(jax.nn.dot_product_attention(q, k, v).reshape(b, n, d))


class Dinov2LayerScale(eqx.Module):
    lambda1: Float[Array, " d"]

    def __call__(self, x: Float[Array, "*batch d"]) -> Float[Array, "*batch d"]:
        return x * self.lambda1


class Dinov2MLP(eqx.Module):
    """fc2(GELU(fc1(x))), the exact GELU."""

    fc1: Dense
    fc2: Dense

    def __call__(self, x: Float[Array, "*batch d"]) -> Float[Array, "*batch d"]:
        return self.fc2(gelu(self.fc1(x)))


class Dinov2SwiGLUFFN(eqx.Module):
    """ViT-g's MLP: weights_out(SiLU(x₁)·x₂), x₁, x₂ the two halves of weights_in(x) (transformers' gate and up)."""

    weights_in: Dense
    weights_out: Dense

    def __call__(self, x: Float[Array, "*batch d"]) -> Float[Array, "*batch d"]:
        gate, up = jnp.split(self.weights_in(x), 2, axis=-1)
        return self.weights_out(jax.nn.silu(gate) * up)


class Dinov2Layer(eqx.Module):
    """x + ls1·attn(norm1(x)), then x + ls2·mlp(norm2(x))."""

    norm1: LayerNorm
    attention: Dinov2Attention
    layer_scale1: Dinov2LayerScale
    norm2: LayerNorm
    mlp: Dinov2MLP | Dinov2SwiGLUFFN
    layer_scale2: Dinov2LayerScale

    def __init__(self, cfg: dict, *, key: PRNGKeyArray):
        kq, kk, kv, ko, k1, k2 = jax.random.split(key, 6)
        d, eps, bias = cfg["hidden_size"], cfg["layer_norm_eps"], cfg["qkv_bias"]
        self.norm1, self.norm2 = LayerNorm(d, eps), LayerNorm(d, eps)
        projections = (Dense(d, d, use_bias=bias, key=k) for k in (kq, kk, kv))
        self.attention = Dinov2Attention(
            Dinov2SelfAttention(*projections), Dinov2SelfOutput(Dense(d, d, key=ko)), cfg["num_attention_heads"]
        )
        scale = jax.device_put(np.full(d, cfg["layerscale_value"], np.float32))
        self.layer_scale1, self.layer_scale2 = Dinov2LayerScale(scale), Dinov2LayerScale(scale)
        width = mlp_width(cfg)
        if cfg["use_swiglu_ffn"]:
            self.mlp = Dinov2SwiGLUFFN(Dense(d, 2 * width, key=k1), Dense(width, d, key=k2))
        else:
            self.mlp = Dinov2MLP(Dense(d, width, key=k1), Dense(width, d, key=k2))

    def __call__(self, x: Float[Array, "b n d"]) -> Float[Array, "b n d"]:
        x = x + self.layer_scale1(self.attention(self.norm1(x)))
        return x + self.layer_scale2(self.mlp(self.norm2(x)))


class Dinov2Encoder(eqx.Module):
    """The stack of blocks (a module of its own so that keys read `encoder.layer.<i>.…`)."""

    layer: list[Dinov2Layer]


class Dinov2Model(eqx.Module):
    """transformers' `Dinov2Model` / `Dinov2WithRegistersModel`: normalised images `[b, h, w, c]` (NHWC; h, w
    multiples of patch_size, else the remainder is cut as torch's conv cuts it) -> (last_hidden_state
    `[b, 1 + registers + patches, d]` after the final LayerNorm, pooler_output `[b, d]`: its CLS token).

    The patch tokens are `last_hidden_state[:, model.num_prefix_tokens:]`, row-major over the (h/p) × (w/p)
    grid (dinov2's `x_norm_patchtokens`); pooler_output is its `x_norm_clstoken`. Build with
    `from_transformers(folder)` (weights) or `from_config(config, key=...)` (random).
    """

    embeddings: Dinov2Embeddings
    encoder: Dinov2Encoder
    layernorm: LayerNorm

    def __init__(self, config: dict, *, key: PRNGKeyArray, interpolate_offset: float = 0.0):
        cfg = parse_config(config)
        k_cls, k_pos, k_reg, k_patch, *k_layers = jax.random.split(key, 4 + cfg["num_hidden_layers"])
        d, p, r = cfg["hidden_size"], cfg["patch_size"], cfg["num_register_tokens"]
        grid = cfg["image_size"] // p
        normal = lambda k, shape: 0.02 * jax.random.normal(k, shape)  # noqa: E731 — transformers' init std
        self.embeddings = Dinov2Embeddings(
            cls_token=normal(k_cls, (1, 1, d)),
            mask_token=jnp.zeros((1, d)) if cfg["use_mask_token"] else None,
            position_embeddings=normal(k_pos, (1, grid * grid + 1, d)),
            register_tokens=normal(k_reg, (1, r, d)) if r else None,
            patch_embeddings=Dinov2PatchEmbeddings(Conv2d(cfg["num_channels"], d, p, stride=p, padding=0, key=k_patch)),
            patch_size=p,
            antialias=cfg["model_type"] == "dinov2_with_registers",  # transformers' two interpolate calls differ
            interpolate_offset=interpolate_offset,
        )
        self.encoder = Dinov2Encoder([Dinov2Layer(cfg, key=k) for k in k_layers])
        self.layernorm = LayerNorm(d, cfg["layer_norm_eps"])

    @classmethod
    def from_config(cls, config: dict, *, key: PRNGKeyArray, interpolate_offset: float = 0.0) -> "Dinov2Model":
        """Random weights for a transformers Dinov2Config (or Dinov2WithRegistersConfig) dict."""
        return cls(config, key=key, interpolate_offset=interpolate_offset)

    @classmethod
    def from_transformers(
        cls,
        path: str | Path,
        *,
        interpolate_offset: float = 0.0,
        variant: str | None = None,
        place: Place | None = None,
    ) -> "Dinov2Model":
        """A transformers DINOv2 folder (config.json + model.safetensors, or its index's shards; fp32/fp16/bf16)
        as float32 parameters. `interpolate_offset`: 0 resizes position embeddings as transformers does, 0.1 as
        facebookresearch/dinov2's hub models (EDM2's FD-DINOv2, REPA). `variant`, `place` as in
        `CLIPTextModel.from_transformers`."""
        config = json.loads((Path(path) / "config.json").read_text())
        abstract = abstract_network(cls, config, interpolate_offset=interpolate_offset)
        return load_safetensors(abstract, weight_files(path, WEIGHTS_FILE, variant), place=place)

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patch tokens: the CLS token and the registers."""
        registers = self.embeddings.register_tokens
        return 1 + (0 if registers is None else registers.shape[1])

    @property
    def patch_size(self) -> int:
        return self.embeddings.patch_size

    def __call__(
        self, pixel_values: Float[Array | np.ndarray, "b h w c"]
    ) -> tuple[Float[Array, "b n d"], Float[Array, "b d"]]:
        """(last_hidden_state, pooler_output) of normalised images (transformers' pixel_values, NHWC)."""
        b, h, w, _ = pixel_values.shape
        if h < self.patch_size or w < self.patch_size:
            raise ValueError(f"Dinov2Model: images {h}×{w} are smaller than one {self.patch_size}² patch")
        x = self.embeddings(jnp.asarray(pixel_values, jnp.float32))
        for layer in self.encoder.layer:
            x = layer(x)
        x = self.layernorm(x)
        return x, x[:, 0]
