"""Shared NHWC layers for the UNet and the DiT.

Conventions: batch first, channels last; every layer computes in the dtype of its own
parameters (inputs are cast to it), so casting the whole model to bf16 makes it run in bf16;
normalisation statistics and the attention softmax are always computed in float32.
"""

import math
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqxdiff import xla_cpu

from .attention import attention
from .bias import add_bias, affine
from .conv import conv2d
from .text_cond import TextCond

# jax.random.normal's lower bound for its U(-1, 1); uniform draws use it too, so a uniform and a
# normal draw are one recipe (xla_cpu.padded_draw computes both in one program).
_LOW = np.nextafter(np.float32(-1), np.float32(0))


def _draw(key: PRNGKeyArray, shape: tuple[int, ...], normal: bool, scale: float) -> Array:
    """`scale`·N(0, 1) or `scale`·U(-1, 1) of `shape`; with `eqxdiff.xla_cpu` on, the same
    values from a few shared compiled programs instead of one per shape."""
    if xla_cpu.enabled("init_draws"):
        return xla_cpu.padded_draw(key, shape, normal, scale)
    if normal:
        return scale * jax.random.normal(key, shape)
    return scale * jax.random.uniform(key, shape, minval=_LOW, maxval=1.0)


def _uniform(key: PRNGKeyArray, shape: tuple[int, ...], bound: float) -> Array:
    """U(-bound, bound) of `shape`."""
    return _draw(key, shape, False, bound)


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], std: float) -> Array:
    """N(0, std²) of `shape`."""
    return _draw(key, shape, True, std)


def torch_uniform(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int) -> Array:
    """PyTorch/Equinox default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return _uniform(key, shape, 1.0 / math.sqrt(fan_in))


def normal(std: float) -> Callable[[PRNGKeyArray, tuple[int, ...]], Array]:
    """Initialiser drawing from N(0, std²)."""
    return lambda key, shape: _normal(key, shape, std)


class Dense(eqx.Module):
    """Linear map over the last axis, `[..., in] -> [..., out]`, as one matmul.

    Weight is stored `[in, out]`; init is PyTorch's U(±1/sqrt(in)) for weight and bias.
    """

    weight: Float[Array, "i o"]
    bias: Float[Array, " o"] | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True, key: PRNGKeyArray):
        wkey, bkey = jax.random.split(key)
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch_uniform(wkey, (in_features, out_features), in_features)
        self.bias = torch_uniform(bkey, (out_features,), in_features) if use_bias else None

    def __call__(self, x: Float[Array, "*batch i"]) -> Float[Array, "*batch o"]:
        y = x.astype(self.weight.dtype) @ self.weight
        return y if self.bias is None else add_bias(y, self.bias)


class Conv2d(eqx.Module):
    """NHWC 2-D convolution, `[b, h, w, cin] -> [b, h/stride, w/stride, cout]`.

    Kernel is HWIO; padding defaults to `kernel_size // 2` on each side (PyTorch style, so a
    3x3 stride-2 conv halves even sizes). Init is PyTorch's U(±1/sqrt(k*k*cin)).
    """

    weight: Float[Array, "kh kw i o"]
    bias: Float[Array, " o"]
    stride: int = eqx.field(static=True)
    padding: int = eqx.field(static=True)

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        *,
        stride: int = 1,
        padding: int | None = None,
        key: PRNGKeyArray,
    ):
        wkey, bkey = jax.random.split(key)
        fan_in = kernel_size * kernel_size * in_channels
        self.weight = torch_uniform(wkey, (kernel_size, kernel_size, in_channels, out_channels), fan_in)
        self.bias = torch_uniform(bkey, (out_channels,), fan_in)
        self.stride = stride
        self.padding = kernel_size // 2 if padding is None else padding

    def __call__(self, x: Float[Array, "b h w i"]) -> Float[Array, "b h2 w2 o"]:
        y = conv2d(x.astype(self.weight.dtype), self.weight, self.stride, self.padding)
        return add_bias(y, self.bias)


class Embedding(eqx.Module):
    """Lookup table `[n, d]`; rows drawn from N(0, std²)."""

    weight: Float[Array, "n d"]

    def __init__(self, num: int, dim: int, *, std: float = 1.0, key: PRNGKeyArray):
        self.weight = _normal(key, (num, dim), std)

    def __call__(self, ids: Int[Array, " b"]) -> Float[Array, "b d"]:
        return self.weight[ids]


class GroupNorm(eqx.Module):
    """GroupNorm (Wu & He 2018) on NHWC with a per-channel affine; statistics in float32."""

    weight: Float[Array, " c"]
    bias: Float[Array, " c"]
    groups: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, groups: int, channels: int, *, eps: float = 1e-5):
        if channels % groups:
            raise ValueError(f"GroupNorm: {channels} channels do not split into {groups} groups")
        self.groups, self.eps = groups, eps
        self.weight = jax.device_put(np.ones(channels, np.float32))  # not jnp.asarray: no compile per shape
        self.bias = jax.device_put(np.zeros(channels, np.float32))

    def __call__(self, x: Float[Array, "b h w c"]) -> Float[Array, "b h w c"]:
        b, h, w, c = x.shape
        rows = x.astype(jnp.float32).reshape(b, h * w, c)
        centred = rows - self._group_mean(rows)
        var = self._group_mean(jnp.square(centred))  # two passes, as torch: no E[x²] - E[x]² cancellation
        y = (centred * jax.lax.rsqrt(var + self.eps)).reshape(b, h, w, c)
        return affine(y, self.weight.astype(jnp.float32), self.bias.astype(jnp.float32)).astype(x.dtype)

    def _group_mean(self, rows: Float[Array, "b p c"]) -> Float[Array, "b 1 c"]:
        """Each channel's group mean over the positions and the group's channels, in two sums: per channel
        over the positions (the middle axis of [b, p, c]), then over the group's channels. The same number as
        one mean over the (h, w, c/g) axes of a [b, h, w, g, c/g] view, summed in another order; XLA:CPU fuses
        this order differently with the ops around it, and whole UNet training steps measured faster with it,
        where a GroupNorm alone does not (BENCHMARKS.md, "GroupNorm's sums in two stages")."""
        b, p, c = rows.shape
        per_group = rows.sum(axis=1).reshape(b, self.groups, c // self.groups).sum(axis=-1) / (p * c // self.groups)
        return jnp.repeat(per_group, c // self.groups, axis=-1)[:, None, :]


def layer_norm(x: Float[Array, "*batch d"], eps: float = 1e-6) -> Float[Array, "*batch d"]:
    """LayerNorm without affine (DiT's adaLN blocks supply scale/shift); float32 statistics."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


class SelfAttention(eqx.Module):
    """Multi-head self-attention (Vaswani et al. 2017) on tokens `[b, n, d]`.

    softmax(Q Kᵀ / sqrt(d_head)) V by `eqxdiff.nn.attention` (logits and softmax in float32 even
    for bf16 inputs; the form chosen there by backend and shape).
    """

    qkv: Dense
    proj: Dense
    num_heads: int = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, *, key: PRNGKeyArray):
        if dim % num_heads:
            raise ValueError(f"SelfAttention: dim {dim} is not divisible by num_heads {num_heads}")
        k1, k2 = jax.random.split(key)
        self.qkv, self.proj = Dense(dim, 3 * dim, key=k1), Dense(dim, dim, key=k2)
        self.num_heads = num_heads

    def __call__(self, x: Float[Array, "b n d"]) -> Float[Array, "b n d"]:
        b, n, d = x.shape
        # split before the heads: a reshape of the lanes, no relayout (attention_one_block takes `[b, n, h·d]`)
        heads = lambda t: t.reshape(b, n, self.num_heads, d // self.num_heads)  # noqa: E731
        q, k, v = map(heads, jnp.split(self.qkv(x), 3, axis=-1))
        return self.proj(attention(q, k, v).reshape(b, n, d))


class CrossAttention(eqx.Module):
    """Multi-head cross-attention (Vaswani et al. 2017; the text conditioning of LDM, Rombach et
    al. 2022): queries from tokens `x [b, n, dim]`, keys and values from a context
    `[b, m, context_dim]`, `-> [b, n, dim]` through an output projection.

    softmax(Q Kᵀ / sqrt(d_head)) V per head by `eqxdiff.nn.attention` (logits and softmax in
    float32, as `SelfAttention`). `mask [b, m]` (nonzero = attend, 0 = padding)
    removes keys: a padded token's logit is replaced before the softmax, so its weight is exactly
    0 and its value has no effect at all. A row whose mask is all zero attends to nothing and
    reads zero (not softmax's uniform average over padding).
    """

    q: Dense
    kv: Dense
    proj: Dense
    num_heads: int = eqx.field(static=True)

    def __init__(self, dim: int, context_dim: int, num_heads: int, *, key: PRNGKeyArray):
        if dim % num_heads:
            raise ValueError(f"CrossAttention: dim {dim} is not divisible by num_heads {num_heads}")
        k1, k2, k3 = jax.random.split(key, 3)
        self.q, self.kv = Dense(dim, dim, key=k1), Dense(context_dim, 2 * dim, key=k2)
        self.proj, self.num_heads = Dense(dim, dim, key=k3), num_heads

    def __call__(
        self,
        x: Float[Array, "b n d"],
        context: Float[Array, "b m e"],
        mask: Int[Array, "b m"] | Bool[Array, "b m"] | None = None,
    ) -> Float[Array, "b n d"]:
        b, n, d = x.shape
        m, heads = context.shape[1], self.num_heads
        q = self.q(x).reshape(b, n, heads, d // heads)
        k, v = (t.reshape(b, m, heads, d // heads) for t in jnp.split(self.kv(context), 2, axis=-1))
        if mask is None:
            out = attention(q, k, v)
        else:
            keep = mask != 0
            out = attention(q, k, v, mask=jnp.broadcast_to(keep[:, None, None, :], (b, 1, n, m)))
            out = jnp.where(keep.any(axis=-1)[:, None, None, None], out, jnp.zeros((), out.dtype))
        return self.proj(out.reshape(b, n, d))


def unpack_text_cond(
    cond: Any, batch_size: int, context_dim: int, pooled_dim: int, model: str
) -> tuple[Array, Array, Array | None]:
    """Check a text-conditioned model's `cond` and return `(context [b, n, context_dim],
    mask [b, n], pooled [b, pooled_dim] or None)`.

    `cond` must be a `TextCond` with `context` f32[b, n, context_dim], `mask` int32 (or bool)[b, n]
    (1 = token, 0 = padding) and `pooled` f32[b, pooled_dim] when `pooled_dim > 0`, None when not.
    Runs at trace time: a wrong condition raises before anything compiles.
    """
    config = f"{model}(context_dim={context_dim}, pooled_dim={pooled_dim})"
    want = f"TextCond(context, mask, {'pooled' if pooled_dim else 'pooled=None'})"
    if cond is None:
        raise ValueError(
            f"{config} is text-conditioned and got cond=None. Pass the text condition, a {want}; for 'no "
            "condition' (guidance, condition dropout) pass the run's null condition (the text encoder's encoding "
            'of "", or zeros) - the model cannot make it: its null_cond() is None.'
        )
    if not isinstance(cond, TextCond):
        got = f"a dict with keys {sorted(cond)}" if isinstance(cond, Mapping) else type(cond).__name__
        got = f"an array {cond.dtype}{list(cond.shape)} (labels?)" if eqx.is_array(cond) else got
        raise ValueError(f"{config} takes cond = {want} (eqxdiff.nn.TextCond); got {got}")
    context, mask, pooled = cond.context, cond.mask, cond.pooled
    if context.ndim != 3 or context.shape[0] != batch_size or context.shape[2] != context_dim:
        raise ValueError(f"{config}: cond.context must be [{batch_size}, n, {context_dim}]; got {context.shape}")
    if mask.shape != context.shape[:2] or jnp.issubdtype(mask.dtype, jnp.floating):
        raise ValueError(
            f"{config}: cond.mask must be int32 (or bool) {context.shape[:2]}, 1 = token, 0 = padding; "
            f"got {mask.dtype}{mask.shape}"
        )
    if (pooled is None) != (pooled_dim == 0):
        has = "has no pooled vector" if pooled is None else "has a pooled vector"
        raise ValueError(f"{config}: cond {has}; the model takes {want} (build it with pooled_dim=0 to take none)")
    if pooled is not None and pooled.shape != (batch_size, pooled_dim):
        raise ValueError(f"{config}: cond.pooled must be [{batch_size}, {pooled_dim}]; got {pooled.shape}")
    return context, mask, pooled


def timestep_embedding(t: Float[Array, " b"], dim: int, max_period: float = 10000.0) -> Float[Array, "b d"]:
    """Sinusoidal embedding of ADM (Dhariwal & Nichol 2021, `timestep_embedding`), float32.

    freqs_i = exp(-ln(max_period) * i / (dim // 2)), emb = [cos(t * freqs), sin(t * freqs)]
    (zero-padded to `dim` when odd). Works for any real t: indices, c_noise, flow time.
    """
    half = dim // 2
    freqs = jnp.asarray(np.exp(-math.log(max_period) * np.arange(half, dtype=np.float32) / half))
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    emb = jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)
    return jnp.pad(emb, ((0, 0), (0, dim % 2)))


class TimestepEmbedding(eqx.Module):
    """t -> sinusoidal(freq_dim) -> Dense -> SiLU -> Dense, `[b] -> [b, features]` (ADM/DiT)."""

    fc1: Dense
    fc2: Dense
    freq_dim: int = eqx.field(static=True)

    def __init__(self, freq_dim: int, features: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.fc1, self.fc2 = Dense(freq_dim, features, key=k1), Dense(features, features, key=k2)
        self.freq_dim = freq_dim

    def __call__(self, t: Float[Array, " b"]) -> Float[Array, "b e"]:
        return self.fc2(jax.nn.silu(self.fc1(timestep_embedding(t, self.freq_dim))))


class TwoTimeEmbedding(eqx.Module):
    """A network of two times' time embedding (MeanFlow, Geng et al. 2025): t's and the interval t − r's, each its
    own `TimestepEmbedding`, summed (the official DiT's t_embedder + h_embedder). No interval: r = t, the network's
    instantaneous velocity. It replaces a network's `time_embed`, so a network of one time keeps its pytree."""

    time: TimestepEmbedding
    interval: TimestepEmbedding

    def __call__(self, t: Float[Array, " b"], interval: Float[Array, " b"] | None = None) -> Float[Array, "b e"]:
        return self.time(t) + self.interval(jnp.zeros_like(t) if interval is None else interval.astype(t.dtype))


def embed_times(
    embed: TimestepEmbedding | TwoTimeEmbedding,
    t: Float[Array, " b"],
    interval: Float[Array, " b"] | None,
    network: str,
) -> Float[Array, "b e"]:
    """A network's time embedding of t, and of `interval` = t − r for a network of two times; a network of one
    time refuses an interval."""
    if isinstance(embed, TwoTimeEmbedding):
        return embed(t, interval)
    if interval is not None:
        raise ValueError(f"{network} was built for one time; a second (interval=t-r) needs interval_embedding=True")
    return embed(t)


def sincos_pos_embed_2d(dim: int, grid: int, grid_w: int | None = None) -> np.ndarray:
    """Fixed 2-D sin-cos position embedding of MAE (He et al. 2022), `[grid*grid_w, dim]` numpy,
    tokens in row-major order over a `grid` × `grid_w` grid (square when `grid_w` is None).

    Half the channels encode the row, half the column, each as [sin(p*ω), cos(p*ω)] with
    ω_i = 1 / 10000^(i / (dim/4)). Returned as numpy so it is a compile-time constant.
    """
    if dim % 4:
        raise ValueError(f"sincos_pos_embed_2d: dim {dim} must be divisible by 4")
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4))
    rows, cols = np.arange(grid, dtype=np.float64), np.arange(grid if grid_w is None else grid_w, dtype=np.float64)
    gw, gh = np.meshgrid(cols, rows)

    def one_axis(pos: np.ndarray) -> np.ndarray:
        out = pos.reshape(-1)[:, None] * omega[None]
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    # MAE order: first half from the column index (w), second from the row index (h).
    return np.concatenate([one_axis(gw), one_axis(gh)], axis=1).astype(np.float32)


def zero_init(module: eqx.Module) -> eqx.Module:
    """Return `module` with every floating-point array leaf set to zero (adaLN-Zero, ADM)."""
    # numpy zeros + transfer: no per-shape compile.
    return jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype)) if eqx.is_inexact_array(a) else a, module)


def reinit(
    module: eqx.Module, init: Callable[[PRNGKeyArray, tuple[int, ...]], Array], *, key: PRNGKeyArray
) -> eqx.Module:
    """Return a `Dense`/`Conv2d`/`Embedding` with its weight redrawn by `init` and bias zeroed.

    Used for DiT's init (xavier-uniform linears, N(0, 0.02²) embeddings). The weight's fan-in
    and fan-out are taken over all but the last axis / the last axis.
    """
    module = eqx.tree_at(lambda m: m.weight, module, init(key, module.weight.shape))
    if getattr(module, "bias", None) is not None:
        module = eqx.tree_at(lambda m: m.bias, module, jax.device_put(np.zeros(module.bias.shape, module.bias.dtype)))
    return module


def xavier_uniform(key: PRNGKeyArray, shape: tuple[int, ...]) -> Array:
    """Glorot & Bengio 2010: U(±sqrt(6 / (fan_in + fan_out))), fan_in = prod(shape[:-1])."""
    fan_in, fan_out = math.prod(shape[:-1]), shape[-1]
    return _uniform(key, shape, math.sqrt(6.0 / (fan_in + fan_out)))
