"""A 3×3 conv of a nearest-neighbour 2× upsampling, computed on the small map.

Upsampled by repetition, each output pixel's 3×3 window covers only 2×2 distinct input pixels, and which
kernel rows (columns) fall on each depends only on the output row's (column's) parity: output row 2i reads
input row i-1 through kernel row 0 and row i through rows 1 and 2; output row 2i+1 reads row i through rows
0 and 1 and row i+1 through row 2. So the four output phases are four 2×2 convs of the input with summed
kernels, run as one 2×2 conv with 4·cout output channels over the input padded by one: 4 taps per output pixel
instead of 9 (4/9 of the multiply-adds, times (1 + 1/h)(1 + 1/w) for the padded border), no 4× upsampled copy
of the input, and the same values to float32 rounding (the kernel's taps are summed first).
"""

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .bias import add_bias
from .conv import conv2d
from .layers import Conv2d

# [phase, tap, kernel row]: the 3×3 kernel's rows each of a phase's two taps sums (the docstring's parities).
_TAPS = np.array([[[1, 0, 0], [0, 1, 1]], [[1, 1, 0], [0, 0, 1]]], np.float32)


def nearest_upsample(x: Float[Array, "b h w c"]) -> Float[Array, "b h2 w2 c"]:
    """Nearest-neighbour 2× upsampling, `[b, h, w, c] -> [b, 2h, 2w, c]`: each pixel repeated 2×2."""
    return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


def nearest_upsample_conv(conv: Conv2d | Callable, x: Float[Array, "b h w i"]) -> Float[Array, "b h2 w2 o"]:
    """`conv(x repeated 2× along h and w)`, `[b, h, w, i] -> [b, 2h, 2w, o]`, for a 3×3 `Conv2d` of stride and
    padding 1. Any other module (a LoRA-adapted conv: its low-rank branch runs in its own dtype, which summing it
    into the kernel would round away) is called on the repeated map."""
    if not isinstance(conv, Conv2d):
        return conv(nearest_upsample(x))
    if conv.weight.shape[:2] != (3, 3) or conv.stride != 1 or conv.padding != 1:
        raise ValueError(
            f"nearest_upsample_conv takes a 3×3 conv of stride 1 and padding 1, got a "
            f"{conv.weight.shape[:2]} kernel, stride {conv.stride}, padding {conv.padding}."
        )
    b, h, w, _ = x.shape
    dtype = conv.weight.dtype
    # [tap row, tap col, i, (phase row, phase col, o)]: each phase's 2×2 kernel of summed 3×3 taps, summed in float32.
    kernel = jnp.einsum("arp,bsq,pqio->rsiabo", _TAPS, _TAPS, conv.weight.astype(jnp.float32))
    kernel = kernel.reshape(2, 2, kernel.shape[2], -1).astype(dtype)
    # Padded by one: output (r, c) of the VALID 2×2 conv reads input rows r-1, r and columns c-1, c.
    y = conv2d(jnp.pad(x.astype(dtype), ((0, 0), (1, 1), (1, 1), (0, 0))), kernel, 1, 0)
    y = y.reshape(b, h + 1, w + 1, 2, 2, -1)
    # Phase (a, c) of output row 2i+a, column 2j+c sits at (i+a, j+c): interleave the four into [b, 2h, 2w, o].
    rows = [jnp.stack([y[:, a : a + h, c : c + w, a, c] for c in (0, 1)], axis=3) for a in (0, 1)]
    return add_bias(jnp.stack(rows, axis=2).reshape(b, 2 * h, 2 * w, -1), conv.bias)
