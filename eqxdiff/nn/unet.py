"""ADM-style convolutional UNet (Ho et al. 2020; Dhariwal & Nichol 2021), NHWC.

The topology follows FlaxDiff's `simple_unet.Unet` (0.2.x) so that `UNet.flaxdiff_simple`
reproduces its parameter count exactly; the blocks themselves are ADM's (GroupNorm-SiLU-conv
residual blocks with the embedding added, zero-initialised last convs).
"""

import itertools
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxdiff.nn.layers import (
    Conv2d, Dense, Embedding, GroupNorm, SelfAttention, TimestepEmbedding, zero_init,
)  # fmt: skip
from eqxdiff.nn.remat import checkpointed


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
            h = self.norm2(h) * (1 + scale) + shift
        else:
            h = self.norm2(h + e)
        h = jax.nn.silu(h)
        if key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, h.shape)
            h = jnp.where(keep, h / (1.0 - self.dropout), jnp.zeros((), h.dtype))
        return self.conv2(h) + (x if self.skip is None else self.skip(x)).astype(h.dtype)


class AttnBlock(eqx.Module):
    """x + Attn(GN(x)) over the h*w pixels as tokens, `[b,h,w,c] -> [b,h,w,c]`; out-proj zero-init."""

    norm: GroupNorm
    attn: SelfAttention

    def __init__(self, channels: int, groups: int, num_heads: int, *, key: PRNGKeyArray):
        self.norm = GroupNorm(groups, channels)
        attn = SelfAttention(channels, num_heads, key=key)
        self.attn = eqx.tree_at(lambda a: a.proj, attn, zero_init(attn.proj))

    def __call__(
        self, x: Float[Array, "b h w c"], emb: Float[Array, "b e"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "b h w c"]:
        # `emb` and `key` are unused: they give every block the same call signature.
        b, h, w, c = x.shape
        y = self.attn(self.norm(x).reshape(b, h * w, c)).reshape(b, h, w, c)
        return x + y.astype(x.dtype)


class UNet(eqx.Module):
    """Time- and class-conditional UNet, `model(x[b,h,w,c], t[b], cond) -> [b,h,w,c]`, where
    `cond` is class labels `int32[b]` (None: the null class) or None for `num_classes=0`.

    Layout (FlaxDiff's): conv_in to channels[0]; at level i, `num_res_blocks` blocks keep the
    incoming width (attention after the last one if i is in `attention_levels`), then a
    stride-2 conv to channels[i] (not after the last level); the middle has
    `num_middle_res_blocks` pairs of blocks at channels[-1] (attention between them if the
    last level has it); the up path concatenates one skip per block and maps to channels[i],
    then upsamples (nearest ×2 + conv to `upsample_channels[j]`, default: keep the width);
    a conv and one final block consume conv_in's skip; GN-SiLU-conv_out (zero-init).
    h and w must be divisible by 2**(len(channels)-1).
    """

    time_embed: TimestepEmbedding
    label_embed: Embedding | None
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
        key: PRNGKeyArray,
    ):
        channels, levels = tuple(channels), len(channels)
        if any(not 0 <= i < levels for i in attention_levels):
            raise ValueError(f"attention_levels {tuple(attention_levels)} must index channels {channels}")
        if upsample_channels is None:
            upsample_channels = tuple(reversed(channels[1:]))
        if len(upsample_channels) != levels - 1:
            raise ValueError(f"upsample_channels needs {levels - 1} entries, got {tuple(upsample_channels)}")
        # Only what __call__ reads is kept; the rest of the configuration is the module tree itself.
        self.in_channels, self.channels, self.num_classes, self.remat = in_channels, channels, num_classes, remat
        attention_levels, upsample_channels = tuple(attention_levels), tuple(upsample_channels)

        keys = (jax.random.fold_in(key, i) for i in itertools.count())  # one compile, any length

        def res(cin: int, cout: int) -> ResBlock:
            return ResBlock(cin, cout, emb_features, norm_groups, dropout, scale_shift, key=next(keys))

        def attn(c: int, on: bool) -> AttnBlock | None:
            return AttnBlock(c, norm_groups, num_heads, key=next(keys)) if on else None

        self.time_embed = TimestepEmbedding(emb_features, emb_features, key=next(keys))
        # Row `num_classes` is the null label of classifier-free guidance.
        self.label_embed = Embedding(num_classes + 1, emb_features, key=next(keys)) if num_classes > 0 else None
        self.conv_in = Conv2d(in_channels, channels[0], key=next(keys))

        width, skips = channels[0], [channels[0]]
        self.down_blocks, self.down_attn, self.downsample = [], [], []
        for i, ch in enumerate(channels):
            self.down_blocks.append([res(width, width) for _ in range(num_res_blocks)])
            self.down_attn.append(attn(width, i in attention_levels))
            skips += [width] * num_res_blocks
            if i < levels - 1:
                self.downsample.append(Conv2d(width, ch, stride=2, key=next(keys)))
                width = ch

        self.middle_blocks = []
        for _ in range(num_middle_res_blocks):
            first = res(width, channels[-1])
            width = channels[-1]
            self.middle_blocks.append((first, attn(width, levels - 1 in attention_levels), res(width, width)))

        self.up_blocks, self.up_attn, self.upsample = [], [], []
        for j, i in enumerate(reversed(range(levels))):
            blocks = []
            for _ in range(num_res_blocks):
                blocks.append(res(width + skips.pop(), channels[i]))
                width = channels[i]
            self.up_blocks.append(blocks)
            self.up_attn.append(attn(width, i in attention_levels))
            if i > 0:
                self.upsample.append(Conv2d(width, upsample_channels[j], key=next(keys)))
                width = upsample_channels[j]

        self.conv_mid_out = Conv2d(width, channels[0], key=next(keys))
        self.final_block = res(channels[0] + skips.pop(), channels[0])
        self.out_norm = GroupNorm(norm_groups, channels[0])
        self.conv_out = zero_init(Conv2d(channels[0], in_channels, key=next(keys)))

    def null_cond(self, batch_size: int) -> Int[Array, " b"] | None:
        """The "no class" condition of classifier-free guidance: label `num_classes` (the label
        table's last row) for every example; None for an unconditional model."""
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
            in_channels, channels, 2, (), 1, 128, num_classes, dropout, 8,
            upsample_channels=tuple(channels[-i] for i in range(len(channels) - 1)), remat=remat, key=key,
        )  # fmt: skip

    def __call__(
        self,
        x: Float[Array, "b h w c"],
        t: Float[Array, " b"],
        cond: Int[Array, " b"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "b h w c"]:
        b, h, w, c = x.shape
        factor = 2 ** (len(self.channels) - 1)
        if c != self.in_channels or h % factor or w % factor:
            raise ValueError(
                f"UNet expects [b, h, w, {self.in_channels}] with h, w divisible by {factor}; got {x.shape}"
            )
        emb = self.time_embed(t)
        if self.label_embed is not None:
            labels = self.null_cond(b) if cond is None else cond
            emb = emb + self.label_embed(labels).astype(emb.dtype)
        elif cond is not None:
            raise ValueError("A condition (labels) was given to an unconditional UNet (num_classes=0).")
        emb = jax.nn.silu(emb)

        n_res = len(jax.tree.leaves(self, is_leaf=lambda m: isinstance(m, (ResBlock, AttnBlock))))
        keys = iter(jax.random.split(key, n_res) if key is not None else [None] * n_res)
        call = lambda blk, hid: checkpointed(blk, self.remat)(hid, emb, key=next(keys))  # noqa: E731

        hid = self.conv_in(x)
        skips = [hid]
        for i, blocks in enumerate(self.down_blocks):
            for j, blk in enumerate(blocks):
                hid = call(blk, hid)
                if j == len(blocks) - 1 and self.down_attn[i] is not None:
                    hid = call(self.down_attn[i], hid)
                skips.append(hid)
            if i < len(self.downsample):
                hid = self.downsample[i](hid)
        for first, attn, second in self.middle_blocks:
            hid = call(first, hid)
            hid = hid if attn is None else call(attn, hid)
            hid = call(second, hid)
        for i, blocks in enumerate(self.up_blocks):
            for blk in blocks:
                hid = call(blk, jnp.concatenate([hid, skips.pop().astype(hid.dtype)], axis=-1))
            if self.up_attn[i] is not None:
                hid = call(self.up_attn[i], hid)
            if i < len(self.upsample):
                hid = self.upsample[i](jnp.repeat(jnp.repeat(hid, 2, axis=1), 2, axis=2))
        hid = self.conv_mid_out(hid)
        hid = call(self.final_block, jnp.concatenate([hid, skips.pop().astype(hid.dtype)], axis=-1))
        return self.conv_out(jax.nn.silu(self.out_norm(hid))).astype(x.dtype)
