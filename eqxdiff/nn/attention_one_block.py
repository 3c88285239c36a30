"""Attention for short sequences on a TPU as one Pallas kernel per pass: each head's whole `[n, m]` logits in the
core's VMEM, the softmax over all m keys at once (no online softmax: the sequence is one block), and the backward
pass one kernel that recomputes the probabilities from q and k and writes dq, dk and dv together.

Why not Pallas' flash kernel at DiT's 256 tokens: its grid walks one (batch, head) pair per step, and its backward
is two kernels (dk/dv, then dq) that each recompute the logits; at 256 tokens a pair is a few microseconds of work,
so the steps' overhead dominates. Why not XLA's form: it writes the float32 logits and the probabilities of every
head to HBM and reads them back, forward and backward, and keeps the probabilities for the backward pass
(`[b, h, n, m]` bf16 per layer). Here only q, k and v are kept.

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

# Logits one grid step holds (float32, with the probabilities and their gradients: ~16 bytes each in VMEM): 8
# (batch, head) pairs at 256 tokens, few enough for the default VMEM limit, enough to hide a step's overhead.
LOGITS_PER_STEP = 8 * 256 * 256
ONE_BLOCK_UP_TO = 512 * 512  # the most logits per pair (n·m) this form takes: one pair a step at 512 tokens
_NT = (((1,), (1,)), ((), ()))  # a · bᵀ: contract both operands' last axes


def _softmax(q, k, scale):
    logits = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
    p = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    return p * pl.reciprocal(p.sum(axis=-1, keepdims=True), approx=False)


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, *, scale: float):
    for i in range(q_ref.shape[0]):
        v = v_ref[i]
        p = _softmax(q_ref[i], k_ref[i], scale).astype(v.dtype)
        o_ref[i] = jnp.dot(p, v, preferred_element_type=jnp.float32).astype(o_ref.dtype)


def _backward_kernel(q_ref, k_ref, v_ref, do_ref, dq_ref, dk_ref, dv_ref, *, scale: float):
    for i in range(q_ref.shape[0]):
        q, k, v, do = q_ref[i], k_ref[i], v_ref[i], do_ref[i]
        p = _softmax(q, k, scale)
        dv_ref[i] = jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32).astype(dv_ref.dtype)
        dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
        ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True))
        dq = jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale
        dk = jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32) * scale
        dq_ref[i], dk_ref[i] = dq.astype(dq_ref.dtype), dk.astype(dk_ref.dtype)


def _pairs_per_step(pairs: int, logits: int) -> int:
    return max(d for d in range(1, max(1, LOGITS_PER_STEP // logits) + 1) if pairs % d == 0)


def _call(kernel, inputs, outputs):
    """`kernel` over `[pairs, len, d]` operands, `_pairs_per_step` pairs a grid step, each operand whole per pair."""
    pairs, n, m = inputs[0].shape[0], inputs[0].shape[1], inputs[1].shape[1]
    step = _pairs_per_step(pairs, n * m)
    spec = lambda x: pl.BlockSpec((step, *x.shape[1:]), lambda i: (i, 0, 0))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(pairs // step,),
        in_specs=[spec(x) for x in inputs],
        out_specs=[spec(x) for x in outputs],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outputs],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
    )(*inputs)


@jax.custom_vjp
def _one_block(q, k, v):
    (o,) = _call(functools.partial(_forward_kernel, scale=q.shape[-1] ** -0.5), (q, k, v), (q,))
    return o


def _one_block_forward(q, k, v):
    return _one_block(q, k, v), (q, k, v)


def _one_block_backward(residuals, do):
    q, k, v = residuals
    kernel = functools.partial(_backward_kernel, scale=q.shape[-1] ** -0.5)
    return tuple(_call(kernel, (q, k, v, do.astype(q.dtype)), (q, k, v)))


_one_block.defvjp(_one_block_forward, _one_block_backward)


def one_block(
    q: Float[Array, "b n h d"], k: Float[Array, "b m h d"], v: Float[Array, "b m h d"]
) -> Float[Array, "b n h d"]:
    """softmax(q kᵀ / sqrt(d)) v per head, unmasked, in v's dtype; off a TPU only inside Pallas' interpreter
    (`attention_form("one_block")`)."""
    b, n, h, d = q.shape
    m = k.shape[1]
    if n * m > ONE_BLOCK_UP_TO:
        raise ValueError(f"attention: one_block takes up to {ONE_BLOCK_UP_TO} logits a head (n·m); got n={n}, m={m}")
    pairs = lambda x, length: jnp.swapaxes(x, 1, 2).reshape(b * h, length, d)  # noqa: E731
    out = _one_block(pairs(q, n), pairs(k, m), pairs(v, m))
    return jnp.swapaxes(out.reshape(b, h, n, d), 1, 2)
