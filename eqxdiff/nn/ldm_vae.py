"""The original latent-diffusion (LDM) autoencoder's state_dict names, mapped to diffusers'.

Single-file VAEs (`vae-ft-mse-840000-ema-pruned.safetensors`, `sdxl_vae.safetensors`, FLUX's
`ae.safetensors`, and the `first_stage_model.` part of a whole SD checkpoint) keep the names of
CompVis' `ldm/modules/diffusionmodules/model.py`: `encoder.down.0.block.1.norm1.weight`,
`encoder.mid.attn_1.q.weight` (a 1x1 conv), `decoder.up.3.upsample.conv.weight` (up.0 is the
LAST decoder level: LDM builds the decoder's list from the bottom). The map is diffusers'
`convert_ldm_vae_checkpoint` (`diffusers/loaders/single_file_utils.py`), key for key; the
architecture is read from the shapes (`config_from_shapes`).
"""

import re

# What diffusers' converter takes from a whole checkpoint: the keys under the first of these found.
PREFIXES = ("first_stage_model.", "vae.")
TOP_LEVEL = {"norm_out": "conv_norm_out"}  # encoder./decoder.norm_out -> conv_norm_out
RESNET = {"nin_shortcut": "conv_shortcut"}
ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def vae_prefix(keys: list[str]) -> str:
    """The prefix of the VAE's keys in a file: `first_stage_model.` (SD checkpoints), `vae.`, or ""."""
    for prefix in PREFIXES:
        if any(k.startswith(prefix) for k in keys):
            return prefix
    return ""


def diffusers_name(ldm_key: str, num_levels: int) -> str:
    """An LDM VAE key (prefix removed) as diffusers names it, for a VAE of `num_levels` levels
    (`len(block_out_channels)`); keys it does not know come back unchanged (the load then names them)."""
    parts = ldm_key.split(".")
    if parts[0] not in ("encoder", "decoder") or len(parts) < 3:
        return ldm_key
    side, rest = parts[0], parts[1:]
    if rest[0] in TOP_LEVEL:
        rest = [TOP_LEVEL[rest[0]], *rest[1:]]
    elif rest[0] == "mid" and re.fullmatch(r"block_[12]", rest[1]):
        rest = ["mid_block", "resnets", str(int(rest[1][-1]) - 1), *_resnet(rest[2:])]
    elif rest[0] == "mid" and rest[1] == "attn_1" and len(rest) == 4 and rest[2] in ATTENTION:
        rest = ["mid_block", "attentions", "0", ATTENTION[rest[2]], rest[3]]
    elif rest[0] in ("down", "up") and len(rest) >= 4 and rest[1].isdigit():
        level = int(rest[1]) if side == "encoder" else num_levels - 1 - int(rest[1])
        blocks = "down_blocks" if side == "encoder" else "up_blocks"
        if rest[2] == "block" and rest[3].isdigit():
            rest = [blocks, str(level), "resnets", rest[3], *_resnet(rest[4:])]
        elif rest[2] in ("downsample", "upsample"):
            rest = [blocks, str(level), f"{rest[2]}rs", "0", *rest[3:]]
    return ".".join([side, *rest])


def _resnet(rest: list[str]) -> list[str]:
    return [RESNET.get(rest[0], rest[0]), *rest[1:]] if rest else rest


def config_from_shapes(shapes: dict[str, tuple[int, ...]]) -> dict:
    """The diffusers AutoencoderKL options an LDM state_dict's shapes determine (keys without prefix):
    channels, block_out_channels, layers_per_block, latent_channels, the quant convs, mid attention.
    Not determined: norm_num_groups (LDM's `Normalize` is always 32 groups) and the latent
    scaling (scaling_factor, shift_factor, latents_mean/std)."""
    levels = sorted({int(m[1]) for k in shapes if (m := re.match(r"encoder\.down\.(\d+)\.", k))})
    layers = {int(m[1]) for k in shapes if (m := re.match(r"encoder\.down\.0\.block\.(\d+)\.", k))}
    if not levels or not layers or "encoder.conv_in.weight" not in shapes or "decoder.conv_out.weight" not in shapes:
        raise ValueError(
            "not an LDM autoencoder state_dict: no encoder.conv_in, encoder.down.<i>.block.<j> or decoder.conv_out keys"
        )
    widths = [shapes[f"encoder.down.{i}.block.0.conv1.weight"][0] for i in levels]
    return {
        "in_channels": shapes["encoder.conv_in.weight"][1],
        "out_channels": shapes["decoder.conv_out.weight"][0],
        "block_out_channels": widths,
        "down_block_types": ["DownEncoderBlock2D"] * len(widths),
        "up_block_types": ["UpDecoderBlock2D"] * len(widths),
        "layers_per_block": max(layers) + 1,
        "latent_channels": shapes["decoder.conv_in.weight"][1],
        "use_quant_conv": "quant_conv.weight" in shapes,
        "use_post_quant_conv": "post_quant_conv.weight" in shapes,
        "mid_block_add_attention": "encoder.mid.attn_1.q.weight" in shapes,
    }
