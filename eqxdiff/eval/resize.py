"""PyTorch's bilinear resize (`F.interpolate(mode="bilinear", align_corners=False)`, no
antialiasing) in JAX, NHWC: how pytorch-fid brings every image to Inception's 299×299, so FID
features see the same pixels here as there; and TF1's `resize_bilinear` (no half-pixel centres), how
the TF Inception graph of ADM's evaluator does it inside the graph."""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


def _taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output index: the two source indices and the weight of the second, computed as
    PyTorch's CPU kernel does in float32 (`area_pixel_compute_source_index`): source
    (d + 0.5)·n_in/n_out - 0.5, clamped at 0; the second tap is the last pixel at the far edge."""
    scale = np.float32(n_in) / np.float32(n_out)
    src = np.maximum(scale * (np.arange(n_out, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5), 0)
    i0 = np.minimum(np.floor(src).astype(np.int32), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    return i0, i1, np.clip(src - i0, 0, 1).astype(np.float32)


def _lerp_axis(x: Float[Array, "..."], axis: int, n_out: int) -> Float[Array, "..."]:
    n_in = x.shape[axis]
    if n_in == n_out:  # PyTorch copies at scale 1 (its formula gives the same taps and weight 0)
        return x
    i0, i1, lam = _taps(n_in, n_out)
    shape = [1] * x.ndim
    shape[axis] = n_out
    lam = jnp.asarray(lam.reshape(shape), x.dtype)
    return (1 - lam) * jnp.take(x, i0, axis=axis) + lam * jnp.take(x, i1, axis=axis)


def resize_bilinear(x: Float[Array, "b h w c"], size: tuple[int, int]) -> Float[Array, "b h2 w2 c"]:
    """`F.interpolate(x, size, mode="bilinear", align_corners=False)` (no antialiasing) on NHWC:
    two explicit gathers and lerps, along the width first, as PyTorch nests them. Not
    `jax.image.resize(..., "linear")`, which antialiases when it shrinks an image."""
    return _lerp_axis(_lerp_axis(x, 2, size[1]), 1, size[0])


def _tf1_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TF1's `resize_bilinear` taps (align_corners=False, half_pixel_centers=False, the only mode of
    the 2015 graph): source d·n_in/n_out in float32, no half-pixel shift; the second tap is clamped to
    the last pixel."""
    src = np.arange(n_out, dtype=np.float32) * (np.float32(n_in) / np.float32(n_out))
    i0 = np.floor(src).astype(np.int32)
    return i0, np.minimum(i0 + 1, n_in - 1), (src - i0).astype(np.float32)


def _tf1_lerp_axis(x: Float[Array, "..."], axis: int, n_out: int) -> Float[Array, "..."]:
    i0, i1, lam = _tf1_taps(x.shape[axis], n_out)
    shape = [1] * x.ndim
    shape[axis] = n_out
    lam = jnp.asarray(lam.reshape(shape), x.dtype)
    a = jnp.take(x, i0, axis=axis)
    return a + (jnp.take(x, i1, axis=axis) - a) * lam  # TF's top + (bottom - top) * lerp form


def resize_bilinear_tf1(x: Float[Array, "b h w c"], size: tuple[int, int]) -> Float[Array, "b h2 w2 c"]:
    """TF1's `tf.image.resize_bilinear(x, size)` (align_corners=False, no half-pixel centres) on NHWC:
    how the FID Inception graph (classify_image_graph_def.pb, ADM's evaluator) resizes its input
    inside; along the width first, as TF's kernel lerps each row pair before the columns."""
    return _tf1_lerp_axis(_tf1_lerp_axis(x, 2, size[1]), 1, size[0])
