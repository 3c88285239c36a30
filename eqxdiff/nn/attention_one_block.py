"""Attention for short sequences on a TPU as one Pallas kernel per pass: each head's whole `[n, m]` logits in the
core's VMEM, the softmax over all m keys at once (no online softmax: the sequence is one block), and the backward
pass one kernel that recomputes the probabilities from q and k and writes dq, dk and dv together.

Why not Pallas' flash kernel at DiT's 256 tokens: its grid walks one (batch, head) pair per step, and its backward
is two kernels (dk/dv, then dq) that each recompute the logits; at 256 tokens a pair is a few microseconds of work,
so the steps' overhead dominates. Why not XLA's form: it writes the float32 logits and the probabilities of every
head to HBM and reads them back, forward and backward, and keeps the probabilities for the backward pass
(`[b, h, n, m]` bf16 per layer). Here only q, k and v are kept.

The kernels read the tokens as the projections write them, `[b, n, h·d]` (the heads side by side in the lanes):
moving the heads in front (`[b, h, n, d]`) is a transpose of every q, k, v and output through HBM, which at DiT-XL's
head size 72 took 27% of DDPM sampling's device time on a v5e (a trace, BENCHMARKS.md). A head's 72 columns do
not start on a 128-lane boundary, and Mosaic loads bf16 only there: each head reads the aligned window of 128-lane
tiles around its columns with the other heads' columns zeroed, and adds its result into that window of the output
(exact: every other head adds zeros there).

The math is `jax.nn.dot_product_attention`'s: logits `q kᵀ` in float32, scaled by 1/sqrt(d) after the product,
softmax in float32, the probabilities cast to v's dtype before `p v`. Its backward is the softmax's
(Dao et al. 2022, eq. in §B.2): dv = pᵀ do, dp = do vᵀ, ds = p ⊙ (dp − rowsum(p ⊙ dp)), dq = ds k / sqrt(d),
dk = dsᵀ q / sqrt(d). `eqxdiff.nn.attention` chooses this form by backend and shape; tests run it in Pallas'
interpreter on the CPU against the plain form.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float

# Logits one grid step holds (float32, with the probabilities and their gradients: ~16 bytes each in VMEM): the
# batch elements a step takes (all their heads) hold up to this many, at least one.
LOGITS_PER_STEP = 8 * 256 * 256
ONE_BLOCK_UP_TO = 1024 * 1024  # the most logits a head (n·m) this form takes: 4 MiB of float32 a head in VMEM
LANES = 128  # a TPU vector register's minor dimension: loads and stores of bf16 start on a multiple of it
_NT = (((1,), (1,)), ((), ()))  # a · bᵀ: contract both operands' last axes


def _windows(heads: int, d: int) -> list[tuple[int, int, int, int]]:
    """Per head: the aligned columns `[start, end)` holding its `d` columns, and theirs within that window."""
    windows = []
    for i in range(heads):
        lo, hi = i * d, (i + 1) * d
        start, end = lo // LANES * LANES, -(-hi // LANES) * LANES
        windows.append((start, end, lo - start, hi - start))
    return windows


def _head(x: Array, window) -> Array:
    """A head's window `x` (loaded as `ref[j, :, start:end]`), the columns of other heads zeroed."""
    start, end, lo, hi = window
    if (lo, hi) == (0, end - start):
        return x
    cols = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.where((cols >= lo) & (cols < hi), x.astype(jnp.float32), 0.0).astype(x.dtype)


def _softmax(q, k, scale):
    logits = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
    p = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    return p * pl.reciprocal(p.sum(axis=-1, keepdims=True), approx=False)


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, *, heads: int, d: int):
    scale = d**-0.5
    for j in range(q_ref.shape[0]):
        o_ref[j] = jnp.zeros(o_ref.shape[1:], o_ref.dtype)
        for window in _windows(heads, d):
            start, end = window[:2]
            v = _head(v_ref[j, :, start:end], window)
            p = _softmax(_head(q_ref[j, :, start:end], window), k_ref[j, :, start:end], scale).astype(v.dtype)
            out = jnp.dot(p, v, preferred_element_type=jnp.float32).astype(o_ref.dtype)
            o_ref[j, :, start:end] += out


def _backward_kernel(q_ref, k_ref, v_ref, do_ref, dq_ref, dk_ref, dv_ref, *, heads: int, d: int):
    scale = d**-0.5
    for j in range(q_ref.shape[0]):
        for ref in (dq_ref, dk_ref, dv_ref):
            ref[j] = jnp.zeros(ref.shape[1:], ref.dtype)
        for window in _windows(heads, d):
            start, end = window[:2]
            k_window = k_ref[j, :, start:end]  # loaded once: whole for the logits, masked for dq
            q, k, do = (_head(x, window) for x in (q_ref[j, :, start:end], k_window, do_ref[j, :, start:end]))
            p = _softmax(q, k_window, scale)
            dv = jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
            dp = lax.dot_general(do, v_ref[j, :, start:end], _NT, preferred_element_type=jnp.float32)
            ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True))
            dq = jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale
            dk = jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32) * scale
            dq_ref[j, :, start:end] += dq.astype(dq_ref.dtype)
            dk_ref[j, :, start:end] += dk.astype(dk_ref.dtype)
            dv_ref[j, :, start:end] += dv.astype(dv_ref.dtype)


def _call(kernel, inputs, outputs, heads: int):
    """`kernel` over `[b, len, h·d]` operands, some batch elements a grid step, each operand whole per element."""
    b, n, m = inputs[0].shape[0], inputs[0].shape[1], inputs[1].shape[1]
    step = max(s for s in range(1, b + 1) if b % s == 0 and (s == 1 or s * heads * n * m <= LOGITS_PER_STEP))
    spec = lambda x: pl.BlockSpec((step, *x.shape[1:]), lambda i: (i, 0, 0))  # noqa: E731
    # the blocks, double-buffered, and one head's float32 logits, probabilities and their gradients
    blocks = sum(step * x.shape[1] * x.shape[2] * x.dtype.itemsize for x in (*inputs, *outputs))
    vmem = 2 * blocks + 8 * n * m * 4
    return pl.pallas_call(
        kernel,
        grid=(b // step,),
        in_specs=[spec(x) for x in inputs],
        out_specs=[spec(x) for x in outputs],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outputs],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=max(32 * 2**20, vmem + 8 * 2**20)
        ),
    )(*inputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _one_block(q, k, v, heads: int, d: int):
    (o,) = _call(functools.partial(_forward_kernel, heads=heads, d=d), (q, k, v), (q,), heads)
    return o


def _one_block_forward(q, k, v, heads, d):
    return _one_block(q, k, v, heads, d), (q, k, v)


def _one_block_backward(heads, d, residuals, do):
    q, k, v = residuals
    kernel = functools.partial(_backward_kernel, heads=heads, d=d)
    return tuple(_call(kernel, (q, k, v, do.astype(q.dtype)), (q, k, v), heads))


_one_block.defvjp(_one_block_forward, _one_block_backward)


def one_block(
    q: Float[Array, "b n h d"], k: Float[Array, "b m h d"], v: Float[Array, "b m h d"]
) -> Float[Array, "b n h d"]:
    """softmax(q kᵀ / sqrt(d)) v per head, unmasked, in v's dtype; off a TPU only inside Pallas' interpreter
    (`attention_form("one_block")`). The heads travel side by side, `[b, n, h·d]` (a reshape, no transpose: it
    undoes the projection's), the lanes padded to whole tiles of 128 where h·d is not."""
    b, n, h, d = q.shape
    m = k.shape[1]
    if n * m > ONE_BLOCK_UP_TO:
        raise ValueError(f"attention: one_block takes up to {ONE_BLOCK_UP_TO} logits a head (n·m); got n={n}, m={m}")
    pad = -(h * d) % LANES

    def lanes(x):
        x = x.reshape(x.shape[0], x.shape[1], h * d)
        return jnp.pad(x, ((0, 0), (0, 0), (0, pad))) if pad else x

    out = _one_block(lanes(q), lanes(k), lanes(v), h, d)
    return out[..., : h * d].reshape(b, n, h, d)
