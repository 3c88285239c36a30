"""`remat=True`: a block's activations are recomputed in the backward pass instead of kept.

Blocks run under `eqx.filter_checkpoint` with `REMAT_POLICY`: matmul/conv outputs without batch
dims are saved, everything else is recomputed from the block's input (Chen et al. 2016,
"Training deep nets with sublinear memory cost"). With `eqxdiff.xla_cpu` on and the CPU backend,
each block's input cotangents also wait for its parameter gradients
(`xla_cpu.backward_after_param_grads`), which lets XLA:CPU's scheduler free the block's
recomputed activations before the end of the backward pass.
"""

from collections.abc import Callable

import equinox as eqx
import jax

from eqxdiff import xla_cpu

REMAT_POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def checkpointed(block: Callable, remat: bool) -> Callable:
    """`block(*args, **kwargs)`, rematerialised when `remat`.

    The block is passed to `filter_checkpoint` as an argument (not closed over), which keeps its
    parameters visible to the policy. With `eqxdiff.xla_cpu` on, on CPU (custom_vjp): no
    forward-mode autodiff through it, and a gradient with respect to the inputs alone computes
    the parameter gradients too.
    """
    if not remat:
        return block
    run = eqx.filter_checkpoint(lambda blk, *a, **kw: blk(*a, **kw), policy=REMAT_POLICY)

    def call(*args, **kwargs):
        if not xla_cpu.on_cpu("remat_order"):
            return run(block, *args, **kwargs)
        floats, rest = eqx.partition((block, args, kwargs), eqx.is_inexact_array)
        blk, a, kw = eqx.combine(xla_cpu.backward_after_param_grads(floats), rest)
        return run(blk, *a, **kw)

    return call
