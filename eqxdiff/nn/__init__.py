"""Neural networks for eqxdiff: NHWC layers, an ADM-style UNet and a DiT.

Every model is called as `model(x[b,h,w,c], t[b], labels[b] | None, *, key=None) -> [b,h,w,c]`.
"""

from eqxdiff.nn.dit import DiT, DiTBlock
from eqxdiff.nn.layers import (
    Conv2d, Dense, Embedding, GroupNorm, SelfAttention, TimestepEmbedding, layer_norm,
    sincos_pos_embed_2d, timestep_embedding, zero_init,
)  # fmt: skip
from eqxdiff.nn.unet import AttnBlock, ResBlock, UNet

__all__ = [
    "AttnBlock", "Conv2d", "DiT", "DiTBlock", "Dense", "Embedding", "GroupNorm", "ResBlock",
    "SelfAttention", "TimestepEmbedding", "UNet", "layer_norm", "sincos_pos_embed_2d",
    "timestep_embedding", "zero_init",
]  # fmt: skip
