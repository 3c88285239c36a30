"""The text attention of Stable Diffusion's UNet: diffusers' `Transformer2DModel` (continuous input) and
its `BasicTransformerBlock`s, NHWC. Field names are diffusers' attribute names, so a leaf's path is its
state_dict key (`attentions.0.transformer_blocks.1.attn2.to_k.weight`, `...ff.net.2.bias`).

Logits and softmax are float32 whatever the parameters' dtype, which is what diffusers' `upcast_attention=True`
asks for; with float32 parameters the option changes nothing. The attention's form (XLA's, the CPU's query
blocks, a TPU's flash kernel) is chosen by backend and shape in `eqxdiff.nn.attention`.
The text mask is not applied: diffusers' SD pipelines never pass `encoder_attention_mask`, so SD's UNets
attend to the padding tokens as they were trained to.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqxdiff.nn.attention import attention
from eqxdiff.nn.clip_text import LayerNorm, gelu
from eqxdiff.nn.layers import Dense, GroupNorm

LAYER_NORM_EPS = 1e-5  # BasicTransformerBlock's norm_eps default, which Transformer2DModel keeps
GROUP_NORM_EPS = 1e-6  # Transformer2DModel's input GroupNorm, whatever the UNet's norm_eps


class Attention(eqx.Module):
    """diffusers' `Attention` (bias-free q, k, v): to_out(softmax(q kᵀ / sqrt(d_head)) v) over `heads`
    heads, `[b, n, dim] -> [b, n, dim]`; keys and values from `context [b, m, context_dim]`, or from
    the tokens themselves when context is None (self-attention)."""

    to_q: Dense
    to_k: Dense
    to_v: Dense
    to_out: list[Dense]  # one entry: the state_dict key is `to_out.0.*` (diffusers' [Linear, Dropout])
    heads: int = eqx.field(static=True)

    def __init__(self, dim: int, context_dim: int | None, heads: int, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        kv_dim = dim if context_dim is None else context_dim
        self.to_q = Dense(dim, dim, use_bias=False, key=kq)
        self.to_k, self.to_v = (Dense(kv_dim, dim, use_bias=False, key=k) for k in (kk, kv))
        self.to_out, self.heads = [Dense(dim, dim, key=ko)], heads

    def __call__(self, x: Float[Array, "b n d"], context: Float[Array, "b m e"] | None = None) -> Float[Array, "b n d"]:
        b, n, d = x.shape
        source = x if context is None else context
        q = self.to_q(x).reshape(b, n, self.heads, d // self.heads)
        m = source.shape[1]
        k, v = (proj(source).reshape(b, m, self.heads, d // self.heads) for proj in (self.to_k, self.to_v))
        return self.to_out[0](attention(q, k, v).reshape(b, n, d))


class GEGLU(eqx.Module):
    """Shazeer 2020's GELU-gated linear unit: h · GELU(g), [h, g] = proj(x), exact (erf) GELU."""

    proj: Dense

    def __init__(self, dim: int, inner: int, *, key: PRNGKeyArray):
        self.proj = Dense(dim, 2 * inner, key=key)

    def __call__(self, x: Float[Array, "*batch d"]) -> Float[Array, "*batch i"]:
        h, gate = jnp.split(self.proj(x), 2, axis=-1)
        return h * gelu(gate)


class FeedForward(eqx.Module):
    """diffusers' `FeedForward(activation_fn="geglu")`: GEGLU to 4·dim, then back to dim."""

    net: list[GEGLU | Dense | None]  # [GEGLU, (Dropout), Linear]: keys `net.0.proj.*` and `net.2.*`

    def __init__(self, dim: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.net = [GEGLU(dim, 4 * dim, key=k1), None, Dense(4 * dim, dim, key=k2)]

    def __call__(self, x: Float[Array, "*batch d"]) -> Float[Array, "*batch d"]:
        return self.net[2](self.net[0](x))


class BasicTransformerBlock(eqx.Module):
    """Pre-LayerNorm transformer block: x += attn1(LN(x)) (self-attention, or attention to the text with
    only_cross_attention); x += attn2(LN(x), text); x += ff(LN(x)). `[b, n, dim] -> [b, n, dim]`."""

    norm1: LayerNorm
    attn1: Attention
    norm2: LayerNorm
    attn2: Attention
    norm3: LayerNorm
    ff: FeedForward
    only_cross_attention: bool = eqx.field(static=True)

    def __init__(self, dim: int, heads: int, context_dim: int, only_cross_attention: bool, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.only_cross_attention = only_cross_attention
        self.norm1 = LayerNorm(dim, LAYER_NORM_EPS)
        self.attn1 = Attention(dim, context_dim if only_cross_attention else None, heads, key=k1)
        self.norm2, self.attn2 = LayerNorm(dim, LAYER_NORM_EPS), Attention(dim, context_dim, heads, key=k2)
        self.norm3, self.ff = LayerNorm(dim, LAYER_NORM_EPS), FeedForward(dim, key=k3)

    def __call__(self, x: Float[Array, "b n d"], context: Float[Array, "b m e"]) -> Float[Array, "b n d"]:
        x = x + self.attn1(self.norm1(x), context if self.only_cross_attention else None)
        x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class Transformer2DModel(eqx.Module):
    """diffusers' `Transformer2DModel` on an image: x + proj_out(blocks(proj_in(GN(x)) as h·w tokens)),
    `[b, h, w, c] -> [b, h, w, c]`. proj_in/proj_out are per-pixel linear maps either way: 1x1 convs in
    SD 1.x files (`use_linear_projection=False`, loaded as these Dense layers), Linear in SD 2.x/XL files."""

    norm: GroupNorm
    proj_in: Dense
    transformer_blocks: list[BasicTransformerBlock]
    proj_out: Dense
    use_linear_projection: bool = eqx.field(static=True)  # how the file stores proj_in/proj_out

    def __init__(
        self,
        channels: int,
        heads: int,
        context_dim: int,
        depth: int,
        groups: int,
        use_linear_projection: bool,
        only_cross_attention: bool,
        *,
        key: PRNGKeyArray,
    ):
        keys = jax.random.split(key, depth + 2)
        self.norm = GroupNorm(groups, channels, eps=GROUP_NORM_EPS)
        self.proj_in, self.proj_out = Dense(channels, channels, key=keys[0]), Dense(channels, channels, key=keys[1])
        self.transformer_blocks = [
            BasicTransformerBlock(channels, heads, context_dim, only_cross_attention, key=k) for k in keys[2:]
        ]
        self.use_linear_projection = use_linear_projection

    def __call__(self, x: Float[Array, "b h w c"], context: Float[Array, "b m e"]) -> Float[Array, "b h w c"]:
        b, h, w, c = x.shape
        tokens = self.proj_in(self.norm(x)).reshape(b, h * w, c)
        for block in self.transformer_blocks:
            tokens = block(tokens, context)
        return x + self.proj_out(tokens).reshape(b, h, w, c)
