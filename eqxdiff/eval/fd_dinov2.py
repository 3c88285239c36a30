"""FD-DINOv2's feature network as NVlabs/edm2's calculate_metrics.py builds it (its `DINOv2Detector`, after
layer6ai-labs/dgm-eval): uint8 RGB images resized to 224² by torch's antialiased bicubic `interpolate` (EDM2's
default `resize_mode="torch"`), scaled to [0, 1], normalised by ImageNet's mean and std, through DINOv2 ViT-L/14
(torch.hub's `dinov2_vitl14`; here transformers' facebook/dinov2-large folder, the same weights, with the hub's
position-embedding resize, `interpolate_offset=0.1`), the feature being the final-LayerNorm CLS token (1024-d).

It is a `features_fn` like InceptionV3: eqxdiff.eval.fid's FID machinery (streamed statistics, the Fréchet
distance of float64 statistics, reference files) computes FD-DINOv2 with it unchanged.
"""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

from eqxdiff.local_copies import local_copy
from eqxdiff.nn.bicubic import resize_bicubic
from eqxdiff.nn.dinov2 import Dinov2Model
from eqxdiff.sharding import make_mesh, placement

SIZE = 224  # EDM2's resize target
MEAN = (0.485, 0.456, 0.406)  # ImageNet's, as EDM2 normalises
STD = (0.229, 0.224, 0.225)
HUB_OFFSET = 0.1  # facebookresearch/dinov2's hub models resize position embeddings with this kludge


class DINOv2Features(eqx.Module):
    """uint8 RGB `[b, h, w, 3]` -> float32 `[b, d]`: EDM2's DINOv2 detector (resize, normalisation, CLS token)."""

    model: Dinov2Model
    size: int = eqx.field(static=True, default=SIZE)

    @classmethod
    def from_transformers(cls, path: str | Path) -> "DINOv2Features":
        """The detector of a transformers DINOv2 folder (facebook/dinov2-large for EDM2's numbers), with the hub's
        position-embedding resize; in a job of several processes on this process's first device. A URL is read
        from its local copy (eqxdiff.local_copies)."""
        path = local_copy(path)
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} holds no config.json: pass a transformers DINOv2 folder "
                "(facebook/dinov2-large as save_pretrained writes it)"
            )
        place = None if jax.process_count() == 1 else placement(make_mesh(devices=jax.local_devices()[:1]))
        return cls(Dinov2Model.from_transformers(path, interpolate_offset=HUB_OFFSET, place=place))

    def __call__(self, images: UInt8[Array | np.ndarray, "b h w 3"]) -> Float[Array, "b d"]:
        x = resize_bicubic(jnp.asarray(images).astype(jnp.float32), (self.size, self.size), antialias=True)
        x = (x / 255 - jnp.asarray(MEAN, jnp.float32)) / jnp.asarray(STD, jnp.float32)
        return self.model(x)[1]
