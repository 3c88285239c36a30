"""Diffusion Transformer with adaLN-Zero blocks (Peebles & Xie 2023, "Scalable Diffusion
Models with Transformers"), NHWC in and out. Initialised so the output is exactly zero."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxdiff.nn.layers import (
    Conv2d, Dense, Embedding, SelfAttention, TimestepEmbedding, layer_norm, normal, reinit,
    sincos_pos_embed_2d, xavier_uniform, zero_init,
)  # fmt: skip
from eqxdiff.nn.remat import checkpointed


def _modulate(
    x: Float[Array, "b n d"], shift: Float[Array, "b d"], scale: Float[Array, "b d"]
) -> Float[Array, "b n d"]:
    """DiT's adaLN: x·(1 + scale) + shift, broadcast over tokens."""
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(eqx.Module):
    """x += gate·Attn(adaLN(x)); x += gate·MLP(adaLN(x)); the 6 modulations come from
    SiLU(c) -> Dense, zero-initialised so the block starts as the identity (adaLN-Zero)."""

    attn: SelfAttention
    fc1: Dense
    fc2: Dense
    ada: Dense

    def __init__(self, hidden: int, num_heads: int, mlp_ratio: float, *, key: PRNGKeyArray):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        attn = SelfAttention(hidden, num_heads, key=k1)
        self.attn = eqx.tree_at(
            lambda a: (a.qkv, a.proj), attn,
            (reinit(attn.qkv, xavier_uniform, key=k2), reinit(attn.proj, xavier_uniform, key=k3)),
        )  # fmt: skip
        mlp = int(hidden * mlp_ratio)
        self.fc1 = reinit(Dense(hidden, mlp, key=k4), xavier_uniform, key=k4)
        self.fc2 = reinit(Dense(mlp, hidden, key=k5), xavier_uniform, key=k5)
        self.ada = zero_init(Dense(hidden, 6 * hidden, key=k5))

    def __call__(self, x: Float[Array, "b n d"], c: Float[Array, "b d"]) -> Float[Array, "b n d"]:
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(self.ada(jax.nn.silu(c)), 6, axis=-1)
        x = x + gate1[:, None] * self.attn(_modulate(layer_norm(x), shift1, scale1))
        mlp = self.fc2(jax.nn.gelu(self.fc1(_modulate(layer_norm(x), shift2, scale2)), approximate=True))
        return x + gate2[:, None] * mlp


class DiT(eqx.Module):
    """`model(x[b,h,w,c], t[b], cond) -> [b,h,w,c]` on `image_size`² images; `cond` is class
    labels `int32[b]` (None: the null class) or None for `num_classes=0`.

    Patchify (p×p stride-p conv) + fixed 2-D sin-cos positions (MAE), c = t_emb + y_emb
    (label table of num_classes + 1 rows, the last one null), `depth` adaLN-Zero blocks, a final
    adaLN + zero-init linear to p·p·c per token, unpatchify. Output is c channels (no learned
    sigma). DiT has no dropout, so `key` is accepted and unused.
    """

    patch_embed: Conv2d
    time_embed: TimestepEmbedding
    label_embed: Embedding | None
    blocks: list[DiTBlock]
    final_ada: Dense
    final_linear: Dense

    image_size: int = eqx.field(static=True)
    patch_size: int = eqx.field(static=True)
    in_channels: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    num_classes: int = eqx.field(static=True)
    remat: bool = eqx.field(static=True)

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        in_channels: int,
        hidden_size: int,
        depth: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        num_classes: int = 0,
        *,
        remat: bool = False,
        key: PRNGKeyArray,
    ):
        if image_size % patch_size:
            raise ValueError(f"DiT: image_size {image_size} is not divisible by patch_size {patch_size}")
        self.image_size, self.patch_size, self.in_channels = image_size, patch_size, in_channels
        self.hidden_size = hidden_size
        self.num_classes, self.remat = num_classes, remat

        kp, kt, kt1, kt2, kl, kb, kf = jax.random.split(key, 7)
        p = patch_size
        patch = Conv2d(in_channels, hidden_size, p, stride=p, padding=0, key=kp)
        self.patch_embed = reinit(patch, xavier_uniform, key=kp)
        temb = TimestepEmbedding(256, hidden_size, key=kt)
        self.time_embed = eqx.tree_at(
            lambda m: (m.fc1, m.fc2), temb,
            (reinit(temb.fc1, normal(0.02), key=kt1), reinit(temb.fc2, normal(0.02), key=kt2)),
        )  # fmt: skip
        # Row `num_classes` is the null label of classifier-free guidance.
        self.label_embed = Embedding(num_classes + 1, hidden_size, std=0.02, key=kl) if num_classes > 0 else None
        self.blocks = [DiTBlock(hidden_size, num_heads, mlp_ratio, key=k) for k in jax.random.split(kb, depth)]
        self.final_ada = zero_init(Dense(hidden_size, 2 * hidden_size, key=kf))
        self.final_linear = zero_init(Dense(hidden_size, p * p * in_channels, key=kf))

    def null_cond(self, batch_size: int) -> Int[Array, " b"] | None:
        """The "no class" condition of classifier-free guidance: label `num_classes` (the label
        table's last row) for every example; None for an unconditional model."""
        return jnp.full((batch_size,), self.num_classes, jnp.int32) if self.num_classes else None

    @classmethod
    def small(
        cls, image_size: int, in_channels: int, patch_size: int = 2, *,
        num_classes: int = 0, remat: bool = False, key: PRNGKeyArray,
    ) -> "DiT":  # fmt: skip
        """DiT-S/p: depth 12, hidden 384, 6 heads (≈33M params for S/2 at 32²×4, 1000 classes)."""
        return cls(image_size, patch_size, in_channels, 384, 12, 6, 4.0, num_classes, remat=remat, key=key)

    @classmethod
    def base(
        cls, image_size: int, in_channels: int, patch_size: int = 2, *,
        num_classes: int = 0, remat: bool = False, key: PRNGKeyArray,
    ) -> "DiT":  # fmt: skip
        """DiT-B/p: depth 12, hidden 768, 12 heads (≈130M params for B/2 at 32²×4, 1000 classes)."""
        return cls(image_size, patch_size, in_channels, 768, 12, 12, 4.0, num_classes, remat=remat, key=key)

    def __call__(
        self,
        x: Float[Array, "b h w c"],
        t: Float[Array, " b"],
        cond: Int[Array, " b"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "b h w c"]:
        b, h, w, c = x.shape
        if (h, w, c) != (self.image_size, self.image_size, self.in_channels):
            raise ValueError(
                f"DiT was built for [b, {self.image_size}, {self.image_size}, {self.in_channels}] inputs; got {x.shape}"
            )
        p, g = self.patch_size, self.image_size // self.patch_size
        tokens = self.patch_embed(x).reshape(b, g * g, self.hidden_size)
        tokens = tokens + jnp.asarray(sincos_pos_embed_2d(self.hidden_size, g), tokens.dtype)

        emb = self.time_embed(t)
        if self.label_embed is not None:
            labels = self.null_cond(b) if cond is None else cond
            emb = emb + self.label_embed(labels).astype(emb.dtype)
        elif cond is not None:
            raise ValueError("A condition (labels) was given to an unconditional DiT (num_classes=0).")

        for blk in self.blocks:
            tokens = checkpointed(blk, self.remat)(tokens, emb)
        shift, scale = jnp.split(self.final_ada(jax.nn.silu(emb)), 2, axis=-1)
        out = self.final_linear(_modulate(layer_norm(tokens), shift, scale))
        # Unpatchify: token (gi, gj) holds its p×p×c patch in (pi, pj, c) order.
        out = out.reshape(b, g, g, p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        return out.astype(x.dtype)
