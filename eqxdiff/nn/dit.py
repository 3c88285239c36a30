"""Diffusion Transformer with adaLN-Zero blocks (Peebles & Xie 2023, "Scalable Diffusion
Models with Transformers"), NHWC in and out. Initialised so the output is exactly zero.
A text DiT (`context_dim > 0`) adds PixArt-α's cross-attention (Chen et al. 2023) to each block."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqxdiff.nn.layers import (
    Conv2d,
    CrossAttention,
    Dense,
    Embedding,
    SelfAttention,
    TimestepEmbedding,
    TwoTimeEmbedding,
    embed_times,
    layer_norm,
    normal,
    reinit,
    sincos_pos_embed_2d,
    unpack_text_cond,
    xavier_uniform,
    zero_init,
)
from eqxdiff.nn.remat import checkpointed


def _modulate(
    x: Float[Array, "b n d"], shift: Float[Array, "b d"], scale: Float[Array, "b d"]
) -> Float[Array, "b n d"]:
    """DiT's adaLN: x·(1 + scale) + shift, broadcast over tokens."""
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(eqx.Module):
    """x += gate·Attn(adaLN(x)); x += gate·MLP(adaLN(x)); the 6 modulations come from
    SiLU(c) -> Dense, zero-initialised so the block starts as the identity (adaLN-Zero).

    With `context_dim > 0` (PixArt-α's block), between the two: x += CrossAttn(LN(x), context
    [b, m, context_dim], mask [b, m]), LN without affine (the query projection absorbs it),
    ungated as in PixArt-α, its out-proj zero-initialised so the block still starts as the
    identity. Its key is folded from the block's, which leaves the rest of the init as without text.
    """

    attn: SelfAttention
    cross: CrossAttention | None
    fc1: Dense
    fc2: Dense
    ada: Dense

    def __init__(self, hidden: int, num_heads: int, mlp_ratio: float, *, context_dim: int = 0, key: PRNGKeyArray):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        attn = SelfAttention(hidden, num_heads, key=k1)
        self.attn = eqx.tree_at(
            lambda a: (a.qkv, a.proj),
            attn,
            (reinit(attn.qkv, xavier_uniform, key=k2), reinit(attn.proj, xavier_uniform, key=k3)),
        )
        mlp = int(hidden * mlp_ratio)
        self.fc1 = reinit(Dense(hidden, mlp, key=k4), xavier_uniform, key=k4)
        self.fc2 = reinit(Dense(mlp, hidden, key=k5), xavier_uniform, key=k5)
        self.ada = zero_init(Dense(hidden, 6 * hidden, key=k5))
        self.cross = None
        if context_dim:
            kc, kq, kkv = jax.random.split(jax.random.fold_in(key, 1), 3)
            cross = CrossAttention(hidden, context_dim, num_heads, key=kc)
            self.cross = eqx.tree_at(
                lambda a: (a.q, a.kv, a.proj),
                cross,
                (
                    reinit(cross.q, xavier_uniform, key=kq),
                    reinit(cross.kv, xavier_uniform, key=kkv),
                    zero_init(cross.proj),
                ),
            )

    def __call__(
        self,
        x: Float[Array, "b n d"],
        c: Float[Array, "b d"],
        *,
        context: Float[Array, "b m e"] | None = None,
        mask: Int[Array, "b m"] | Bool[Array, "b m"] | None = None,
    ) -> Float[Array, "b n d"]:
        if (context is None) != (self.cross is None):
            has = "has cross-attention" if self.cross is not None else "was built with context_dim=0"
            raise ValueError(f"DiTBlock: pass `context` exactly when the block has cross-attention; this one {has}")
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(self.ada(jax.nn.silu(c)), 6, axis=-1)
        x = x + gate1[:, None] * self.attn(_modulate(layer_norm(x), shift1, scale1))
        if self.cross is not None:
            x = x + self.cross(layer_norm(x), context, mask)
        mlp = self.fc2(jax.nn.gelu(self.fc1(_modulate(layer_norm(x), shift2, scale2)), approximate=True))
        return x + gate2[:, None] * mlp


class DiT(eqx.Module):
    """`model(x[b,h,w,c], t[b], cond) -> [b,h,w,c]` on `image_size`² images; `cond` is class
    labels `int32[b]` (None: the null class), None for an unconditional DiT, or for a text DiT
    (`context_dim > 0`) a `TextCond(context f32[b, n, context_dim], mask int32[b, n] (1 = token,
    0 = padding), pooled f32[b, pooled_dim], None when pooled_dim = 0)`.

    Patchify (p×p stride-p conv) + fixed 2-D sin-cos positions (MAE), c = t_emb + y_emb
    (label table of num_classes + 1 rows, the last one null), `depth` adaLN-Zero blocks, a final
    adaLN + zero-init linear to p·p·c per token, unpatchify. Output is c channels, or with
    `learn_sigma` 2c (the published DiTs): channels [..., :c] are the ε prediction and [..., c:]
    the iDDPM variance interpolation v (log σ² = (v+1)/2·log β + (1-v)/2·log β̃), so eqxdiff's
    denoisers and samplers, which know no learned variance, use the first c channels only.
    DiT has no dropout, so `key` is accepted and unused.

    Text (PixArt-α): the context goes through PixArt's caption projection (Dense -> GELU(tanh)
    -> Dense to hidden_size, weights N(0, 0.02²)), then every block cross-attends to it (see
    `DiTBlock`); `pooled` goes through a zero-initialised Dense(pooled_dim -> hidden_size) added
    to the time embedding, so the adaLN modulations see it. One kind of condition per model.

    A network of two times (`interval_embedding=True`, MeanFlow's: Geng et al. 2025, Gsunshine/meanflow's
    `h_embedder`) also takes `interval` = t − r in the units of t, embedded by a second timestep embedding (its own
    weights, initialised as the first) and added to c: c = t_emb + interval_emb + y_emb. Called without `interval`
    it is the network at r = t (interval 0), the instantaneous velocity. Its `time_embed` is then a
    `TwoTimeEmbedding` (t's embedding as `.time`); without the option the module is as it was, leaf for leaf, and the
    other weights are drawn alike either way.

    `tokens_after=k` (REPA, Yu et al. 2025: the representation a projector aligns) also returns the tokens after block
    k of 1..depth, `[b, (h/p)·(w/p), hidden]` in the patch grid's row-major order: `(output, tokens)`. The call
    without it, the parameters and checkpoints are as they were. SiT is this network (eqxdiff/pretrained/sit.py).
    """

    patch_embed: Conv2d
    time_embed: TimestepEmbedding | TwoTimeEmbedding
    label_embed: Embedding | None
    context_embed: tuple[Dense, Dense] | None
    pooled_embed: Dense | None
    blocks: list[DiTBlock]
    final_ada: Dense
    final_linear: Dense

    image_size: int = eqx.field(static=True)
    patch_size: int = eqx.field(static=True)
    in_channels: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    num_classes: int = eqx.field(static=True)
    context_dim: int = eqx.field(static=True)
    pooled_dim: int = eqx.field(static=True)
    remat: bool = eqx.field(static=True)
    learn_sigma: bool = eqx.field(static=True)

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
        context_dim: int = 0,
        pooled_dim: int = 0,
        learn_sigma: bool = False,
        interval_embedding: bool = False,
        key: PRNGKeyArray,
    ):
        if image_size % patch_size:
            raise ValueError(f"DiT: image_size {image_size} is not divisible by patch_size {patch_size}")
        if num_classes > 0 and (context_dim > 0 or pooled_dim > 0):
            raise ValueError(
                f"DiT: one kind of condition per model: num_classes={num_classes} (labels) or "
                f"context_dim={context_dim}/pooled_dim={pooled_dim} (text), not both"
            )
        if pooled_dim > 0 and context_dim <= 0:
            raise ValueError(f"DiT: pooled_dim={pooled_dim} needs a text context too (context_dim > 0)")
        self.image_size, self.patch_size, self.in_channels = image_size, patch_size, in_channels
        self.hidden_size = hidden_size
        self.num_classes, self.context_dim, self.pooled_dim, self.remat = num_classes, context_dim, pooled_dim, remat
        self.learn_sigma = learn_sigma

        kp, kt, kt1, kt2, kl, kb, kf = jax.random.split(key, 7)
        p = patch_size
        patch = Conv2d(in_channels, hidden_size, p, stride=p, padding=0, key=kp)
        self.patch_embed = reinit(patch, xavier_uniform, key=kp)
        temb = TimestepEmbedding(256, hidden_size, key=kt)
        self.time_embed = eqx.tree_at(
            lambda m: (m.fc1, m.fc2),
            temb,
            (reinit(temb.fc1, normal(0.02), key=kt1), reinit(temb.fc2, normal(0.02), key=kt2)),
        )
        if interval_embedding:  # its own key, folded: every other layer's init stays as in a network of one time
            ki, ki1, ki2 = jax.random.split(jax.random.fold_in(key, 2), 3)
            iemb = TimestepEmbedding(256, hidden_size, key=ki)
            iemb = eqx.tree_at(
                lambda m: (m.fc1, m.fc2),
                iemb,
                (reinit(iemb.fc1, normal(0.02), key=ki1), reinit(iemb.fc2, normal(0.02), key=ki2)),
            )
            self.time_embed = TwoTimeEmbedding(self.time_embed, iemb)
        # Row `num_classes` is the null label of classifier-free guidance.
        self.label_embed = Embedding(num_classes + 1, hidden_size, std=0.02, key=kl) if num_classes > 0 else None
        self.context_embed, self.pooled_embed = None, None
        if context_dim:
            # Text layers draw from a key folded from `key`: the other layers' init stays as without text.
            kc1, kc2, kpool = jax.random.split(jax.random.fold_in(key, 1), 3)
            fc1, fc2 = Dense(context_dim, hidden_size, key=kc1), Dense(hidden_size, hidden_size, key=kc2)
            self.context_embed = (reinit(fc1, normal(0.02), key=kc1), reinit(fc2, normal(0.02), key=kc2))
            self.pooled_embed = zero_init(Dense(pooled_dim, hidden_size, key=kpool)) if pooled_dim else None
        block_context = hidden_size if context_dim else 0  # blocks attend to the projected context
        self.blocks = [
            DiTBlock(hidden_size, num_heads, mlp_ratio, context_dim=block_context, key=k)
            for k in jax.random.split(kb, depth)
        ]
        self.final_ada = zero_init(Dense(hidden_size, 2 * hidden_size, key=kf))
        out_channels = 2 * in_channels if learn_sigma else in_channels
        self.final_linear = zero_init(Dense(hidden_size, p * p * out_channels, key=kf))

    def null_cond(self, batch_size: int) -> Int[Array, " b"] | None:
        """The "no class" condition of classifier-free guidance: label `num_classes` (the label
        table's last row) for every example; None for an unconditional model.

        None for a text model too: its null condition is the text encoder's output for "" (or
        zeros), which depends on the encoder the run uses, not on the DiT, so the training
        script builds it and passes it as `cond` (to condition dropout and guidance)."""
        return jnp.full((batch_size,), self.num_classes, jnp.int32) if self.num_classes else None

    @classmethod
    def small(
        cls,
        image_size: int,
        in_channels: int,
        patch_size: int = 2,
        *,
        num_classes: int = 0,
        remat: bool = False,
        context_dim: int = 0,
        pooled_dim: int = 0,
        interval_embedding: bool = False,
        key: PRNGKeyArray,
    ) -> "DiT":
        """DiT-S/p: depth 12, hidden 384, 6 heads (≈33M params for S/2 at 32²×4, 1000 classes)."""
        return cls(
            image_size,
            patch_size,
            in_channels,
            384,
            12,
            6,
            4.0,
            num_classes,
            remat=remat,
            context_dim=context_dim,
            pooled_dim=pooled_dim,
            interval_embedding=interval_embedding,
            key=key,
        )

    @classmethod
    def base(
        cls,
        image_size: int,
        in_channels: int,
        patch_size: int = 2,
        *,
        num_classes: int = 0,
        remat: bool = False,
        context_dim: int = 0,
        pooled_dim: int = 0,
        interval_embedding: bool = False,
        key: PRNGKeyArray,
    ) -> "DiT":
        """DiT-B/p: depth 12, hidden 768, 12 heads (≈130M params for B/2 at 32²×4, 1000 classes)."""
        return cls(
            image_size,
            patch_size,
            in_channels,
            768,
            12,
            12,
            4.0,
            num_classes,
            remat=remat,
            context_dim=context_dim,
            pooled_dim=pooled_dim,
            interval_embedding=interval_embedding,
            key=key,
        )

    def __call__(
        self,
        x: Float[Array, "b h w c"],
        t: Float[Array, " b"],
        cond: Any = None,  # int32[b] labels, a TextCond or None: checked below, by kind of model
        *,
        key: PRNGKeyArray | None = None,
        interval: Float[Array, " b"] | None = None,  # t − r, a network of two times only (interval_embedding)
        tokens_after: int | None = None,  # k in 1..depth: also return the tokens after block k (REPA's alignment)
    ) -> (  # 2c with learn_sigma; with tokens_after: (the output, the tokens after that block)
        Float[Array, "b h w c"] | Float[Array, "b h w 2*c"] | tuple[Float[Array, "b h w oc"], Float[Array, "b n d"]]
    ):
        b, h, w, c = x.shape
        if tokens_after is not None and not 1 <= tokens_after <= len(self.blocks):
            raise ValueError(f"DiT: tokens_after={tokens_after}, a block in 1..{len(self.blocks)} (the depth)")
        if (h, w, c) != (self.image_size, self.image_size, self.in_channels):
            raise ValueError(
                f"DiT was built for [b, {self.image_size}, {self.image_size}, {self.in_channels}] inputs; got {x.shape}"
            )
        p, g = self.patch_size, self.image_size // self.patch_size
        tokens = self.patch_embed(x).reshape(b, g * g, self.hidden_size)
        tokens = tokens + jnp.asarray(sincos_pos_embed_2d(self.hidden_size, g), tokens.dtype)

        emb = embed_times(self.time_embed, t, interval, "DiT")
        text: dict[str, Any] = {}  # the blocks' context and mask, for a text DiT
        if self.context_embed is not None:
            context, mask, pooled = unpack_text_cond(cond, b, self.context_dim, self.pooled_dim, "DiT")
            fc1, fc2 = self.context_embed
            text = {"context": fc2(jax.nn.gelu(fc1(context), approximate=True)), "mask": mask}
            if self.pooled_embed is not None:
                emb = emb + self.pooled_embed(pooled).astype(emb.dtype)
        elif self.label_embed is not None:
            if cond is not None and not eqx.is_array(cond):
                raise ValueError(f"A label DiT (num_classes > 0) takes int32[b] labels, got {type(cond).__name__}.")
            labels = self.null_cond(b) if cond is None else cond
            emb = emb + self.label_embed(labels).astype(emb.dtype)
        elif cond is not None:
            raise ValueError("A condition was given to an unconditional DiT (num_classes=0, context_dim=0).")

        after = None  # the tokens after block `tokens_after`
        for i, blk in enumerate(self.blocks, 1):
            tokens = checkpointed(blk, self.remat)(tokens, emb, **text)
            after = tokens if i == tokens_after else after
        shift, scale = jnp.split(self.final_ada(jax.nn.silu(emb)), 2, axis=-1)
        out = self.final_linear(_modulate(layer_norm(tokens), shift, scale))
        oc = 2 * c if self.learn_sigma else c
        # Unpatchify: token (gi, gj) holds its p×p×oc patch in (pi, pj, oc) order.
        out = out.reshape(b, g, g, p, p, oc).transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, oc).astype(x.dtype)
        return out if tokens_after is None else (out, after)
