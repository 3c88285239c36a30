"""Bias adds and affines, `y + bias` and `y * weight + bias`: plain JAX, or XLA:CPU's workaround when it is on."""

from jaxtyping import Array, Float

from eqxdiff import xla_cpu


def _per_channel(y: Array, *params: Array) -> bool:
    """Whether `xla_cpu`'s matmul-sum rule applies: on, on CPU, each param `[c]` or `[b, 1, ..., 1, c]` of `y`'s
    dtype (anything else, e.g. a promoting add, stays plain JAX)."""
    c = y.shape[-1]
    shapes = ((c,), (y.shape[0], *(1,) * (y.ndim - 2), c)) if y.ndim >= 2 else ()
    fits = all(p.shape in shapes and p.dtype == y.dtype and p.shape == params[0].shape for p in params)
    return fits and xla_cpu.on_cpu("channel_sum_matmul")


def add_bias(y: Float[Array, "b *pos c"], bias: Float[Array, "*bc"]) -> Float[Array, "b *pos c"]:
    """`y + bias`, `bias` `[c]` or per sample `[b, 1, ..., 1, c]`. With `eqxdiff.xla_cpu` on and the CPU
    backend, the bias gradient is a matmul with ones (`xla_cpu.add_bias`: same values to float32 rounding,
    no forward-mode autodiff)."""
    return xla_cpu.add_bias(y, bias) if _per_channel(y, bias) else y + bias


def affine(
    y: Float[Array, "b *pos c"], weight: Float[Array, "*bc"], bias: Float[Array, "*bc"]
) -> Float[Array, "b *pos c"]:
    """`y * weight + bias`, both `[c]` or per sample `[b, 1, ..., 1, c]`; with `eqxdiff.xla_cpu` on and the CPU
    backend their gradients are matmuls with ones (`xla_cpu.affine`)."""
    return xla_cpu.affine(y, weight, bias) if _per_channel(y, weight, bias) else y * weight + bias
