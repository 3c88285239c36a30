"""The blocks of diffusers' VAE (Rombach et al. 2022, LDM's `Encoder`/`Decoder`), NHWC.

Field names are diffusers' attribute names, so a leaf's path is its state_dict key
(`resnets.0.norm1.weight`, `attentions.0.to_out.0.bias`). Every GroupNorm here has eps 1e-6,
as in diffusers' `Encoder`, `Decoder` and their blocks; no VAE block takes a time embedding (the SD UNet's
blocks, eqxdiff/sd/unet_blocks.py, reuse `ResnetBlock` with one and `Upsample` to a skip's size).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.nn.layers import Conv2d, Dense, GroupNorm
from eqxdiff.nn.upsample import nearest_upsample_conv

EPS = 1e-6
# Queries per block of the mid-block attention: its logits are [chunk, n] at a time, never [n, n]
# (the full matrix grows with the square of the latent's pixels; BENCHMARKS.md "VAE memory per image").
QUERY_CHUNK = 1024


class ResnetBlock(eqx.Module):
    """diffusers' `ResnetBlock2D` (time_embedding_norm "default"):
    x' + conv2(SiLU(GN(conv1(SiLU(GN(x))) + time_emb_proj(SiLU(temb))))), x' = x or its 1x1 conv when
    the width changes. The VAE's blocks have no time embedding (`temb_channels=None`: no projection)."""

    norm1: GroupNorm
    conv1: Conv2d
    time_emb_proj: Dense | None
    norm2: GroupNorm
    conv2: Conv2d
    conv_shortcut: Conv2d | None

    def __init__(
        self,
        cin: int,
        cout: int,
        groups: int,
        *,
        eps: float = EPS,
        temb_channels: int | None = None,
        key: PRNGKeyArray,
    ):
        k1, k2, k3 = jax.random.split(key, 3)  # the VAE's three draws, unchanged by the optional projection
        self.norm1, self.conv1 = GroupNorm(groups, cin, eps=eps), Conv2d(cin, cout, key=k1)
        temb_key = jax.random.fold_in(key, 3)
        self.time_emb_proj = None if temb_channels is None else Dense(temb_channels, cout, key=temb_key)
        self.norm2, self.conv2 = GroupNorm(groups, cout, eps=eps), Conv2d(cout, cout, key=k2)
        self.conv_shortcut = Conv2d(cin, cout, 1, key=k3) if cin != cout else None

    def __call__(
        self, x: Float[Array, "b h w ci"], temb: Float[Array, "b e"] | None = None
    ) -> Float[Array, "b h w co"]:
        h = self.conv1(jax.nn.silu(self.norm1(x)))
        if self.time_emb_proj is not None:
            h = h + self.time_emb_proj(jax.nn.silu(temb))[:, None, None, :]
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        return h + (x if self.conv_shortcut is None else self.conv_shortcut(x))


class Attention(eqx.Module):
    """diffusers' `Attention` as the VAE mid block builds it: one head over the h*w pixels,
    x + to_out(softmax(q kᵀ / sqrt(c)) v), q, k, v = to_q/to_k/to_v(GN(x)); softmax in float32."""

    group_norm: GroupNorm
    to_q: Dense
    to_k: Dense
    to_v: Dense
    to_out: list[Dense]  # one entry: the state_dict key is `to_out.0.*` (diffusers' [Linear, Dropout])

    def __init__(self, channels: int, groups: int, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.group_norm = GroupNorm(groups, channels, eps=EPS)
        self.to_q, self.to_k, self.to_v = (Dense(channels, channels, key=k) for k in (kq, kk, kv))
        self.to_out = [Dense(channels, channels, key=ko)]

    def __call__(self, x: Float[Array, "b h w c"]) -> Float[Array, "b h w c"]:
        b, h, w, c = x.shape
        tokens = self.group_norm(x).reshape(b, h * w, 1, c)  # [b, n, heads=1, c]
        q, k, v = self.to_q(tokens), self.to_k(tokens), self.to_v(tokens)
        y = chunked_attention(q, k, v, QUERY_CHUNK).reshape(b, h * w, c)
        return x + self.to_out[0](y).reshape(b, h, w, c)


def chunked_attention(
    q: Float[Array, "b n h d"], k: Float[Array, "b m h d"], v: Float[Array, "b m h d"], chunk: int
) -> Float[Array, "b n h d"]:
    """`jax.nn.dot_product_attention(q, k, v)` with the queries taken `chunk` at a time (`lax.map`, one
    block live at once): every query row's softmax still runs over all m keys (the pixels themselves, or
    a text's tokens), so the result is the same rows. n <= chunk is the plain call; otherwise the queries
    are zero-padded to whole blocks and the padding's rows dropped."""
    b, n, heads, d = q.shape
    if n <= chunk:
        return jax.nn.dot_product_attention(q, k, v)
    blocks = -(-n // chunk)
    padded = jnp.pad(q, ((0, 0), (0, blocks * chunk - n), (0, 0), (0, 0)))
    per_block = padded.reshape(b, blocks, chunk, heads, d).swapaxes(0, 1)
    out = jax.lax.map(lambda qb: jax.nn.dot_product_attention(qb, k, v), per_block)
    return out.swapaxes(0, 1).reshape(b, blocks * chunk, heads, d)[:, :n]


class MidBlock(eqx.Module):
    """diffusers' `UNetMidBlock2D` (one layer): resnet, [attention], resnet at constant width."""

    resnets: list[ResnetBlock]
    attentions: list[Attention | None]

    def __init__(self, channels: int, groups: int, add_attention: bool, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.resnets = [ResnetBlock(channels, channels, groups, key=k) for k in (k1, k2)]
        self.attentions = [Attention(channels, groups, key=k3) if add_attention else None]

    def __call__(self, x: Float[Array, "b h w c"]) -> Float[Array, "b h w c"]:
        x = self.resnets[0](x)
        if self.attentions[0] is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class Downsample(eqx.Module):
    """diffusers' `Downsample2D(padding=0)`: zero-pad one row at the bottom and one column at the
    right, then a 3x3 stride-2 conv without padding, `[b, h, w, c] -> [b, h/2, w/2, c]`."""

    conv: Conv2d

    def __init__(self, channels: int, *, key: PRNGKeyArray):
        self.conv = Conv2d(channels, channels, 3, stride=2, padding=0, key=key)

    def __call__(self, x: Float[Array, "b h w c"]) -> Float[Array, "b h2 w2 c"]:
        return self.conv(jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0))))


class Upsample(eqx.Module):
    """diffusers' `Upsample2D(use_conv=True)`: nearest-neighbour 2x (or to `size`, as the SD UNet asks
    when a level's size was odd), then a 3x3 conv; at 2x the conv runs on the small map (eqxdiff/nn/upsample.py)."""

    conv: Conv2d

    def __init__(self, channels: int, *, key: PRNGKeyArray):
        self.conv = Conv2d(channels, channels, 3, key=key)

    def __call__(self, x: Float[Array, "b h w c"], size: tuple[int, int] | None = None) -> Float[Array, "b h2 w2 c"]:
        h, w = x.shape[1:3]
        if size is None or tuple(size) == (2 * h, 2 * w):
            return nearest_upsample_conv(self.conv, x)
        return self.conv(x[:, nearest_index(h, size[0])][:, :, nearest_index(w, size[1])])


def nearest_index(n_in: int, n_out: int) -> np.ndarray:
    """The source rows of torch's `interpolate(mode="nearest", size=n_out)`: floor(i * (n_in / n_out)) in
    float32, clipped to the last row (a compile-time constant)."""
    scale = np.float32(n_in) / np.float32(n_out)
    return np.minimum(np.floor(np.arange(n_out, dtype=np.float32) * scale).astype(np.int32), n_in - 1)


class DownEncoderBlock(eqx.Module):
    """diffusers' `DownEncoderBlock2D`: `num_layers` resnets to `cout`, then a Downsample unless last."""

    resnets: list[ResnetBlock]
    downsamplers: list[Downsample] | None

    def __init__(self, cin: int, cout: int, num_layers: int, groups: int, downsample: bool, *, key: PRNGKeyArray):
        keys = jax.random.split(key, num_layers + 1)
        self.resnets = [ResnetBlock(cin if i == 0 else cout, cout, groups, key=keys[i]) for i in range(num_layers)]
        self.downsamplers = [Downsample(cout, key=keys[-1])] if downsample else None

    def __call__(self, x: Float[Array, "b h w ci"]) -> Float[Array, "b h2 w2 co"]:
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.downsamplers is None else self.downsamplers[0](x)


class UpDecoderBlock(eqx.Module):
    """diffusers' `UpDecoderBlock2D`: `num_layers` resnets to `cout`, then an Upsample unless last."""

    resnets: list[ResnetBlock]
    upsamplers: list[Upsample] | None

    def __init__(self, cin: int, cout: int, num_layers: int, groups: int, upsample: bool, *, key: PRNGKeyArray):
        keys = jax.random.split(key, num_layers + 1)
        self.resnets = [ResnetBlock(cin if i == 0 else cout, cout, groups, key=keys[i]) for i in range(num_layers)]
        self.upsamplers = [Upsample(cout, key=keys[-1])] if upsample else None

    def __call__(self, x: Float[Array, "b h w ci"]) -> Float[Array, "b h2 w2 co"]:
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.upsamplers is None else self.upsamplers[0](x)
