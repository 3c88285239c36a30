"""`remat=True`: a block's activations are recomputed in the backward pass instead of kept.

Blocks run under `eqx.filter_checkpoint` with the remat policy (Chen et al. 2016, "Training deep nets
with sublinear memory cost"): which of a block's values the forward pass keeps; the rest is recomputed
from the block's input. The policy is one of REMAT_POLICIES, `DEFAULT_REMAT_POLICY` unless a script
sets another (`set_remat_policy`, train/main.py's --remat_policy); it is read when a block is traced.
The default is chosen by peak memory and speed measured on a TPU (BENCHMARKS.md "On a TPU v5e").
With `eqxdiff.xla_cpu` on and the CPU backend, each block's input cotangents also wait for its
parameter gradients (`xla_cpu.backward_after_param_grads`), which lets XLA:CPU's scheduler free the
block's recomputed activations before the end of the backward pass.
"""

from collections.abc import Callable

import equinox as eqx
import jax

from eqxdiff import xla_cpu
from eqxdiff.nn.attention import ATTENTION_NAME

REMAT_POLICIES = {
    # Nothing kept but the block's input: the least memory, the whole forward pass computed twice.
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    # The attention's output kept (its logits never are): the projections and MLP are recomputed at the
    # matmul units' rate, the attention, slower per FLOP, is not.
    "attention_saveable": jax.checkpoint_policies.save_only_these_names(ATTENTION_NAME),
    # Every matmul/conv output without batch dims kept (every per-token projection of a transformer).
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Every matmul/conv output kept, the attention's batched products too.
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}
DEFAULT_REMAT_POLICY = "nothing_saveable"
_policy = [DEFAULT_REMAT_POLICY]


def set_remat_policy(name: str) -> None:
    """Blocks traced from now on keep what the policy `name` (one of REMAT_POLICIES) keeps."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"Unknown remat policy {name!r}; choose one of {sorted(REMAT_POLICIES)}")
    _policy[0] = name


def remat_policy() -> str:
    """The policy blocks traced now take."""
    return _policy[0]


def checkpointed(block: Callable, remat: bool) -> Callable:
    """`block(*args, **kwargs)`, rematerialised when `remat`.

    The block is passed to `filter_checkpoint` as an argument (not closed over), which keeps its
    parameters visible to the policy. With `eqxdiff.xla_cpu` on, on CPU (custom_vjp): no
    forward-mode autodiff through it, and a gradient with respect to the inputs alone computes
    the parameter gradients too.
    """
    if not remat:
        return block
    run = eqx.filter_checkpoint(lambda blk, *a, **kw: blk(*a, **kw), policy=REMAT_POLICIES[remat_policy()])

    def call(*args, **kwargs):
        if not xla_cpu.on_cpu("remat_order"):
            return run(block, *args, **kwargs)
        floats, rest = eqx.partition((block, args, kwargs), eqx.is_inexact_array)
        blk, a, kw = eqx.combine(xla_cpu.backward_after_param_grads(floats), rest)
        return run(blk, *a, **kw)

    return call
