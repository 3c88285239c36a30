"""The features of ADM's evaluator (Dhariwal & Nichol 2021; openai/guided-diffusion,
evaluations/evaluator.py) from pytorch-fid's Inception weights, in one pass: pool3 [b, 2048] (FID,
precision/recall), the spatial features of the TF graph's `mixed_6/conv` [b, 17·17·7 = 2023] (sFID)
and the 1008-way logits [b, 1008] (Inception Score).

Which layer `mixed_6/conv` is: the TF graph names its eleven Inception blocks mixed, mixed_1 ..
mixed_10, torchvision Mixed_5b, 5c, 5d, 6a, 6b, 6c, 6d, 6e, 7a, 7b, 7c in the same order, so mixed_6
is Mixed_6d; a block's plain `conv` is its branch without a tower, torchvision's `branch1x1` (192
channels at 17×17; the op named `mixed_6/conv` is that layer's ReLU, its output). torch-fidelity's
converter of the same graph (utils/util_convert_inception_weights.py) maps `mixed_6/conv/conv2d_params`
to `Mixed_6d.branch1x1.conv`. ADM keeps the first 7 channels, flattened as NHWC [17, 17, 7] row-major:
the order of its stored `mu_s`, `sigma_s`.

The logits: ADM multiplies pool3 by the weight of the graph's `softmax/logits/MatMul` (pytorch-fid's
`fc.weight`, transposed) without the bias, and its softmax runs over all 1008 classes (the 1000
ImageNet classes and the graph's 8 unused ones, kept), as torch-fidelity's `logits_unbiased`.

Preprocessing (`preprocess`): "adm" is the TF graph's own, which ADM's float [0, 255] images go
through inside the graph: TF1's bilinear resize to 299×299 (no half-pixel centres) and (x - 128)/128,
as torch-fidelity does too. "pytorch_fid" is InceptionV3's: x/255, PyTorch's half-pixel bilinear
resize, 2x - 1. They differ even at 299×299 (2x/255 - 1 vs x/128 - 1): statistics stored by ADM's
evaluator compare with "adm" features.
"""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray, UInt8

from eqxdiff.eval.inception import SIZE, TORCH_LAYOUTS, InceptionV3, check_weights_file, max_pool, skipped_keys
from eqxdiff.eval.resize import resize_bilinear, resize_bilinear_tf1
from eqxdiff.nn.abstract_network import abstract_network
from eqxdiff.nn.torch_weights import load_safetensors

SPATIAL_CHANNELS = 7  # ADM's `spatial[..., :7]` of mixed_6/conv's 192
SPATIAL_DIM = 17 * 17 * SPATIAL_CHANNELS  # 2023
CLASSES = 1008  # the graph's softmax: 1000 ImageNet classes and 8 unused ones
PREPROCESS = ("adm", "pytorch_fid")


class Logits(eqx.Module):
    """pytorch-fid's `fc` (the graph's `softmax/weights`, `softmax/biases`): weight [1008, 2048] as
    torch stores it, bias [1008] (read, unused by ADM's score)."""

    weight: Float[Array, "k d"]
    bias: Float[Array, " k"]

    def __init__(self, *, key: PRNGKeyArray):
        bound = 2048**-0.5  # nn.Linear's default range
        self.weight = jax.random.uniform(key, (CLASSES, 2048), minval=-bound, maxval=bound)
        self.bias = jnp.zeros(CLASSES)


class ADMInception(eqx.Module):
    """uint8 RGB images [b, h, w, 3], any size -> (pool3 [b, 2048], spatial [b, 2023], logits
    [b, 1008]), float32: the three feature sets of ADM's evaluator. `net` is InceptionV3 (pytorch-fid's
    network), `fc` its logits layer; build with `from_pytorch_fid(path)` or randomly with `key`."""

    net: InceptionV3
    fc: Logits
    preprocess: str = eqx.field(static=True)

    def __init__(self, *, key: PRNGKeyArray, preprocess: str = "adm"):
        if preprocess not in PREPROCESS:
            raise ValueError(f"preprocess {preprocess!r} is not one of {PREPROCESS}.")
        k1, k2 = jax.random.split(key)
        self.net, self.fc, self.preprocess = InceptionV3(key=k1), Logits(key=k2), preprocess

    @classmethod
    def from_pytorch_fid(cls, path: str | Path, preprocess: str = "adm", place=None) -> "ADMInception":
        """pytorch-fid's pt_inception-2015-12-05-6726825d.pth (or a .safetensors copy), every key read
        (fc too) but the BatchNorms' step counters; `place`: load_safetensors' placement (default: the
        first device)."""
        path = Path(path).expanduser()
        check_weights_file(path)
        abstract = abstract_network(cls, preprocess=preprocess)
        counters = {f"net.{k}" for k in skipped_keys(abstract.net) if not k.startswith("fc.")}
        rename = lambda key: key if key.startswith("fc.") else f"net.{key}"  # noqa: E731
        return load_safetensors(abstract, path, rename=rename, ignore=counters, place=place, layouts=TORCH_LAYOUTS)

    def inputs(self, images: UInt8[Array, "b h w 3"]) -> Float[Array, "b 299 299 3"]:
        """The network's input in [-1, 1] at 299×299, by `preprocess` (see the module's docstring)."""
        x = jnp.asarray(images).astype(jnp.float32)
        if self.preprocess == "adm":
            return (resize_bilinear_tf1(x, (SIZE, SIZE)) - 128.0) / 128.0
        return 2 * resize_bilinear(x / 255.0, (SIZE, SIZE)) - 1

    def __call__(
        self, images: UInt8[Array | np.ndarray, "b h w 3"]
    ) -> tuple[Float[Array, "b 2048"], Float[Array, "b 2023"], Float[Array, "b 1008"]]:
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"ADMInception takes uint8 RGB images [b, h, w, 3], got {images.dtype} {images.shape}.")
        n = self.net
        x = n.Conv2d_2b_3x3(n.Conv2d_2a_3x3(n.Conv2d_1a_3x3(self.inputs(images))))
        x = max_pool(n.Conv2d_4a_3x3(n.Conv2d_3b_1x1(max_pool(x, stride=2))), stride=2)
        for block in (n.Mixed_5b, n.Mixed_5c, n.Mixed_5d, n.Mixed_6a, n.Mixed_6b, n.Mixed_6c):
            x = block(x)
        spatial = n.Mixed_6d.branch1x1(x)[..., :SPATIAL_CHANNELS]  # TF's mixed_6/conv (XLA shares it with 6d's)
        for block in (n.Mixed_6d, n.Mixed_6e, n.Mixed_7a, n.Mixed_7b, n.Mixed_7c):
            x = block(x)
        pool3 = x.mean(axis=(1, 2))
        logits = jnp.matmul(pool3, self.fc.weight.T, precision=jax.lax.Precision.HIGHEST)  # no bias, as ADM
        return pool3, spatial.reshape(len(spatial), -1), logits
