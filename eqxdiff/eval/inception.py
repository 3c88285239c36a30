"""The FID feature network: pytorch-fid's Inception-v3 (Szegedy et al. 2016, "Rethinking the
Inception Architecture for Computer Vision"; the TensorFlow graph of FID, Heusel et al. 2017) in
Equinox, NHWC. uint8 images `[b, h, w, 3]` -> the 2048 pool3 features that FID compares.

pytorch-fid's `fid_inception_v3()` is torchvision's `Inception3` with the TF graph's differences
patched in, and so is this port: the average pools in Mixed_5b-d, 6b-e and 7b leave the zero
padding out of the mean (`count_include_pad=False`), and Mixed_7c's pool branch takes a max.
Preprocessing is pytorch-fid's: /255, a bilinear resize to 299×299 (`F.interpolate`,
align_corners=False, no antialiasing), then 2x - 1. Field names are torchvision's, so leaf paths
are the state_dict keys of pytorch-fid's weights (pt_inception-2015-12-05-6726825d.pth, read as it is
downloaded by eqxdiff.weights.torch_pickle: tensors only, nothing in the file runs; or a safetensors copy).
"""

import math
from collections.abc import Iterator
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray, UInt8

from eqxdiff.eval.resize import resize_bilinear
from eqxdiff.nn.abstract_network import abstract_network
from eqxdiff.nn.layers import normal
from eqxdiff.nn.torch_weights import LAYOUTS, TORCH_SUFFIXES, leaf_layouts, load_safetensors

SIZE = 299  # pytorch-fid resizes every input to 299×299, the TF graph's input size
BN_EPS = 1e-3  # torchvision's BasicConv2d: BatchNorm2d(eps=0.001), the TF graph's epsilon
# Keys of pytorch-fid's state_dict that the pool3 features never read, accepted and skipped:
# the 1008-way logits (the head of the Inception Score, after pool3) and each BatchNorm's training
# step counter (eval mode normalises by the running statistics alone).
IGNORED_KEYS = ("fc.weight", "fc.bias")
IGNORED_SUFFIX = ".bn.num_batches_tracked"
# FID features are compared across papers at float32: ask XLA for full float32 convolutions even
# where its default is a faster, rounder one (TF32 on GPU tensor cores).
PRECISION = jax.lax.Precision.HIGHEST


def _keys(key: PRNGKeyArray) -> Iterator[PRNGKeyArray]:
    """Keys for a block's layers: always 16 (the most any block has), so that an eager init
    compiles one split and one unstack program instead of one per block size."""
    return iter(jax.random.split(key, 16))


def _pair(n: int | tuple[int, int]) -> tuple[int, int]:
    return (n, n) if isinstance(n, int) else tuple(n)


class Conv(eqx.Module):
    """torch's `nn.Conv2d(bias=False)` on NHWC with rectangular kernels and paddings (Inception's
    1×7, 7×1, 1×3, 3×1), `[b, h, w, cin] -> [b, h', w', cout]`; the kernel is HWIO. Random init is
    He-normal N(0, 2/fan_in) (He et al. 2015), which keeps a ReLU net's activations at scale."""

    weight: Float[Array, "kh kw i o"]
    stride: int = eqx.field(static=True)
    padding: tuple[int, int] = eqx.field(static=True)

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel_size: int | tuple[int, int],
        *,
        stride: int = 1,
        padding: int | tuple[int, int] = 0,
        key: PRNGKeyArray,
    ):
        kh, kw = _pair(kernel_size)
        self.weight = normal(math.sqrt(2.0 / (kh * kw * cin)))(key, (kh, kw, cin, cout))
        self.stride, self.padding = stride, _pair(padding)

    def __call__(self, x: Float[Array, "b h w i"]) -> Float[Array, "b h2 w2 o"]:
        (ph, pw), s = self.padding, self.stride
        return jax.lax.conv_general_dilated(
            x,
            self.weight,
            window_strides=(s, s),
            padding=[(ph, ph), (pw, pw)],
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            precision=PRECISION,
        )


class BatchNorm(eqx.Module):
    """torch's `BatchNorm2d` in eval mode, per channel: (x - running_mean)/sqrt(running_var + eps)
    · weight + bias. Random init is the identity (1, 0, 0, 1)."""

    weight: Float[Array, " c"]
    bias: Float[Array, " c"]
    running_mean: Float[Array, " c"]
    running_var: Float[Array, " c"]
    eps: float = eqx.field(static=True)

    def __init__(self, channels: int, eps: float = BN_EPS):
        ones, zeros = np.ones(channels, np.float32), np.zeros(channels, np.float32)
        # device_put: jnp.asarray of a numpy array compiles a program per shape when eager
        self.weight, self.bias, self.running_mean, self.running_var = jax.device_put((ones, zeros, zeros, ones))
        self.eps = eps

    def __call__(self, x: Float[Array, "b h w c"]) -> Float[Array, "b h w c"]:
        scale = self.weight / jnp.sqrt(self.running_var + self.eps)  # torch's alpha, beta form
        return x * scale + (self.bias - self.running_mean * scale)


class BasicConv2d(eqx.Module):
    """torchvision's `BasicConv2d`: ReLU(BN(conv(x)))."""

    conv: Conv
    bn: BatchNorm

    def __init__(self, cin: int, cout: int, kernel_size: int | tuple[int, int], *, key: PRNGKeyArray, **conv):
        self.conv, self.bn = Conv(cin, cout, kernel_size, key=key, **conv), BatchNorm(cout)

    def __call__(self, x: Float[Array, "b h w i"]) -> Float[Array, "b h2 w2 o"]:
        return jax.nn.relu(self.bn(self.conv(x)))


def max_pool(x: Float[Array, "b h w c"], stride: int, padding: int = 0) -> Float[Array, "b h2 w2 c"]:
    """3×3 max pool (`F.max_pool2d`; padding never wins the max)."""
    pad = [(0, 0), (padding, padding), (padding, padding), (0, 0)]
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, stride, stride, 1), pad)


def avg_pool_valid(x: Float[Array, "b h w c"]) -> Float[Array, "b h w c"]:
    """3×3 stride-1 average pool over the in-image pixels only (`F.avg_pool2d(x, 3, 1, 1,
    count_include_pad=False)`, TF's 'SAME' average pool): border windows divide by 4 or 6, not 9."""
    pad = [(0, 0), (1, 1), (1, 1), (0, 0)]
    total = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 3, 3, 1), (1, 1, 1, 1), pad)
    h, w = x.shape[1:3]
    rows = np.minimum(np.arange(h) + 2, h) - np.maximum(np.arange(h) - 1, 0)  # in-image window size per row
    cols = np.minimum(np.arange(w) + 2, w) - np.maximum(np.arange(w) - 1, 0)
    return total / jnp.asarray((rows[:, None] * cols[None, :])[:, :, None], x.dtype)


class FIDInceptionA(eqx.Module):
    """pytorch-fid's `FIDInceptionA` (Mixed_5b-d, 35×35): 1×1 | 1×1→5×5 | 1×1→3×3→3×3 | avg pool
    (padding excluded)→1×1, concatenated: `[b, 35, 35, cin] -> [b, 35, 35, 224 + pool_features]`."""

    branch1x1: BasicConv2d
    branch5x5_1: BasicConv2d
    branch5x5_2: BasicConv2d
    branch3x3dbl_1: BasicConv2d
    branch3x3dbl_2: BasicConv2d
    branch3x3dbl_3: BasicConv2d
    branch_pool: BasicConv2d

    def __init__(self, cin: int, pool_features: int, *, key: PRNGKeyArray):
        k = _keys(key)
        self.branch1x1 = BasicConv2d(cin, 64, 1, key=next(k))
        self.branch5x5_1 = BasicConv2d(cin, 48, 1, key=next(k))
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2, key=next(k))
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1, key=next(k))
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1, key=next(k))
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1, key=next(k))
        self.branch_pool = BasicConv2d(cin, pool_features, 1, key=next(k))

    def __call__(self, x: Float[Array, "b h w ci"]) -> Float[Array, "b h w co"]:
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        pool = self.branch_pool(avg_pool_valid(x))
        return jnp.concatenate([self.branch1x1(x), b5, b3, pool], axis=-1)


class InceptionB(eqx.Module):
    """torchvision's `InceptionB` (Mixed_6a, 35 -> 17): 3×3/2 | 1×1→3×3→3×3/2 | max pool/2,
    concatenated: `[b, 35, 35, 288] -> [b, 17, 17, 768]`."""

    branch3x3: BasicConv2d
    branch3x3dbl_1: BasicConv2d
    branch3x3dbl_2: BasicConv2d
    branch3x3dbl_3: BasicConv2d

    def __init__(self, cin: int, *, key: PRNGKeyArray):
        k = _keys(key)
        self.branch3x3 = BasicConv2d(cin, 384, 3, stride=2, key=next(k))
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1, key=next(k))
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1, key=next(k))
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2, key=next(k))

    def __call__(self, x: Float[Array, "b h w ci"]) -> Float[Array, "b h2 w2 co"]:
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return jnp.concatenate([self.branch3x3(x), b3, max_pool(x, stride=2)], axis=-1)


class FIDInceptionC(eqx.Module):
    """pytorch-fid's `FIDInceptionC` (Mixed_6b-e, 17×17): 1×1 | 1×1→1×7→7×1 | 1×1→7×1→1×7→7×1→1×7 |
    avg pool (padding excluded)→1×1, concatenated: `[b, 17, 17, 768] -> [b, 17, 17, 768]`."""

    branch1x1: BasicConv2d
    branch7x7_1: BasicConv2d
    branch7x7_2: BasicConv2d
    branch7x7_3: BasicConv2d
    branch7x7dbl_1: BasicConv2d
    branch7x7dbl_2: BasicConv2d
    branch7x7dbl_3: BasicConv2d
    branch7x7dbl_4: BasicConv2d
    branch7x7dbl_5: BasicConv2d
    branch_pool: BasicConv2d

    def __init__(self, cin: int, c7: int, *, key: PRNGKeyArray):
        k = _keys(key)
        row, col = {"kernel_size": (1, 7), "padding": (0, 3)}, {"kernel_size": (7, 1), "padding": (3, 0)}
        self.branch1x1 = BasicConv2d(cin, 192, 1, key=next(k))
        self.branch7x7_1 = BasicConv2d(cin, c7, 1, key=next(k))
        self.branch7x7_2 = BasicConv2d(c7, c7, **row, key=next(k))
        self.branch7x7_3 = BasicConv2d(c7, 192, **col, key=next(k))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, 1, key=next(k))
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, **col, key=next(k))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, **row, key=next(k))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, **col, key=next(k))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, **row, key=next(k))
        self.branch_pool = BasicConv2d(cin, 192, 1, key=next(k))

    def __call__(self, x: Float[Array, "b h w ci"]) -> Float[Array, "b h w co"]:
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        d = self.branch7x7dbl_1(x)
        for conv in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5):
            d = conv(d)
        pool = self.branch_pool(avg_pool_valid(x))
        return jnp.concatenate([self.branch1x1(x), b7, d, pool], axis=-1)


class InceptionD(eqx.Module):
    """torchvision's `InceptionD` (Mixed_7a, 17 -> 8): 1×1→3×3/2 | 1×1→1×7→7×1→3×3/2 | max pool/2,
    concatenated: `[b, 17, 17, 768] -> [b, 8, 8, 1280]`."""

    branch3x3_1: BasicConv2d
    branch3x3_2: BasicConv2d
    branch7x7x3_1: BasicConv2d
    branch7x7x3_2: BasicConv2d
    branch7x7x3_3: BasicConv2d
    branch7x7x3_4: BasicConv2d

    def __init__(self, cin: int, *, key: PRNGKeyArray):
        k = _keys(key)
        self.branch3x3_1 = BasicConv2d(cin, 192, 1, key=next(k))
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2, key=next(k))
        self.branch7x7x3_1 = BasicConv2d(cin, 192, 1, key=next(k))
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3), key=next(k))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0), key=next(k))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2, key=next(k))

    def __call__(self, x: Float[Array, "b h w ci"]) -> Float[Array, "b h2 w2 co"]:
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return jnp.concatenate([b3, b7, max_pool(x, stride=2)], axis=-1)


class FIDInceptionE(eqx.Module):
    """pytorch-fid's `FIDInceptionE_1` (Mixed_7b, `pool="avg"`, padding excluded) and
    `FIDInceptionE_2` (Mixed_7c, `pool="max"`: the TF graph's max where the paper has an average),
    8×8: 1×1 | 1×1→(1×3, 3×1) | 1×1→3×3→(1×3, 3×1) | pool→1×1, concatenated:
    `[b, 8, 8, cin] -> [b, 8, 8, 2048]`."""

    branch1x1: BasicConv2d
    branch3x3_1: BasicConv2d
    branch3x3_2a: BasicConv2d
    branch3x3_2b: BasicConv2d
    branch3x3dbl_1: BasicConv2d
    branch3x3dbl_2: BasicConv2d
    branch3x3dbl_3a: BasicConv2d
    branch3x3dbl_3b: BasicConv2d
    branch_pool: BasicConv2d
    pool: str = eqx.field(static=True)

    def __init__(self, cin: int, pool: str, *, key: PRNGKeyArray):
        if pool not in ("avg", "max"):
            raise ValueError(f"FIDInceptionE: pool {pool!r} is not 'avg' (Mixed_7b) or 'max' (Mixed_7c)")
        k = _keys(key)
        row, col = {"kernel_size": (1, 3), "padding": (0, 1)}, {"kernel_size": (3, 1), "padding": (1, 0)}
        self.branch1x1 = BasicConv2d(cin, 320, 1, key=next(k))
        self.branch3x3_1 = BasicConv2d(cin, 384, 1, key=next(k))
        self.branch3x3_2a = BasicConv2d(384, 384, **row, key=next(k))
        self.branch3x3_2b = BasicConv2d(384, 384, **col, key=next(k))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, 1, key=next(k))
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1, key=next(k))
        self.branch3x3dbl_3a = BasicConv2d(384, 384, **row, key=next(k))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, **col, key=next(k))
        self.branch_pool = BasicConv2d(cin, 192, 1, key=next(k))
        self.pool = pool

    def __call__(self, x: Float[Array, "b h w ci"]) -> Float[Array, "b h w co"]:
        b3 = self.branch3x3_1(x)
        d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        pooled = avg_pool_valid(x) if self.pool == "avg" else max_pool(x, stride=1, padding=1)
        return jnp.concatenate(
            [
                self.branch1x1(x),
                self.branch3x3_2a(b3),
                self.branch3x3_2b(b3),
                self.branch3x3dbl_3a(d),
                self.branch3x3dbl_3b(d),
                self.branch_pool(pooled),
            ],
            axis=-1,
        )


TORCH_LAYOUTS = {**LAYOUTS, Conv: {"weight": (2, 3, 1, 0)}}  # per layer type: OIHW -> HWIO


def skipped_keys(network: "InceptionV3") -> set[str]:
    """The state_dict keys `from_pytorch_fid` accepts and does not read: IGNORED_KEYS and the
    step counter of each of `network`'s BatchNorms."""
    names = leaf_layouts(network, TORCH_LAYOUTS)
    suffix = ".bn.running_mean"
    return {*IGNORED_KEYS, *(n.removesuffix(suffix) + IGNORED_SUFFIX for n in names if n.endswith(suffix))}


def check_weights_file(path: Path) -> None:
    """Raise naming the fix unless `path` is an existing .pth (or other torch file) or .safetensors."""
    if path.suffix not in (".safetensors", *TORCH_SUFFIXES):
        raise ValueError(
            f"{path}: expected pytorch-fid's pt_inception-2015-12-05-6726825d.pth (or a .safetensors copy of it)"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: download pytorch-fid's weights, "
            "https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/pt_inception-2015-12-05-6726825d.pth"
        )


class InceptionV3(eqx.Module):
    """pytorch-fid's `InceptionV3([3])` (`fid_inception_v3()` behind it): uint8 images
    `[b, h, w, 3]`, any size -> pool3 features `[b, 2048]` (float32, non-negative).

    Build with `from_pytorch_fid(.pth or .safetensors)` (the FID weights) or `InceptionV3(key=...)`
    (random weights, for tests). A plain pytree of arrays: wrap calls in `eqx.filter_jit`, or pass
    the network to a jitted function as an argument. `pool3` is the network on [-1, 1] inputs
    already at 299×299.
    """

    Conv2d_1a_3x3: BasicConv2d
    Conv2d_2a_3x3: BasicConv2d
    Conv2d_2b_3x3: BasicConv2d
    Conv2d_3b_1x1: BasicConv2d
    Conv2d_4a_3x3: BasicConv2d
    Mixed_5b: FIDInceptionA
    Mixed_5c: FIDInceptionA
    Mixed_5d: FIDInceptionA
    Mixed_6a: InceptionB
    Mixed_6b: FIDInceptionC
    Mixed_6c: FIDInceptionC
    Mixed_6d: FIDInceptionC
    Mixed_6e: FIDInceptionC
    Mixed_7a: InceptionD
    Mixed_7b: FIDInceptionE
    Mixed_7c: FIDInceptionE

    def __init__(self, *, key: PRNGKeyArray):
        k = _keys(key)
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2, key=next(k))
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3, key=next(k))
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1, key=next(k))
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1, key=next(k))
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3, key=next(k))
        self.Mixed_5b = FIDInceptionA(192, 32, key=next(k))
        self.Mixed_5c = FIDInceptionA(256, 64, key=next(k))
        self.Mixed_5d = FIDInceptionA(288, 64, key=next(k))
        self.Mixed_6a = InceptionB(288, key=next(k))
        self.Mixed_6b = FIDInceptionC(768, 128, key=next(k))
        self.Mixed_6c = FIDInceptionC(768, 160, key=next(k))
        self.Mixed_6d = FIDInceptionC(768, 160, key=next(k))
        self.Mixed_6e = FIDInceptionC(768, 192, key=next(k))
        self.Mixed_7a = InceptionD(768, key=next(k))
        self.Mixed_7b = FIDInceptionE(1280, "avg", key=next(k))
        self.Mixed_7c = FIDInceptionE(2048, "max", key=next(k))

    @classmethod
    def from_pytorch_fid(cls, path: str | Path) -> "InceptionV3":
        """pytorch-fid's FID Inception weights, pt_inception-2015-12-05-6726825d.pth as downloaded
        (or any torch file or safetensors file of that state_dict), as float32 on the first device.
        Every key is read exactly once; `fc.*` and `*.bn.num_batches_tracked` are accepted and
        skipped (IGNORED_KEYS); a missing, unexpected or mis-shaped key raises naming it."""
        path = Path(path)
        check_weights_file(path)
        abstract = abstract_network(cls)
        return load_safetensors(abstract, path, ignore=skipped_keys(abstract), layouts=TORCH_LAYOUTS)

    def pool3(self, x: Float[Array, "b 299 299 3"]) -> Float[Array, "b 2048"]:
        """The network: RGB in [-1, 1] at 299×299 -> the global average of Mixed_7c."""
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = max_pool(x, stride=2)
        x = max_pool(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x)), stride=2)
        for block in (
            self.Mixed_5b,
            self.Mixed_5c,
            self.Mixed_5d,
            self.Mixed_6a,
            self.Mixed_6b,
            self.Mixed_6c,
            self.Mixed_6d,
            self.Mixed_6e,
            self.Mixed_7a,
            self.Mixed_7b,
            self.Mixed_7c,
        ):
            x = block(x)
        return x.mean(axis=(1, 2))

    def __call__(self, images: UInt8[Array | np.ndarray, "b h w 3"]) -> Float[Array, "b 2048"]:
        """uint8 RGB images, any size -> pool3 features, preprocessed as pytorch-fid does:
        x/255, bilinear resize to 299×299, 2x - 1."""
        if images.dtype != np.uint8:
            raise TypeError(
                f"InceptionV3 takes uint8 images, got {images.dtype}: FID is defined on 8-bit images "
                "(eqxdiff.images.to_uint8 maps [-1, 1] samples)"
            )
        if images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"InceptionV3 takes RGB images [b, h, w, 3], got shape {images.shape}")
        x = jnp.asarray(images).astype(jnp.float32) / 255.0
        return self.pool3(2 * resize_bilinear(x, (SIZE, SIZE)) - 1)
