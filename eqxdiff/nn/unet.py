"""ADM-style convolutional UNet (Ho et al. 2020; Dhariwal & Nichol 2021), NHWC.

The topology follows FlaxDiff's `simple_unet.Unet` (0.2.x) so that `UNet.flaxdiff_simple`
reproduces its parameter count exactly; the blocks themselves are ADM's (GroupNorm-SiLU-conv
residual blocks with the embedding added, zero-initialised last convs). A text UNet
(`context_dim > 0`) also cross-attends to a text context in its attention blocks (LDM, Rombach
et al. 2022) and may add a pooled text vector to the time embedding.
"""

import itertools
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqxdiff.nn.bias import add_bias, affine
from eqxdiff.nn.layers import (
    Conv2d,
    CrossAttention,
    Dense,
    Embedding,
    GroupNorm,
    SelfAttention,
    TimestepEmbedding,
    TwoTimeEmbedding,
    embed_times,
    layer_norm,
    sincos_pos_embed_2d,
    unpack_text_cond,
    zero_init,
)
from eqxdiff.nn.remat import checkpointed
from eqxdiff.nn.upsample import nearest_upsample_conv


class ResBlock(eqx.Module):
    """x + conv(drop(SiLU(GN(conv(SiLU(GN(x))) + Dense(emb))))), `[b,h,w,cin] -> [b,h,w,cout]`.

    With `scale_shift`, the embedding instead modulates the second norm: GN(h)·(1+s) + b (ADM).
    """

    norm1: GroupNorm
    conv1: Conv2d
    emb_proj: Dense
    norm2: GroupNorm
    conv2: Conv2d
    skip: Conv2d | None
    dropout: float = eqx.field(static=True)
    scale_shift: bool = eqx.field(static=True)

    def __init__(
        self, cin: int, cout: int, emb: int, groups: int, dropout: float, scale_shift: bool, *, key: PRNGKeyArray
    ):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.norm1, self.conv1 = GroupNorm(groups, cin), Conv2d(cin, cout, key=k1)
        self.emb_proj = Dense(emb, 2 * cout if scale_shift else cout, key=k2)
        # Zero-init the last conv so each block starts as the identity (ADM's zero_module).
        self.norm2, self.conv2 = GroupNorm(groups, cout), zero_init(Conv2d(cout, cout, key=k3))
        self.skip = Conv2d(cin, cout, 1, key=k4) if cin != cout else None
        self.dropout, self.scale_shift = dropout, scale_shift

    def __call__(
        self, x: Float[Array, "b h w ci"], emb: Float[Array, "b e"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "b h w co"]:
        h = self.conv1(jax.nn.silu(self.norm1(x)))
        e = self.emb_proj(emb)[:, None, None, :]
        if self.scale_shift:
            scale, shift = jnp.split(e, 2, axis=-1)
            h = affine(self.norm2(h), 1 + scale, shift)
        else:
            h = self.norm2(add_bias(h, e))
        h = jax.nn.silu(h)
        if key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, h.shape)
            h = jnp.where(keep, h / (1.0 - self.dropout), jnp.zeros((), h.dtype))
        return self.conv2(h) + (x if self.skip is None else self.skip(x)).astype(h.dtype)


class AttnBlock(eqx.Module):
    """x + Attn(GN(x)) over the h*w pixels as tokens, `[b,h,w,c] -> [b,h,w,c]`; out-proj zero-init.

    With `context_dim > 0` (a text UNet) the pixels then also attend to the text:
    x + CrossAttn(LN(x) + pos, context [b, m, context_dim], mask [b, m]), LN per pixel without
    affine (the query projection absorbs it), the cross-attention's out-proj zero-initialised
    too, so the block still starts as the identity. `pos` is the pixel's fixed 2-D sin-cos
    position (MAE's): convolutions are translation-equivariant, so without it a shallow UNet has
    almost no way to bind "left"/"right" in a caption to places (deep ones learn position from
    the zero padding). Its key is folded from the block's, which leaves the self-attention's
    init as without text.

    `self_attention=False` (text only) keeps just the cross-attention: self-attention's cost
    grows with (h·w)², and on large maps (8×16 already, on a CPU) it is most of a step.
    """

    norm: GroupNorm | None
    attn: SelfAttention | None
    cross: CrossAttention | None

    def __init__(
        self,
        channels: int,
        groups: int,
        num_heads: int,
        *,
        context_dim: int = 0,
        self_attention: bool = True,
        key: PRNGKeyArray,
    ):
        if not (self_attention or context_dim):
            raise ValueError("AttnBlock: without self-attention a block needs a text context (context_dim > 0)")
        self.norm, self.attn = None, None
        if self_attention:
            self.norm = GroupNorm(groups, channels)
            attn = SelfAttention(channels, num_heads, key=key)
            self.attn = eqx.tree_at(lambda a: a.proj, attn, zero_init(attn.proj))
        self.cross = None
        if context_dim:
            cross = CrossAttention(channels, context_dim, num_heads, key=jax.random.fold_in(key, 1))
            self.cross = eqx.tree_at(lambda a: a.proj, cross, zero_init(cross.proj))

    def __call__(
        self,
        x: Float[Array, "b h w c"],
        emb: Float[Array, "b e"],
        *,
        context: Float[Array, "b m d"] | None = None,
        mask: Int[Array, "b m"] | Bool[Array, "b m"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "b h w c"]:
        # `emb` and `key` are unused: they give every block the same call signature.
        if (context is None) != (self.cross is None):
            has = "has cross-attention" if self.cross is not None else "was built with context_dim=0"
            raise ValueError(f"AttnBlock: pass `context` exactly when the block has cross-attention; this one {has}")
        b, h, w, c = x.shape
        if self.attn is not None:
            y = self.attn(self.norm(x).reshape(b, h * w, c)).reshape(b, h, w, c)
            x = x + y.astype(x.dtype)
        if self.cross is None:
            return x
        tokens = x.reshape(b, h * w, c)
        queries = layer_norm(tokens) + jnp.asarray(sincos_pos_embed_2d(c, h, w), tokens.dtype)
        return (tokens + self.cross(queries, context, mask).astype(x.dtype)).reshape(b, h, w, c)


class UNet(eqx.Module):
    """Time- and class- or text-conditional UNet, `model(x[b,h,w,c], t[b], cond) -> [b,h,w,c]`,
    where `cond` is class labels `int32[b]` (None: the null class), None for an unconditional
    UNet, or for a text UNet (`context_dim > 0`) a `TextCond(context f32[b, n, context_dim],
    mask int32[b, n] (1 = token, 0 = padding), pooled f32[b, pooled_dim], None when pooled_dim = 0)`.

    Layout (FlaxDiff's): conv_in to channels[0]; at level i, `num_res_blocks` blocks keep the
    incoming width (attention after the last one if i is in `attention_levels`), then a
    stride-2 conv to channels[i] (not after the last level); the middle has
    `num_middle_res_blocks` pairs of blocks at channels[-1] (attention between them if the
    last level has it); the up path concatenates one skip per block and maps to channels[i],
    then upsamples (nearest ×2 + conv to `upsample_channels[j]`, default: keep the width);
    a conv and one final block consume conv_in's skip; GN-SiLU-conv_out (zero-init).
    h and w must be divisible by 2**(len(channels)-1).

    Text: the attention blocks at `cross_attention_levels` (default: `attention_levels`) also
    cross-attend to the context (see `AttnBlock`); a level there but not in `attention_levels`
    gets a block with cross-attention only. A text UNet needs at least one such level; `pooled`
    goes through a zero-initialised Dense(pooled_dim -> emb_features) added to the time
    embedding (where labels are). At init
    the output therefore does not depend on the text. One kind of condition per model: labels
    or text.

    `position_embedding` adds MAE's fixed 2-D sin-cos position embedding to conv_in's output:
    convolutions are translation-equivariant, so a shallow UNet otherwise knows where a pixel is
    only from the zero padding, and a caption's "left of" has nothing to bind to.

    `interval_embedding` makes a network of two times (MeanFlow, Geng et al. 2025): `interval` = t − r, in the
    units of t, goes through its own timestep embedding added to t's (as the official DiT's `h_embedder`; `time_embed`
    is then a `TwoTimeEmbedding`); called without it, the network at r = t. Without the option the module is as it
    was, leaf for leaf, and the other weights are drawn alike either way.
    """

    time_embed: TimestepEmbedding | TwoTimeEmbedding
    label_embed: Embedding | None
    pooled_embed: Dense | None
    conv_in: Conv2d
    down_blocks: list[list[ResBlock]]
    down_attn: list[AttnBlock | None]
    downsample: list[Conv2d]
    middle_blocks: list[tuple[ResBlock, AttnBlock | None, ResBlock]]
    up_blocks: list[list[ResBlock]]
    up_attn: list[AttnBlock | None]
    upsample: list[Conv2d]
    conv_mid_out: Conv2d
    final_block: ResBlock
    out_norm: GroupNorm
    conv_out: Conv2d

    in_channels: int = eqx.field(static=True)
    channels: tuple[int, ...] = eqx.field(static=True)
    num_classes: int = eqx.field(static=True)
    context_dim: int = eqx.field(static=True)
    position_embedding: bool = eqx.field(static=True)
    pooled_dim: int = eqx.field(static=True)
    remat: bool = eqx.field(static=True)

    def __init__(
        self,
        in_channels: int,
        channels: Sequence[int] = (32, 64, 128),
        num_res_blocks: int = 2,
        attention_levels: Sequence[int] = (),
        num_middle_res_blocks: int = 1,
        emb_features: int = 128,
        num_classes: int = 0,
        dropout: float = 0.0,
        norm_groups: int = 8,
        *,
        num_heads: int = 4,
        scale_shift: bool = False,
        upsample_channels: Sequence[int] | None = None,
        remat: bool = False,
        context_dim: int = 0,
        cross_attention_levels: Sequence[int] | None = None,
        position_embedding: bool = False,
        pooled_dim: int = 0,
        interval_embedding: bool = False,
        key: PRNGKeyArray,
    ):
        channels, levels = tuple(channels), len(channels)
        attention_levels = tuple(attention_levels)
        cross_levels = attention_levels if cross_attention_levels is None else tuple(cross_attention_levels)
        for name, given in (("attention_levels", attention_levels), ("cross_attention_levels", cross_levels)):
            if any(not 0 <= i < levels for i in given):
                raise ValueError(f"{name} {given} must index channels {channels}")
        if cross_attention_levels is not None and not context_dim:
            raise ValueError(f"UNet: cross_attention_levels={cross_levels} needs a text context (context_dim > 0)")
        if num_classes > 0 and (context_dim > 0 or pooled_dim > 0):
            raise ValueError(
                f"UNet: one kind of condition per model: num_classes={num_classes} (labels) or "
                f"context_dim={context_dim}/pooled_dim={pooled_dim} (text), not both"
            )
        if pooled_dim > 0 and context_dim <= 0:
            raise ValueError(f"UNet: pooled_dim={pooled_dim} needs a text context too (context_dim > 0)")
        if context_dim > 0 and not cross_levels:
            raise ValueError(
                f"UNet: context_dim={context_dim} needs attention_levels or cross_attention_levels (the text is "
                "read by the attention blocks' cross-attention); got none, e.g. attention_levels=(len(channels) - 1,)"
            )
        if upsample_channels is None:
            upsample_channels = tuple(reversed(channels[1:]))
        if len(upsample_channels) != levels - 1:
            raise ValueError(f"upsample_channels needs {levels - 1} entries, got {tuple(upsample_channels)}")
        # Only what __call__ reads is kept; the rest of the configuration is the module tree itself.
        self.in_channels, self.channels, self.num_classes, self.remat = in_channels, channels, num_classes, remat
        self.context_dim, self.pooled_dim = context_dim, pooled_dim
        if position_embedding and channels[0] % 4:
            raise ValueError(
                f"position_embedding needs channels[0] divisible by 4 (sin-cos per axis), got {channels[0]}"
            )
        self.position_embedding = position_embedding
        upsample_channels = tuple(upsample_channels)

        keys = (jax.random.fold_in(key, i) for i in itertools.count())  # one compile, any length

        def res(cin: int, cout: int) -> ResBlock:
            return ResBlock(cin, cout, emb_features, norm_groups, dropout, scale_shift, key=next(keys))

        def attn(c: int, level: int) -> AttnBlock | None:
            if level not in attention_levels + cross_levels:
                return None
            return AttnBlock(
                c,
                norm_groups,
                num_heads,
                context_dim=context_dim if level in cross_levels else 0,
                self_attention=level in attention_levels,
                key=next(keys),
            )

        time_key = next(keys)
        self.time_embed = TimestepEmbedding(emb_features, emb_features, key=time_key)
        # Zero-init: the pooled text starts with no effect. Its key is folded from the time
        # embedding's, so the stream of every other layer stays as without text.
        pooled = Dense(pooled_dim, emb_features, key=jax.random.fold_in(time_key, 1)) if pooled_dim else None
        self.pooled_embed = None if pooled is None else zero_init(pooled)
        if interval_embedding:  # MeanFlow's t − r: its own embedding, its key folded like the pooled one's
            interval = TimestepEmbedding(emb_features, emb_features, key=jax.random.fold_in(time_key, 2))
            self.time_embed = TwoTimeEmbedding(self.time_embed, interval)
        # Row `num_classes` is the null label of classifier-free guidance.
        self.label_embed = Embedding(num_classes + 1, emb_features, key=next(keys)) if num_classes > 0 else None
        self.conv_in = Conv2d(in_channels, channels[0], key=next(keys))

        width, skips = channels[0], [channels[0]]
        self.down_blocks, self.down_attn, self.downsample = [], [], []
        for i, ch in enumerate(channels):
            self.down_blocks.append([res(width, width) for _ in range(num_res_blocks)])
            self.down_attn.append(attn(width, i))
            skips += [width] * num_res_blocks
            if i < levels - 1:
                self.downsample.append(Conv2d(width, ch, stride=2, key=next(keys)))
                width = ch

        self.middle_blocks = []
        for _ in range(num_middle_res_blocks):
            first = res(width, channels[-1])
            width = channels[-1]
            self.middle_blocks.append((first, attn(width, levels - 1), res(width, width)))

        self.up_blocks, self.up_attn, self.upsample = [], [], []
        for j, i in enumerate(reversed(range(levels))):
            blocks = []
            for _ in range(num_res_blocks):
                blocks.append(res(width + skips.pop(), channels[i]))
                width = channels[i]
            self.up_blocks.append(blocks)
            self.up_attn.append(attn(width, i))
            if i > 0:
                self.upsample.append(Conv2d(width, upsample_channels[j], key=next(keys)))
                width = upsample_channels[j]

        self.conv_mid_out = Conv2d(width, channels[0], key=next(keys))
        self.final_block = res(channels[0] + skips.pop(), channels[0])
        self.out_norm = GroupNorm(norm_groups, channels[0])
        self.conv_out = zero_init(Conv2d(channels[0], in_channels, key=next(keys)))

    def null_cond(self, batch_size: int) -> Int[Array, " b"] | None:
        """The "no class" condition of classifier-free guidance: label `num_classes` (the label
        table's last row) for every example; None for an unconditional model.

        None for a text model too: its null condition is the text encoder's output for "" (or
        zeros), which depends on the encoder the run uses, not on the UNet, so the training
        script builds it and passes it as `cond` (to condition dropout and guidance)."""
        return jnp.full((batch_size,), self.num_classes, jnp.int32) if self.num_classes else None

    @classmethod
    def flaxdiff_simple(
        cls, in_channels: int = 3, *, num_classes: int = 0, dropout: float = 0.0, remat: bool = False, key: PRNGKeyArray
    ) -> "UNet":
        """FlaxDiff 0.2.x `simple_unet.Unet(emb_features=128, feature_depths=(32, 64, 128),
        num_res_blocks=2, num_middle_res_blocks=1)` without attention.

        Exactly 2,141,379 parameters at 3 channels and 2,140,225 at 1 channel, as FlaxDiff
        (plus (num_classes + 1) * 128 for a label table). `upsample_channels=(32, 128)` mirrors
        FlaxDiff's `Upsample(features=feature_depths[-i])`.
        """
        channels = (32, 64, 128)
        return cls(
            in_channels,
            channels,
            2,
            (),
            1,
            128,
            num_classes,
            dropout,
            8,
            upsample_channels=tuple(channels[-i] for i in range(len(channels) - 1)),
            remat=remat,
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
    ) -> Float[Array, "b h w c"]:
        b, h, w, c = x.shape
        factor = 2 ** (len(self.channels) - 1)
        if c != self.in_channels or h % factor or w % factor:
            raise ValueError(
                f"UNet expects [b, h, w, {self.in_channels}] with h, w divisible by {factor}; got {x.shape}"
            )
        emb = embed_times(self.time_embed, t, interval, "UNet")
        text: dict[str, Any] = {}  # the attention blocks' context and mask, for a text UNet
        if self.context_dim:
            context, mask, pooled = unpack_text_cond(cond, b, self.context_dim, self.pooled_dim, "UNet")
            text = {"context": context, "mask": mask}
            if self.pooled_embed is not None:
                emb = emb + self.pooled_embed(pooled).astype(emb.dtype)
        elif self.label_embed is not None:
            if cond is not None and not eqx.is_array(cond):
                raise ValueError(f"A label UNet (num_classes > 0) takes int32[b] labels, got {type(cond).__name__}.")
            labels = self.null_cond(b) if cond is None else cond
            emb = emb + self.label_embed(labels).astype(emb.dtype)
        elif cond is not None:
            raise ValueError("A condition was given to an unconditional UNet (num_classes=0, context_dim=0).")
        emb = jax.nn.silu(emb)

        n_res = len(jax.tree.leaves(self, is_leaf=lambda m: isinstance(m, (ResBlock, AttnBlock))))
        keys = iter(jax.random.split(key, n_res) if key is not None else [None] * n_res)
        call = lambda blk, hid: checkpointed(blk, self.remat)(hid, emb, key=next(keys))  # noqa: E731

        def attend(blk: AttnBlock, hid):  # only a block that cross-attends reads the text
            return checkpointed(blk, self.remat)(hid, emb, key=next(keys), **(text if blk.cross is not None else {}))

        hid = self.conv_in(x)
        if self.position_embedding:
            hid = hid + jnp.asarray(sincos_pos_embed_2d(hid.shape[-1], h, w).reshape(h, w, -1), hid.dtype)
        skips = [hid]
        for i, blocks in enumerate(self.down_blocks):
            for j, blk in enumerate(blocks):
                hid = call(blk, hid)
                if j == len(blocks) - 1 and self.down_attn[i] is not None:
                    hid = attend(self.down_attn[i], hid)
                skips.append(hid)
            if i < len(self.downsample):
                hid = self.downsample[i](hid)
        for first, attn, second in self.middle_blocks:
            hid = call(first, hid)
            hid = hid if attn is None else attend(attn, hid)
            hid = call(second, hid)
        for i, blocks in enumerate(self.up_blocks):
            for blk in blocks:
                hid = call(blk, jnp.concatenate([hid, skips.pop().astype(hid.dtype)], axis=-1))
            if self.up_attn[i] is not None:
                hid = attend(self.up_attn[i], hid)
            if i < len(self.upsample):
                hid = nearest_upsample_conv(self.upsample[i], hid)
        hid = self.conv_mid_out(hid)
        hid = call(self.final_block, jnp.concatenate([hid, skips.pop().astype(hid.dtype)], axis=-1))
        return self.conv_out(jax.nn.silu(self.out_norm(hid))).astype(x.dtype)
