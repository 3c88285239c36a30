"""Precision policy: one knob. Parameters, optimizer state and EMA stay float32; "bf16" runs
the network's forward and backward in bfloat16. The layers keep norms and the attention
softmax in float32 and the loss is computed in float32 (see eqxdiff.nn.layers, diffusion.loss).
"""

import equinox as eqx
import jax
import jax.numpy as jnp

PRECISIONS = {"fp32": jnp.dtype(jnp.float32), "bf16": jnp.dtype(jnp.bfloat16)}


def compute_dtype(precision: str) -> jnp.dtype:
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; choose one of {sorted(PRECISIONS)}.")
    return PRECISIONS[precision]


def cast_for_compute(model: eqx.Module, precision: str) -> eqx.Module:
    """The model with its floating-point leaves in the compute dtype. Differentiating through
    this cast returns float32 gradients for the float32 master parameters."""
    dtype = compute_dtype(precision)
    if dtype == jnp.float32:
        return model
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)
