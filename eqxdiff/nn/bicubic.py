"""PyTorch's bicubic `F.interpolate` (align_corners=False) as two resampling matrices, NHWC: how DINOv2 resizes its
position embeddings for other image sizes (transformers' towers, facebookresearch/dinov2's hub models) and how
EDM2's FD-DINOv2 brings images to 224² (`antialias=True`).

Each output pixel is a weighted sum of input pixels along one axis, so a resize is `A_h · x · A_wᵀ` with the
[out, in] matrices built here in numpy from the rules of torch's CPU kernels (UpSampleKernel.cpp):

- plain (`antialias=False`): Keys' cubic convolution with A = -0.75 at source (d + 0.5)·s - 0.5, four taps,
  indices clamped at the edges;
- antialiased: the kernel with a = -0.5 (PIL's), stretched by s when shrinking (s > 1), centred at (d + 0.5)·s,
  the window cut at the edges and its weights renormalised to sum 1.

s is in/out, or 1/scale_factor when the caller passed torch a `scale_factor` (facebookresearch/dinov2's
`interpolate_offset` kludge: a factor (n + 0.1)/M gives n outputs, but samples at M/(n + 0.1), not M/n).
"""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


def _keys(x: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel with parameter `a` at distances `x`."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def bicubic_matrix(n_in: int, n_out: int, *, scale_factor: float | None = None, antialias: bool = False) -> np.ndarray:
    """float64 [n_out, n_in]: torch's `interpolate(mode="bicubic", align_corners=False, antialias=...)` along one
    axis of length `n_in` to `n_out`; `scale_factor` as passed to torch (it sets the sampling step 1/scale_factor
    instead of n_in/n_out)."""
    step = np.float32(1.0 / scale_factor) if scale_factor else np.float32(n_in) / np.float32(n_out)  # torch: float
    out = np.arange(n_out)
    matrix = np.zeros((n_out, n_in))
    if not antialias:
        src = step * (out.astype(np.float32) + np.float32(0.5)) - np.float32(0.5)
        first = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
        t = np.clip(src - first, 0, 1).astype(np.float64)
        for j in range(4):  # taps first-1 .. first+2, clamped into the image
            np.add.at(matrix, (out, np.clip(first + j - 1, 0, n_in - 1)), _keys(t + 1 - j, -0.75))
        return matrix
    support = 2.0 * step if step >= 1 else 2.0
    stretch = 1.0 / step if step >= 1 else 1.0
    for i in out:
        centre = float(step) * (i + 0.5)
        lo = max(int(centre - support + 0.5), 0)  # int(): truncation, as torch's static_cast
        hi = min(int(centre + support + 0.5), n_in)
        taps = np.arange(lo, hi)
        weights = _keys((taps - centre + 0.5) * stretch, -0.5)
        matrix[i, lo:hi] = weights / weights.sum() if weights.sum() != 0 else weights
    return matrix


def resize_bicubic(
    x: Float[Array | np.ndarray, "b h w c"],
    size: tuple[int, int],
    *,
    scale_factor: tuple[float, float] | None = None,
    antialias: bool = False,
) -> Float[Array, "b h2 w2 c"]:
    """`F.interpolate(x, size, mode="bicubic", align_corners=False, antialias=antialias)` on NHWC, in x's dtype
    (float32 sums); `scale_factor` (per axis, h then w) as torch's argument where the caller passed one."""
    b, h, w, c = x.shape
    (fh, fw) = scale_factor if scale_factor is not None else (None, None)
    rows = jnp.asarray(bicubic_matrix(h, size[0], scale_factor=fh, antialias=antialias), jnp.float32)
    cols = jnp.asarray(bicubic_matrix(w, size[1], scale_factor=fw, antialias=antialias), jnp.float32)
    y = jnp.einsum("ih,bhwc,jw->bijc", rows, jnp.asarray(x, jnp.float32), cols, precision="highest")
    return y.astype(x.dtype)
