"""`remat=True`: a block's activations are recomputed in the backward pass instead of kept.

Blocks run under `eqx.filter_checkpoint` with `REMAT_POLICY`: matmul/conv outputs without batch
dims are saved, everything else is recomputed from the block's input (Chen et al. 2016,
"Training deep nets with sublinear memory cost").

On XLA:CPU recomputing alone saved little: its memory-optimized scheduler deferred the
parameter gradients (weight-gradient matmuls, norm-scale reductions) to the end of the step,
where gradient clipping needs them all, which kept each block's recomputed activations and
cotangents alive until then (UNet step 830 -> 807 MiB of temp). So, on CPU, a block's input
cotangents are made to depend on its parameter cotangents: the backward pass cannot move on to
earlier blocks before the block's parameter gradients exist (830 -> 637 MiB; DiT-S 4224 ->
2251). The dependency adds `0 * max(grad)` per parameter, not an optimization barrier: XLA:CPU
drops barriers before scheduling, and a sum would be folded into the producing reduction.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

REMAT_POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


@jax.custom_vjp
def _backward_after_param_grads(block_and_inputs):
    """Identity on (block, args, kwargs) float leaves; see the module docstring for the backward."""
    return block_and_inputs


def _forward(block_and_inputs):
    return block_and_inputs, None


def _backward(_, cotangents):
    block, args, kwargs = cotangents
    param_grads = [g for g in jax.tree.leaves(block) if g.size]
    if not param_grads:
        return (cotangents,)
    # max, not sum: XLA would merge a sum into the reduction that produced the gradient and
    # leave the gradient itself to be scheduled late. The where keeps an inf in one gradient
    # from turning every earlier block's gradients into NaN (0 * inf).
    peak = sum(jnp.max(g).astype(jnp.float32) for g in param_grads)
    zero = 0.0 * jnp.where(jnp.isfinite(peak), peak, 0.0)
    args, kwargs = jax.tree.map(lambda c: c + zero.astype(c.dtype), (args, kwargs))
    return ((block, args, kwargs),)


_backward_after_param_grads.defvjp(_forward, _backward)


def checkpointed(block: Callable, remat: bool) -> Callable:
    """`block(*args, **kwargs)`, rematerialised when `remat`.

    The block is passed to `filter_checkpoint` as an argument (not closed over), which keeps its
    parameters visible to the policy. On CPU (custom_vjp): no forward-mode autodiff through it,
    and a gradient with respect to the inputs alone computes the parameter gradients too.
    """
    if not remat:
        return block
    run = eqx.filter_checkpoint(lambda blk, *a, **kw: blk(*a, **kw), policy=REMAT_POLICY)

    def call(*args, **kwargs):
        if jax.default_backend() != "cpu":
            return run(block, *args, **kwargs)
        floats, rest = eqx.partition((block, args, kwargs), eqx.is_inexact_array)
        blk, a, kw = eqx.combine(_backward_after_param_grads(floats), rest)
        return run(blk, *a, **kw)

    return call
