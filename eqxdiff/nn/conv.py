"""NHWC 2-D convolution: `lax.conv_general_dilated`, or XLA:CPU's workaround when it is on."""

import jax
from jaxtyping import Array, Float

from eqxdiff import xla_cpu


def conv2d(
    x: Float[Array, "b h w i"], w: Float[Array, "kh kw i o"], stride: int, padding: int
) -> Float[Array, "b h2 w2 o"]:
    """`lax.conv_general_dilated` on NHWC/HWIO with symmetric `padding`. With
    `eqxdiff.xla_cpu` on and the CPU backend, its weight gradient is computed as matmuls
    (`xla_cpu.conv2d`: same values to float32 rounding, no forward-mode autodiff)."""
    if xla_cpu.on_cpu("conv_grad_matmul"):
        return xla_cpu.conv2d(x, w, stride, padding)
    return jax.lax.conv_general_dilated(
        x,
        w,
        window_strides=(stride, stride),
        padding=[(padding, padding)] * 2,
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
