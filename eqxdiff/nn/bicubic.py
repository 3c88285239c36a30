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

uint8 images (`resize_uint8`, on the host) are resized as torch's uint8 kernel and Pillow resize them (CLIP's image
processors, torchvision's and PIL's backends): the antialiased weights rounded to fixed point with `precision`
fractional bits, the width pass first then the height pass, each rounded and clipped to uint8.
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


def bicubic_matrix(
    n_in: int, n_out: int, *, scale_factor: float | None = None, antialias: bool = False, step_dtype=np.float32
) -> np.ndarray:
    """float64 [n_out, n_in]: torch's `interpolate(mode="bicubic", align_corners=False, antialias=...)` along one
    axis of length `n_in` to `n_out`; `scale_factor` as passed to torch (it sets the sampling step 1/scale_factor
    instead of n_in/n_out). `step_dtype`: the sampling step's precision (float32 in torch's float kernels, float64
    in its uint8 kernel and Pillow's)."""
    step = step_dtype(1.0 / scale_factor) if scale_factor else step_dtype(n_in) / step_dtype(n_out)
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


def fixed_point_precision(weights: np.ndarray) -> int:
    """torch's uint8 kernel's fractional bits for one pass: the most (up to 22) that keep its largest weight, twice,
    below 2¹⁵ (the weights are int16)."""
    precision = 0
    while precision < 22 and int(0.5 + weights.max() * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    return precision


def _uint8_pass(x: np.ndarray, weights: np.ndarray, axis: int, precision: int | None) -> np.ndarray:
    bits = fixed_point_precision(weights) if precision is None else precision
    fixed = np.trunc(weights * (1 << bits) + np.where(weights < 0, -0.5, 0.5)).astype(np.int64)  # C's (int) cast
    moved = np.moveaxis(x.astype(np.int64), axis, 0)
    sums = np.tensordot(fixed, moved, axes=(1, 0)) + (1 << (bits - 1))
    return np.moveaxis(np.clip(sums >> bits, 0, 255).astype(np.uint8), 0, axis)


def resize_uint8(image: np.ndarray, size: tuple[int, int], *, kernel: str = "torch") -> np.ndarray:
    """uint8 `[h, w, c]` -> uint8 `[h2, w2, c]`, antialiased bicubic: torch's `interpolate(uint8, "bicubic",
    antialias=True)` (torchvision's resize of uint8 images) with `kernel="torch"`, Pillow's
    `Image.resize(BICUBIC)` with `kernel="pillow"` (22 fractional bits; the height pass first when that pass
    reads fewer pixels, h_out·w_in < h_in·w_out, as Pillow 13 orders them). An axis whose size does not change is
    not resampled."""
    if kernel not in ("torch", "pillow"):
        raise ValueError(f"kernel {kernel!r}: 'torch' (torchvision's uint8 resize) or 'pillow'")
    out = np.asarray(image, np.uint8)
    (h, w), (h2, w2) = out.shape[:2], size
    height_first = kernel == "pillow" and h2 * w < h * w2
    for axis in (0, 1) if height_first else (1, 0):  # else the width first, as torch's kernel
        n_in, n_out = out.shape[axis], size[axis]
        if n_in != n_out:
            weights = bicubic_matrix(n_in, n_out, antialias=True, step_dtype=np.float64)
            out = _uint8_pass(out, weights, axis, 22 if kernel == "pillow" else None)
    return out
