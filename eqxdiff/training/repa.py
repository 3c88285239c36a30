"""REPA's representation alignment (Yu et al., ICLR 2025; sihyun-yu/REPA): a diffusion transformer's tokens after
one block, through a small MLP, pulled towards a frozen DINOv2's patch tokens of the clean image by their negative
cosine similarity; the training loss adds λ times it (REPA's `--proj-coeff`, 0.5 in the paper).

The pieces, as REPA's train.py and loss.py compute them:

- `Projector`: REPA's `build_mlp`, Linear(hidden, projector_dim) · SiLU · Linear(projector_dim, projector_dim) ·
  SiLU · Linear(projector_dim, z_dim), applied to every token (projector_dim 2048 in REPA);
- `dinov2_targets`: the clean images' targets, REPA's `preprocess_raw_image` for DINOv2 (÷255, ImageNet's mean and
  std, torch's bicubic `interpolate` without antialias to 224·(resolution // 256)) then the hub tower's
  `x_norm_patchtokens` (eqxdiff.nn.Dinov2Model with `interpolate_offset=0.1`, its patch tokens);
- `repa_loss`: the mean over examples and tokens of -cos(target, projected token) (REPA's `proj_loss`).

A run trains `Aligned(network, projector, block)` (train/main.py's --repa_* flags): its state, EMA, optimizer and
checkpoints hold the projector beside the network; sampling takes `network_of(model)`, the network alone.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.nn.bicubic import resize_bicubic
from eqxdiff.nn.dinov2 import Dinov2Model
from eqxdiff.nn.layers import Dense

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # timm's IMAGENET_DEFAULT_MEAN/STD, which REPA normalises with
IMAGENET_STD = (0.229, 0.224, 0.225)


class Projector(eqx.Module):
    """REPA's projector MLP, `[..., hidden] -> [..., z_dim]`, PyTorch's default Linear init."""

    fc1: Dense
    fc2: Dense
    fc3: Dense

    def __init__(self, hidden: int, z_dim: int, projector_dim: int = 2048, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.fc1 = Dense(hidden, projector_dim, key=k1)
        self.fc2 = Dense(projector_dim, projector_dim, key=k2)
        self.fc3 = Dense(projector_dim, z_dim, key=k3)

    def __call__(self, tokens: Float[Array, "*batch hidden"]) -> Float[Array, "*batch z"]:
        return self.fc3(jax.nn.silu(self.fc2(jax.nn.silu(self.fc1(tokens)))))


class Aligned(eqx.Module):
    """A network trained with REPA: the diffusion network, the projector of its tokens after block `block` (1..depth;
    `DiT(..., tokens_after=block)`). Not callable: sampling calls `network_of(model)`, the network alone."""

    network: eqx.Module
    projector: Projector
    block: int = eqx.field(static=True)


def with_projector(make_model: Callable, *, block: int, z_dim: int, projector_dim: int) -> Callable:
    """`make_model(key) -> network` as `key -> Aligned(network, Projector(hidden, z_dim, projector_dim), block)`: the
    network drawn from `key` as without REPA, the projector from a key folded from it."""

    def make(key: PRNGKeyArray) -> Aligned:
        network = make_model(key)
        projector = Projector(network.hidden_size, z_dim, projector_dim, key=jax.random.fold_in(key, 0x4E9A))
        return Aligned(network, projector, block)

    return make


def network_of(model: Any) -> Any:
    """The diffusion network of a trained model: `Aligned`'s without its projector; any other (any callable
    network, eqxdiff.nn.DiffusionModel), itself."""
    return model.network if isinstance(model, Aligned) else model


def default_block(depth: int) -> int:
    """REPA's alignment depth scaled to a network of `depth` blocks: its --encoder-depth 8 of SiT-XL/2's 28, so
    round(depth·8/28), at least 1 (DiT-B/2's 12 blocks: 3; SiT-XL/2: 8)."""
    return max(1, round(depth * 8 / 28))


def target_size(resolution: int) -> int:
    """The side REPA resizes images to for DINOv2: 224·(resolution // 256) (256² -> 224², 512² -> 448²)."""
    if resolution < 256:
        raise ValueError(
            f"REPA resizes {resolution}² images to 224·({resolution} // 256) = 0: give images of at "
            "least 256², or the size explicitly (dinov2_targets(size=...))"
        )
    return 224 * (resolution // 256)


def dinov2_targets(
    dinov2: Dinov2Model, images: Float[Array, "b h w c"], size: int | None = None
) -> Float[Array, "b n d"]:
    """DINOv2's patch tokens of clean images with values in [0, 255] (uint8 images as float), resized to `size`²
    (default REPA's `target_size` of the width) by torch's bicubic without antialias, as REPA prepares them. Grey
    images (c = 1) are repeated to RGB."""
    images = jnp.repeat(images, 3, axis=-1) if images.shape[-1] == 1 else images
    x = (images.astype(jnp.float32) / 255 - jnp.asarray(IMAGENET_MEAN)) / jnp.asarray(IMAGENET_STD)
    side = target_size(images.shape[2]) if size is None else size
    x = resize_bicubic(x, (side, side))
    hidden, _ = dinov2(x)
    return hidden[:, dinov2.num_prefix_tokens :]


def repa_loss(targets: Float[Array, "b n d"], projected: Float[Array, "b n d"]) -> Float[Array, ""]:
    """REPA's projection loss: -cos(target, projected) per token, averaged over tokens and examples (torch's
    `normalize`: each vector divided by max(‖v‖, 1e-12))."""
    unit = lambda v: v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), 1e-12)  # noqa: E731
    return -(unit(targets.astype(jnp.float32)) * unit(projected.astype(jnp.float32))).sum(-1).mean()
