"""eqxdiff's Stable Diffusion models written back as diffusers model folders (the inverse of `from_diffusers`).

`save_diffusers(model, folder)` writes an `SDUNet` as a pipeline's `unet/` (`UNet2DConditionModel`) or an
`AutoencoderKL` as its `vae/`: `config.json` and `diffusion_pytorch_model.safetensors` with diffusers' names
(the leaf paths), PyTorch's layouts (torch_state.py) and the dtype asked. The UNet's config is the one it was
built from (`SDUNet.config`); its Transformer2DModels' proj_in/proj_out go back to the 1x1 convolutions of
`use_linear_projection=False` files (SD 1.x). The VAE keeps no config: it is read off the module (sizes, norm
groups, latent scaling, tile size). LoRA adapters are merged into their base weights first (`merge_lora`).
"""

import json
import re
from pathlib import Path

import equinox as eqx
import numpy as np
from jax.typing import DTypeLike

from eqxdiff.nn.autoencoder_kl import WEIGHTS_FILE, AutoencoderKL
from eqxdiff.nn.lora import merge_lora
from eqxdiff.nn.torch_state import torch_state_dict
from eqxdiff.nn.torch_weights import leaf_layouts
from eqxdiff.sd.unet import SDUNet
from eqxdiff.sd.unet_config import parse_config
from eqxdiff.weights.model_folder import check_writable, write_model_folder

PROJECTIONS = r".*attentions\.\d+\.proj_(in|out)\.weight"  # Transformer2DModel's, conv 1x1 or Linear in the file


def unet_state(unet: SDUNet, dtype: DTypeLike | str = np.float32) -> dict[str, np.ndarray]:
    """The UNet's state_dict as diffusers' `UNet2DConditionModel` holds it (host arrays, `dtype`)."""
    linear = parse_config(json.loads(unet.config))["use_linear_projection"]
    convs = () if linear else [name for name in leaf_layouts(unet) if re.fullmatch(PROJECTIONS, name)]
    return torch_state_dict(unet, dtype=dtype, as_conv1x1=convs)


def unet_config(unet: SDUNet) -> dict:
    """The diffusers config the UNet was built from, `_class_name` added if it had none."""
    return {"_class_name": "UNet2DConditionModel", **json.loads(unet.config)}


def vae_config(vae: AutoencoderKL) -> dict:
    """A diffusers `AutoencoderKL` config that builds `vae` again: the sizes from its shapes, the rest from its
    static fields. Per-channel latent statistics come back as `latents_std = 1 / scale` with scaling_factor 1
    (the same product: the file stores only their ratio)."""
    encoder = vae.encoder
    widths = [block.resnets[0].conv1.weight.shape[3] for block in encoder.down_blocks]
    levels = len(widths)
    if isinstance(vae.latent_scale, float):
        scaling = dict(
            scaling_factor=vae.latent_scale, shift_factor=vae.latent_shift or None, latents_mean=None, latents_std=None
        )
    else:
        scaling = dict(
            scaling_factor=1.0,
            shift_factor=None,
            latents_mean=list(vae.latent_shift),
            latents_std=[1.0 / s for s in vae.latent_scale],
        )
    return {
        "_class_name": "AutoencoderKL",
        "act_fn": "silu",
        "block_out_channels": widths,
        "down_block_types": ["DownEncoderBlock2D"] * levels,
        "up_block_types": ["UpDecoderBlock2D"] * levels,
        "force_upcast": True,
        "in_channels": encoder.conv_in.weight.shape[2],
        "out_channels": vae.decoder.conv_out.weight.shape[3],
        "latent_channels": vae.decoder.conv_in.weight.shape[2],
        "layers_per_block": len(encoder.down_blocks[0].resnets),
        "norm_num_groups": encoder.conv_norm_out.groups,
        "mid_block_add_attention": encoder.mid_block.attentions[0] is not None,
        "sample_size": vae.tile_sample_size,
        "use_quant_conv": vae.quant_conv is not None,
        "use_post_quant_conv": vae.post_quant_conv is not None,
        **scaling,
    }


def save_diffusers(
    model: eqx.Module,
    folder: str | Path,
    *,
    dtype: DTypeLike | str = np.float32,
    variant: str | None = None,
    overwrite: bool = False,
) -> Path:
    """`model` (an `SDUNet` or `AutoencoderKL`) as the diffusers model folder `from_pretrained` (and eqxdiff's
    `from_diffusers`) reads: `folder/config.json` and `folder/diffusion_pytorch_model[.<variant>].safetensors`,
    weights as `dtype` (float32, float16 or bfloat16). A LoRA-wrapped model is merged first. A non-empty
    `folder` is refused unless `overwrite` (then only config.json and the weights file are replaced). Returns
    `folder`."""
    if not isinstance(model, (SDUNet, AutoencoderKL)):
        raise ValueError(f"save_diffusers writes an eqxdiff SDUNet or AutoencoderKL, not a {type(model).__name__}")
    folder = check_writable(folder, overwrite)
    model = merge_lora(model)
    if isinstance(model, SDUNet):
        config, state = unet_config(model), unet_state(model, dtype)
    else:
        config, state = vae_config(model), torch_state_dict(model, dtype=dtype)
    return write_model_folder(folder, config, state, WEIGHTS_FILE, variant=variant)
