"""NHWC 2-D convolution whose weight gradient is kernel-offset matmuls on XLA:CPU.

Why: XLA:CPU computes a conv's weight gradient as a convolution whose window is the whole
feature map, and runs it 4-9x slower per FLOP than the forward conv (measured, 32x32x128 -> 64,
3x3, batch 32: forward 74 ms, weight gradient 629 ms). It was half of a UNet training step.
The same gradient as one matmul per kernel offset,

    dW[i, j] = Σ_{b,h,w} x_pad[b, s·h + i, s·w + j, :]ᵀ dy[b, h, w, :]    ([cin, cout] each),

took 139 ms. Elsewhere (GPU/TPU) the library convolutions are left alone. The forward pass and
the input gradient are XLA's convolutions on every backend.

Cost of the custom rule (CPU only): forward-mode autodiff (jax.jvp) through a conv is not
available; set `MATMUL_WEIGHT_GRAD_ON_CPU = False` to get plain `lax.conv_general_dilated`.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

MATMUL_WEIGHT_GRAD_ON_CPU = True

_DIMS = ("NHWC", "HWIO", "NHWC")


def _conv(x, w, stride: int, padding: int):
    return jax.lax.conv_general_dilated(
        x, w, window_strides=(stride, stride), padding=[(padding, padding)] * 2, dimension_numbers=_DIMS
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv_matmul_weight_grad(x, w, stride: int, padding: int):
    return _conv(x, w, stride, padding)


def _forward(x, w, stride, padding):
    return _conv(x, w, stride, padding), (x, w)


def _backward(stride, padding, residuals, dy):
    x, w = residuals
    (dx,) = jax.vjp(lambda x: _conv(x, w, stride, padding), x)[1](dy)
    return dx, _weight_grad(x, dy, w.shape, stride, padding).astype(w.dtype)


def _weight_grad(x, dy, kernel_shape, stride: int, padding: int):
    """dW as one [cin, cout] matmul per kernel offset, contracting over all b·h·w positions.

    Each offset needs one operand shifted, i.e. a copy; the copies cost more than the matmuls,
    so the tensor with fewer channels is the one shifted (dy's shift needs stride 1).
    """
    kh, kw, cin, cout = kernel_shape
    b, ho, wo, _ = dy.shape
    contract = (((0,), (0,)), ((), ()))  # over the positions: [cin, cout]

    def matmul(xs, dys):
        return jax.lax.dot_general(xs.reshape(-1, cin), dys.reshape(-1, cout), contract, preferred_element_type=jnp.float32)

    # Unrolled, not a lax.map over offsets: XLA's cost analysis (MFU) counts a loop body once,
    # and the loop compiled no faster (measured).
    if stride == 1 and cout < cin:
        # dW[i, j] = Σ_q x[q] dy[q + p - (i, j)], dy zero outside its map.
        h, w = x.shape[1:3]
        dyp = jnp.pad(dy, ((0, 0), (kh - 1 - padding,) * 2, (kw - 1 - padding,) * 2, (0, 0)))
        pairs = [(x, dyp[:, kh - 1 - i : kh - 1 - i + h, kw - 1 - j : kw - 1 - j + w]) for i in range(kh) for j in range(kw)]
    else:
        xp = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
        end = lambda i, j: (b, i + stride * (ho - 1) + 1, j + stride * (wo - 1) + 1, cin)  # noqa: E731
        strides = (1, stride, stride, 1)
        pairs = [(jax.lax.slice(xp, (0, i, j, 0), end(i, j), strides), dy) for i in range(kh) for j in range(kw)]
    return jnp.stack([matmul(xs, dys) for xs, dys in pairs]).reshape(kernel_shape)


_conv_matmul_weight_grad.defvjp(_forward, _backward)


def conv2d(
    x: Float[Array, "b h w i"], w: Float[Array, "kh kw i o"], stride: int, padding: int
) -> Float[Array, "b h2 w2 o"]:
    """`lax.conv_general_dilated` on NHWC/HWIO with symmetric `padding`; on the CPU backend its
    weight gradient is the matmul form above (same values, to float32 rounding)."""
    if MATMUL_WEIGHT_GRAD_ON_CPU and jax.default_backend() == "cpu":
        return _conv_matmul_weight_grad(x, w, stride, padding)
    return _conv(x, w, stride, padding)
