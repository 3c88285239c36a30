"""Neural networks for eqxdiff: NHWC layers, an ADM-style UNet, a DiT, diffusers' AutoencoderKL,
transformers' CLIP towers (text, vision, the full CLIPModel) and DINOv2, EDM2's magnitude-preserving UNet and an exact space-to-depth "autoencoder".
Stable Diffusion's UNet and prompt embeddings are eqxdiff.sd's.

Every model keeps one contract (`DiffusionModel`, eqxdiff/nn/protocol.py):
`model(x[b,h,w,c], t[b], cond, *, key=None) -> [b,h,w,c]`, `cond` any pytree of batch-first
arrays or None (a text model's: `TextCond`); conditional models also give `null_cond(b)`.
"""

from eqxdiff.nn.autoencoder_kl import AutoencoderKL
from eqxdiff.nn.batched import Batched
from eqxdiff.nn.class_label_cond import ClassLabelCond
from eqxdiff.nn.clip_text import CLIPTextModel
from eqxdiff.nn.clip_model import CLIPModel
from eqxdiff.nn.clip_text_projection import CLIPTextModelWithProjection
from eqxdiff.nn.clip_vision import CLIPVisionModel, CLIPVisionModelWithProjection
from eqxdiff.nn.dinov2 import Dinov2Model
from eqxdiff.nn.dit import DiT, DiTBlock
from eqxdiff.nn.edm2 import EDM2UNet, MPConv, MPFourier, force_weight_normalization, mp_cat, mp_silu, mp_sum, normalize
from eqxdiff.nn.layers import (
    Conv2d,
    CrossAttention,
    Dense,
    Embedding,
    GroupNorm,
    SelfAttention,
    TimestepEmbedding,
    layer_norm,
    sincos_pos_embed_2d,
    timestep_embedding,
    zero_init,
)
from eqxdiff.nn.protocol import ConditionalModel, DiffusionModel, null_cond_of
from eqxdiff.nn.space_to_depth import SpaceToDepth
from eqxdiff.nn.text_cond import TextCond
from eqxdiff.nn.text_conditioned import TextConditioned
from eqxdiff.nn.unet import AttnBlock, ResBlock, UNet
from eqxdiff.nn.upsample import nearest_upsample, nearest_upsample_conv

__all__ = [
    "AttnBlock",
    "AutoencoderKL",
    "Batched",
    "CLIPModel",
    "CLIPTextModel",
    "CLIPTextModelWithProjection",
    "CLIPVisionModel",
    "CLIPVisionModelWithProjection",
    "ClassLabelCond",
    "ConditionalModel",
    "Conv2d",
    "CrossAttention",
    "DiT",
    "DiTBlock",
    "Dense",
    "DiffusionModel",
    "Dinov2Model",
    "EDM2UNet",
    "Embedding",
    "GroupNorm",
    "MPConv",
    "MPFourier",
    "ResBlock",
    "SelfAttention",
    "SpaceToDepth",
    "TextCond",
    "TextConditioned",
    "TimestepEmbedding",
    "UNet",
    "force_weight_normalization",
    "layer_norm",
    "mp_cat",
    "mp_silu",
    "mp_sum",
    "nearest_upsample",
    "nearest_upsample_conv",
    "normalize",
    "null_cond_of",
    "sincos_pos_embed_2d",
    "timestep_embedding",
    "zero_init",
]
