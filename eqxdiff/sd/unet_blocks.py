"""The levels of Stable Diffusion's UNet: diffusers' `CrossAttnDownBlock2D`/`DownBlock2D`,
`UNetMidBlock2DCrossAttn`, `CrossAttnUpBlock2D`/`UpBlock2D`, and its timestep embedding, NHWC.

The resnets are the VAE's `ResnetBlock` with a time-embedding projection (diffusers' `ResnetBlock2D`
is one class for both), the upsampler the VAE's `Upsample`; the downsampler differs (a padded stride-2
conv here, the VAE pads bottom/right only). Field names are diffusers' attribute names, so leaf paths
are state_dict keys. A block without text attention has `attentions=None`. With `remat`, each resnet and
each Transformer2DModel runs rematerialised (eqxdiff/nn/remat.py): its activations are recomputed in the
backward pass.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.nn.layers import Conv2d, Dense
from eqxdiff.nn.remat import checkpointed
from eqxdiff.nn.vae_blocks import ResnetBlock, Upsample
from eqxdiff.sd.attention import Transformer2DModel


def timestep_features(
    t: Float[Array, " b"], dim: int, flip_sin_to_cos: bool, freq_shift: float, max_period: float = 10000.0
) -> Float[Array, "b d"]:
    """diffusers' `get_timestep_embedding`, float32: [sin(t·f), cos(t·f)], f_i = exp(-ln(max_period)·i /
    (dim/2 - freq_shift)), i < dim/2; [cos, sin] with flip_sin_to_cos; zero-padded when dim is odd."""
    half = dim // 2
    freqs = np.exp(-math.log(max_period) * np.arange(half, dtype=np.float32) / (half - freq_shift)).astype(np.float32)
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    sin, cos = jnp.sin(args), jnp.cos(args)
    emb = jnp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1)
    return jnp.pad(emb, ((0, 0), (0, dim % 2)))


class TimestepEmbedding(eqx.Module):
    """diffusers' `TimestepEmbedding`: linear_2(SiLU(linear_1(features))), `[b, in] -> [b, out]`."""

    linear_1: Dense
    linear_2: Dense

    def __init__(self, in_features: int, out_features: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.linear_1 = Dense(in_features, out_features, key=k1)
        self.linear_2 = Dense(out_features, out_features, key=k2)

    def __call__(self, x: Float[Array, "b i"]) -> Float[Array, "b o"]:
        return self.linear_2(jax.nn.silu(self.linear_1(x)))


class Downsample2D(eqx.Module):
    """diffusers' `Downsample2D(use_conv=True, padding=1)`: a 3x3 stride-2 conv padded by one on every
    side, `[b, h, w, c] -> [b, ceil(h/2), ceil(w/2), c]`."""

    conv: Conv2d

    def __init__(self, channels: int, *, key: PRNGKeyArray):
        self.conv = Conv2d(channels, channels, 3, stride=2, padding=1, key=key)

    def __call__(self, x: Float[Array, "b h w c"]) -> Float[Array, "b h2 w2 c"]:
        return self.conv(x)


def _attentions(spec: dict | None, width: int, n: int, keys) -> list[Transformer2DModel] | None:
    """`n` Transformer2DModels of `width` channels built from `spec` (Transformer2DModel's other
    arguments), or None for a block without text attention."""
    return None if spec is None else [Transformer2DModel(width, key=k, **spec) for k in keys[:n]]


class DownBlock(eqx.Module):
    """A down level: `len(resnets)` resnets (each followed by a Transformer2DModel in a CrossAttnDownBlock2D),
    then a Downsample2D unless last. Returns the output and every intermediate for the skips."""

    resnets: list[ResnetBlock]
    attentions: list[Transformer2DModel] | None
    downsamplers: list[Downsample2D] | None
    remat: bool = eqx.field(static=True)

    def __init__(
        self,
        cin: int,
        cout: int,
        layers: int,
        temb: int,
        groups: int,
        eps: float,
        attention: dict | None,
        downsample: bool,
        *,
        remat: bool = False,
        key: PRNGKeyArray,
    ):
        self.remat = remat
        keys = jax.random.split(key, 2 * layers + 1)
        self.resnets = [
            ResnetBlock(cin if i == 0 else cout, cout, groups, eps=eps, temb_channels=temb, key=keys[i])
            for i in range(layers)
        ]
        self.attentions = _attentions(attention, cout, layers, keys[layers:])
        self.downsamplers = [Downsample2D(cout, key=keys[-1])] if downsample else None

    def __call__(
        self, x: Float[Array, "b h w ci"], temb: Float[Array, "b e"], context: Float[Array, "b m d"]
    ) -> tuple[Float[Array, "b h2 w2 co"], list[Array]]:
        skips = []
        for i, resnet in enumerate(self.resnets):
            x = checkpointed(resnet, self.remat)(x, temb)
            x = x if self.attentions is None else checkpointed(self.attentions[i], self.remat)(x, context)
            skips.append(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
            skips.append(x)
        return x, skips


class MidBlock(eqx.Module):
    """diffusers' `UNetMidBlock2DCrossAttn` (one layer): resnet, Transformer2DModel, resnet."""

    resnets: list[ResnetBlock]
    attentions: list[Transformer2DModel]
    remat: bool = eqx.field(static=True)

    def __init__(
        self,
        width: int,
        temb: int,
        groups: int,
        eps: float,
        attention: dict,
        *,
        remat: bool = False,
        key: PRNGKeyArray,
    ):
        k1, k2, k3 = jax.random.split(key, 3)
        self.remat = remat
        self.resnets = [ResnetBlock(width, width, groups, eps=eps, temb_channels=temb, key=k) for k in (k1, k2)]
        self.attentions = [Transformer2DModel(width, key=k3, **attention)]

    def __call__(
        self, x: Float[Array, "b h w c"], temb: Float[Array, "b e"], context: Float[Array, "b m d"]
    ) -> Float[Array, "b h w c"]:
        run = lambda block, *args: checkpointed(block, self.remat)(*args)  # noqa: E731
        return run(self.resnets[1], run(self.attentions[0], run(self.resnets[0], x, temb), context), temb)


class UpBlock(eqx.Module):
    """An up level: each resnet takes the running features concatenated with the last remaining skip
    (channels last: [features, skip], as diffusers' dim-1 concat), then a Transformer2DModel in a
    CrossAttnUpBlock2D; an Upsample unless last, to the next skip's size."""

    resnets: list[ResnetBlock]
    attentions: list[Transformer2DModel] | None
    upsamplers: list[Upsample] | None
    remat: bool = eqx.field(static=True)

    def __init__(
        self,
        cins: list[int],
        skip_widths: list[int],
        cout: int,
        temb: int,
        groups: int,
        eps: float,
        attention: dict | None,
        upsample: bool,
        *,
        remat: bool = False,
        key: PRNGKeyArray,
    ):
        self.remat = remat
        layers = len(cins)
        keys = jax.random.split(key, 2 * layers + 1)
        self.resnets = [
            ResnetBlock(cin + skip, cout, groups, eps=eps, temb_channels=temb, key=k)
            for cin, skip, k in zip(cins, skip_widths, keys[:layers], strict=True)
        ]
        self.attentions = _attentions(attention, cout, layers, keys[layers:])
        self.upsamplers = [Upsample(cout, key=keys[-1])] if upsample else None

    def __call__(
        self,
        x: Float[Array, "b h w ci"],
        skips: list[Array],
        temb: Float[Array, "b e"],
        context: Float[Array, "b m d"],
        size: tuple[int, int] | None,
    ) -> Float[Array, "b h2 w2 co"]:
        """`skips`: this level's skips in the order they were made (the last is used first); `size`: the
        (h, w) to upsample to (the next level's skip)."""
        for i, resnet in enumerate(self.resnets):
            x = checkpointed(resnet, self.remat)(jnp.concatenate([x, skips[-1 - i]], axis=-1), temb)
            x = x if self.attentions is None else checkpointed(self.attentions[i], self.remat)(x, context)
        return x if self.upsamplers is None else self.upsamplers[0](x, size)
