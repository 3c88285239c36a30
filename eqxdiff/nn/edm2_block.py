"""EDM2's U-Net block (Karras et al. 2024, Fig. 21; NVlabs/edm2 networks_edm2.py `Block`), channels-last."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.nn.mp_layers import MPConv, mp_silu, mp_sum, normalize
from eqxdiff.nn.upsample import nearest_upsample


def resample(x: Float[Array, "b h w c"], mode: str) -> Array:
    """EDM2's `resample` with its [1, 1] filter: 'down' averages 2×2 blocks, 'up' repeats each pixel 2×2."""
    if mode == "keep":
        return x
    b, h, w, c = x.shape
    if mode == "down":
        return x.reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))
    return nearest_upsample(x)


class EDM2Block(eqx.Module):
    """An encoder ('enc': skip conv and pixel norm on the main branch first) or decoder ('dec': skip conv
    where the branches join) block: resample, a residual branch of two 3×3 MPConvs modulated by the
    embedding (gain `emb_gain`, zero at init), `mp_sum` with the main branch, optional self-attention on
    pixel-normalised q, k, v, and activations clipped to ±`clip_act`."""

    conv_res0: MPConv
    emb_linear: MPConv
    conv_res1: MPConv
    conv_skip: MPConv | None
    attn_qkv: MPConv | None
    attn_proj: MPConv | None
    emb_gain: Float[Array, ""]
    out_channels: int = eqx.field(static=True)
    flavor: str = eqx.field(static=True)
    resample_mode: str = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    dropout: float | int = eqx.field(static=True)
    res_balance: float = eqx.field(static=True)
    attn_balance: float = eqx.field(static=True)
    clip_act: float | int | None = eqx.field(static=True)

    def __init__(self, in_channels: int, out_channels: int, emb_channels: int, flavor: str = "enc",
                 resample_mode: str = "keep", attention: bool = False, channels_per_head: int = 64,
                 dropout: float | int = 0.0, res_balance: float = 0.3, attn_balance: float = 0.3,
                 clip_act: float | int | None = 256, *, key: PRNGKeyArray):  # fmt: skip
        keys = jax.random.split(key, 6)
        self.out_channels, self.flavor, self.resample_mode = out_channels, flavor, resample_mode
        self.num_heads = out_channels // channels_per_head if attention else 0
        self.dropout, self.res_balance, self.attn_balance, self.clip_act = dropout, res_balance, attn_balance, clip_act
        self.emb_gain = jnp.zeros(())
        self.conv_res0 = MPConv(out_channels if flavor == "enc" else in_channels, out_channels, (3, 3), key=keys[0])
        self.emb_linear = MPConv(emb_channels, out_channels, (), key=keys[1])
        self.conv_res1 = MPConv(out_channels, out_channels, (3, 3), key=keys[2])
        self.conv_skip = MPConv(in_channels, out_channels, (1, 1), key=keys[3]) if in_channels != out_channels else None
        self.attn_qkv = MPConv(out_channels, out_channels * 3, (1, 1), key=keys[4]) if self.num_heads else None
        self.attn_proj = MPConv(out_channels, out_channels, (1, 1), key=keys[5]) if self.num_heads else None

    def __call__(self, x: Float[Array, "b h w ci"], emb: Float[Array, "b e"], *,
                 key: PRNGKeyArray | None = None) -> Float[Array, "b h2 w2 co"]:  # fmt: skip
        """`key`: dropout's (training); None: no dropout."""
        x = resample(x, self.resample_mode)
        if self.flavor == "enc":
            if self.conv_skip is not None:
                x = self.conv_skip(x)
            x = normalize(x, axis=-1)  # pixel norm

        y = self.conv_res0(mp_silu(x))
        c = self.emb_linear(emb, gain=self.emb_gain) + 1
        y = mp_silu(y * c[:, None, None, :].astype(y.dtype))
        if key is not None and self.dropout:
            keep = jax.random.bernoulli(key, 1 - self.dropout, y.shape)
            y = jnp.where(keep, y / (1 - self.dropout), 0).astype(y.dtype)
        y = self.conv_res1(y)

        if self.flavor == "dec" and self.conv_skip is not None:
            x = self.conv_skip(x)
        x = mp_sum(x, y, t=self.res_balance)

        if self.num_heads:
            b, h, w, c = x.shape
            # Channels as EDM2 splits them: head, channel within the head, then q/k/v.
            y = self.attn_qkv(x).reshape(b, h * w, self.num_heads, -1, 3)
            q, k, v = (a[..., 0] for a in jnp.split(normalize(y, axis=3), 3, axis=-1))  # pixel norm per head
            att = jax.nn.softmax(jnp.einsum("bqhc,bkhc->bhqk", q, k / math.sqrt(q.shape[-1])), axis=-1)
            y = jnp.einsum("bhqk,bkhc->bqhc", att, v).reshape(b, h, w, c)
            x = mp_sum(x, self.attn_proj(y), t=self.attn_balance)

        if self.clip_act is not None:
            x = jnp.clip(x, -self.clip_act, self.clip_act)
        return x
