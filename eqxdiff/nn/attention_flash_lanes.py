"""Flash attention's forward pass on a TPU with the heads side by side in the lanes, `[b, n, h·d]`, for long
sequences whose heads tile the 128 lanes (head size 32, 64 or 128: SD 2's and SDXL's UNets, head size 64).

Why not Pallas' own flash kernel alone (`jax.experimental.pallas.ops.tpu.flash_attention`): it takes the heads in
front, `[b, h, n, d]`, so every q, k, v and output crosses HBM once more as a transpose of the projections' layout,
and its grid walks one (batch, head) pair a step: at SDXL's 4096 tokens a step is a 512×512 block of one head of 64,
little work against a step's fixed cost (BENCHMARKS.md, SDXL's profile). Here a grid step takes one block of queries
and keys of every head: the heads of a 128-lane window (two of 64) are read together, each head's logits computed from
the window with the other heads' columns zeroed (exact: they add zeros; the MXU contracts 128 lanes either way, so a
head of 64 costs what it costs alone), and `p v` of the window's masked values lands in that head's columns only.

The forward pass alone: sampling calls it. A gradient takes the `gradient` form it is given, forward and backward
(`custom_vjp`; `eqxdiff.nn.attention` gives Pallas' flash on the heads in front): training is what it was.

The math is the online softmax of Dao et al. 2022 (Algorithm 1) over key blocks: per query row a running maximum
m and sum l of exp(s − m) in float32, the output accumulated unnormalised in float32 and divided by l at the last
key block; the logits `q kᵀ` in float32 scaled by 1/sqrt(d) after the product, as `jax.nn.dot_product_attention`,
the probabilities cast to v's dtype before `p v`. `eqxdiff.nn.attention` chooses this form by backend and shape;
tests run it in Pallas' interpreter on the CPU against the plain form.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float

LANES = 128  # a TPU vector register's minor dimension: a window of the heads' lanes
_NT = (((1,), (1,)), ((), ()))  # a · bᵀ: contract both operands' last axes


def takes(n: int, m: int, heads: int, d: int) -> bool:
    """Whether this form runs `[b, n, heads, d]` queries on m keys: heads that tile 128 lanes, whole blocks of 128."""
    return LANES % d == 0 and (heads * d) % LANES == 0 and n % LANES == 0 and m % LANES == 0


def _own(x: Array, lo: int, hi: int) -> Array:
    """`x` (a window's 128 lanes) with the lanes outside `[lo, hi)` zeroed: the where in float32, as a v5e's vector
    unit has no bf16 arithmetic."""
    cols = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.where((cols >= lo) & (cols < hi), x.astype(jnp.float32), 0.0).astype(x.dtype)


def _kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, d: int, last: int):
    """One (batch element, query block, key block) step: q_ref, o_ref `[bq, h·d]`; k_ref, v_ref `[bk, h·d]`;
    scratch m_ref, l_ref `[h, bq, LANES]` (each row's value repeated over the lanes), acc_ref `[bq, h·d]` float32."""
    per_window, bq = LANES // d, q_ref.shape[0]
    cols = lax.broadcasted_iota(jnp.int32, (bq, LANES), 1)
    repeats = k_ref.shape[0] // LANES

    @pl.when(pl.program_id(2) == 0)
    def _start():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    for w in range(q_ref.shape[1] // LANES):
        window = pl.ds(w * LANES, LANES)
        q_window, k_window, v_window = q_ref[:, window], k_ref[:, window], v_ref[:, window]
        acc = acc_ref[:, window]
        for i in range(per_window):
            head, lo, hi = w * per_window + i, i * d, (i + 1) * d
            q = q_window if per_window == 1 else _own(q_window, lo, hi)
            v = v_window if per_window == 1 else _own(v_window, lo, hi)
            s = lax.dot_general(q, k_window, _NT, preferred_element_type=jnp.float32) * d**-0.5  # [bq, bk]
            m_prev = m_ref[head]
            m_next = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))  # [bq, LANES]
            p = jnp.exp(s - jnp.tile(m_next, (1, repeats)))
            alpha = jnp.exp(m_prev - m_next)
            l_ref[head] = alpha * l_ref[head] + p.sum(axis=-1, keepdims=True)
            m_ref[head] = m_next
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # this head's columns alone
            rescaled = acc * alpha if per_window == 1 else jnp.where((cols >= lo) & (cols < hi), acc * alpha, acc)
            acc = rescaled + pv
        acc_ref[:, window] = acc

    @pl.when(pl.program_id(2) == last)
    def _finish():
        for w in range(q_ref.shape[1] // LANES):
            window = pl.ds(w * LANES, LANES)
            l = l_ref[w * per_window]
            for i in range(1, per_window):
                l = jnp.where(cols >= i * d, l_ref[w * per_window + i], l)
            o_ref[:, window] = (acc_ref[:, window] / l).astype(o_ref.dtype)


def block_size(length: int, block: int) -> int:
    """The largest whole number of 128-token tiles up to `block` that divides `length` (a multiple of 128)."""
    size = min(length, block) // LANES * LANES
    while length % size:
        size -= LANES
    return size


def _forward(q: Array, k: Array, v: Array, heads: int, d: int, block: int) -> Array:
    """The kernel over `[b, n, h·d]` queries and `[b, m, h·d]` keys and values, blocks of up to `block` tokens."""
    b, n, width = q.shape
    m = k.shape[1]
    bq, bk = block_size(n, block), block_size(m, block)
    rows = pl.BlockSpec((None, bq, width), lambda i, j, t: (i, j, 0))
    keys = pl.BlockSpec((None, bk, width), lambda i, j, t: (i, t, 0))
    # the blocks double-buffered, the scratch, a head's float32 logits and probabilities, and room to spare
    blocks = 2 * (2 * bq + 2 * bk) * width * q.dtype.itemsize
    vmem = blocks + (2 * heads * LANES + width) * bq * 4 + 4 * bq * bk * 4 + 8 * 2**20
    cost = pl.CostEstimate(
        flops=4 * b * heads * n * m * d,
        transcendentals=b * heads * n * m,
        bytes_accessed=sum(x.size * x.dtype.itemsize for x in (q, k, v, q)),
    )
    return pl.pallas_call(
        functools.partial(_kernel, d=d, last=m // bk - 1),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(b, n // bq, m // bk),
            in_specs=[rows, keys, keys],
            out_specs=rows,
            scratch_shapes=[
                pltpu.VMEM((heads, bq, LANES), jnp.float32),
                pltpu.VMEM((heads, bq, LANES), jnp.float32),
                pltpu.VMEM((bq, width), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=max(32 * 2**20, vmem)
        ),
        cost_estimate=cost,
    )(q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash_lanes(q, k, v, gradient, block: int):
    b, n, h, d = q.shape
    lanes = lambda x: x.reshape(x.shape[0], x.shape[1], h * d)  # noqa: E731
    return _forward(lanes(q), lanes(k), lanes(v), h, d, block).reshape(b, n, h, d)


def _flash_lanes_forward(q, k, v, gradient, block):
    return jax.vjp(gradient, q, k, v)  # (the output, its pullback as the residual)


def _flash_lanes_backward(gradient, block, pullback, do):
    return pullback(do)


_flash_lanes.defvjp(_flash_lanes_forward, _flash_lanes_backward)


def flash_lanes(
    q: Float[Array, "b n h d"],
    k: Float[Array, "b m h d"],
    v: Float[Array, "b m h d"],
    gradient,
    block: int = 512,
) -> Float[Array, "b n h d"]:
    """softmax(q kᵀ / sqrt(d)) v per head, unmasked, in v's dtype, blocks of up to `block` queries and keys; off a
    TPU only inside Pallas' interpreter. The heads travel side by side, `[b, n, h·d]` (a reshape, no transpose: it
    undoes the projection's); `takes(n, m, h, d)` must hold. `gradient`: the attention a gradient differentiates
    (its forward computes the same values; `eqxdiff.nn.attention` passes Pallas' flash on the heads in front)."""
    n, h, d = q.shape[1], q.shape[2], q.shape[3]
    if not takes(n, k.shape[1], h, d):
        raise ValueError(
            f"attention: flash_lanes takes heads that tile {LANES} lanes and whole blocks of {LANES} tokens; "
            f"got n={n}, m={k.shape[1]}, {h} heads of {d}"
        )
    return _flash_lanes(q, k, v, gradient, block)
