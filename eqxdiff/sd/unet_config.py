"""diffusers' `UNet2DConditionModel` config.json read for eqxdiff.sd.SDUNet: the options Stable Diffusion
1.x, 2.x, SDXL, the x4 upscaler and 2.x unCLIP use are taken, per level where diffusers allows it; any other
option at a value that would change the network raises a ValueError naming it (never a silently different
model).

`attention_head_dim` is, by diffusers' historical quirk, the number of attention HEADS of each level
(`num_attention_heads = num_attention_heads or attention_head_dim` in its __init__; diffusers itself
refuses `num_attention_heads`): SD 1.x's 8 means 8 heads at every width, SD 2.x's [5, 10, 20, 20] and
SDXL's [5, 10, 20] heads of 64 channels.
"""

import warnings
from typing import Any

# diffusers' UNet2DConditionModel.__init__ defaults (0.42), for the fields a config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "sample_size": None,
    "in_channels": 4,
    "out_channels": 4,
    "center_input_sample": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "only_cross_attention": False,
    "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
    "dropout": 0.0,
    "act_fn": "silu",
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "cross_attention_dim": 1280,
    "transformer_layers_per_block": 1,
    "reverse_transformer_layers_per_block": None,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "attention_head_dim": 8,
    "num_attention_heads": None,
    "dual_cross_attention": False,
    "use_linear_projection": False,
    "class_embed_type": None,
    "addition_embed_type": None,
    "addition_time_embed_dim": None,
    "num_class_embeds": None,
    "upcast_attention": False,
    "resnet_time_scale_shift": "default",
    "resnet_skip_time_act": False,
    "resnet_out_scale_factor": 1.0,
    "time_embedding_type": "positional",
    "time_embedding_dim": None,
    "time_embedding_act_fn": None,
    "timestep_post_act": None,
    "time_cond_proj_dim": None,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "projection_class_embeddings_input_dim": None,
    "attention_type": "default",
    "class_embeddings_concat": False,
    "mid_block_only_cross_attention": None,
    "cross_attention_norm": None,
    "addition_embed_type_num_heads": 64,
}
# Options no SD 1.x / 2.x / XL UNet changes: only diffusers' default (or an equal value) is accepted.
FIXED = {
    "center_input_sample": False,
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
    "dropout": 0.0,
    "reverse_transformer_layers_per_block": None,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "num_attention_heads": None,
    "dual_cross_attention": False,
    "resnet_time_scale_shift": "default",
    "resnet_skip_time_act": False,
    "resnet_out_scale_factor": 1.0,
    "time_embedding_type": "positional",
    "time_embedding_dim": None,
    "time_embedding_act_fn": None,
    "timestep_post_act": None,
    "time_cond_proj_dim": None,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "attention_type": "default",
    "class_embeddings_concat": False,
    "cross_attention_norm": None,
}
# class_embed_type values no released SD model uses (unCLIP's is "projection"; the x4 upscaler's table is
# num_class_embeds with class_embed_type None).
CLASS_EMBED_TYPES = (None, "projection")
DOWN_BLOCKS, UP_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D"), ("CrossAttnUpBlock2D", "UpBlock2D")
# Taken at any value, without effect on this network: sample_size (a pipeline default), addition_embed_type_num_heads
# (addition_embed_type "text" only), mid_block_only_cross_attention (UNetMidBlock2DSimpleCrossAttn only).


def parse_config(config: dict) -> dict:
    """diffusers' config with defaults filled in and per-level options as lists of one entry per level:
    `heads`, `cross_attention_dim`, `only_cross_attention`, `layers_per_block`, `transformer_layers_per_block`.

    A key diffusers' UNet2DConditionModel does not take is ignored with a warning, as diffusers'
    `ConfigMixin` does; a value this port does not implement raises a ValueError naming the option."""
    if config.get("_class_name", "UNet2DConditionModel") != "UNet2DConditionModel":
        raise ValueError(f"_class_name {config['_class_name']!r}: only diffusers' UNet2DConditionModel is supported")
    unknown = sorted(k for k in config if k not in DEFAULTS and not k.startswith("_"))
    if unknown:
        warnings.warn(
            f"UNet2DConditionModel config keys {unknown} are not options of diffusers' "
            "UNet2DConditionModel: ignored, as diffusers ignores them",
            stacklevel=3,
        )
    cfg = {**DEFAULTS, **{k: v for k, v in config.items() if k in DEFAULTS}}
    for name, value in FIXED.items():
        if cfg[name] != value:
            raise ValueError(
                f"UNet2DConditionModel option {name}={cfg[name]!r} is not supported (only {value!r}: "
                "no released Stable Diffusion UNet sets it)"
            )
    _check_class_embedding(cfg)
    if cfg["act_fn"] not in ("silu", "swish"):
        raise ValueError(f"UNet2DConditionModel option act_fn={cfg['act_fn']!r} is not supported: only 'silu'")
    if cfg["norm_num_groups"] is None:
        raise ValueError("UNet2DConditionModel option norm_num_groups=None (no output norm) is not supported")
    levels = len(cfg["block_out_channels"])
    for name, allowed in (("down_block_types", DOWN_BLOCKS), ("up_block_types", UP_BLOCKS)):
        if len(cfg[name]) != levels or any(b not in allowed for b in cfg[name]):
            raise ValueError(
                f"UNet2DConditionModel option {name}={cfg[name]}: one of {allowed} per level "
                f"({levels}, from block_out_channels) is supported"
            )
    _check_addition(cfg)
    cfg["heads"] = per_level(cfg, "attention_head_dim", levels)
    for name in ("cross_attention_dim", "only_cross_attention", "layers_per_block", "transformer_layers_per_block"):
        cfg[name] = per_level(cfg, name, levels)
    if len(set(cfg["cross_attention_dim"])) != 1:
        raise ValueError(
            f"UNet2DConditionModel option cross_attention_dim={cfg['cross_attention_dim']}: one "
            "text width for every level is supported"
        )
    depths = cfg["transformer_layers_per_block"]
    if any(isinstance(n, (list, tuple)) for n in depths):
        raise ValueError(
            f"UNet2DConditionModel option transformer_layers_per_block={depths}: a list per level (an "
            "asymmetric UNet) is not supported"
        )
    for level, (width, heads) in enumerate(zip(cfg["block_out_channels"], cfg["heads"], strict=True)):
        if width % heads or width % cfg["norm_num_groups"]:
            raise ValueError(
                f"UNet2DConditionModel: level {level}'s {width} channels must divide into "
                f"attention_head_dim={heads} heads and norm_num_groups={cfg['norm_num_groups']} groups"
            )
    return cfg


def per_level(cfg: dict, name: str, levels: int) -> list:
    """An option given as one value or one per level, as a list of `levels` entries."""
    value = cfg[name]
    if not isinstance(value, (list, tuple)):
        return [value] * levels
    if len(value) != levels:
        raise ValueError(f"UNet2DConditionModel option {name}={list(value)}: one entry per level ({levels}) needed")
    return list(value)


def _check_class_embedding(cfg: dict) -> None:
    """class_embed_type None with num_class_embeds (the x4 upscaler's table) or without (no class input),
    or "projection" (SD 2.x unCLIP) with its input width; diffusers ignores num_class_embeds then."""
    kind = cfg["class_embed_type"]
    if kind not in CLASS_EMBED_TYPES:
        raise ValueError(
            f"UNet2DConditionModel option class_embed_type={kind!r} is not supported: only None "
            "(with num_class_embeds: the x4 upscaler's table) and 'projection' (SD 2.x unCLIP)"
        )
    width = cfg["projection_class_embeddings_input_dim"]
    if kind == "projection" and (not isinstance(width, int) or width <= 0):
        raise ValueError(
            f"UNet2DConditionModel: class_embed_type 'projection' needs "
            f"projection_class_embeddings_input_dim as a positive int; got {width!r}"
        )
    if kind == "projection" and cfg["addition_embed_type"] == "text_time":
        raise ValueError(
            "UNet2DConditionModel option class_embed_type='projection' with addition_embed_type "
            "'text_time' (both read projection_class_embeddings_input_dim) is not supported"
        )
    count = cfg["num_class_embeds"]
    if kind is None and count is not None and (not isinstance(count, int) or count <= 0):
        raise ValueError(f"UNet2DConditionModel option num_class_embeds={count!r}: a positive int (table rows)")


def _check_addition(cfg: dict) -> None:
    """addition_embed_type: None (SD 1.x/2.x) or SDXL's "text_time" with its two dimensions."""
    kind = cfg["addition_embed_type"]
    if kind not in (None, "text_time"):
        raise ValueError(
            f"UNet2DConditionModel option addition_embed_type={kind!r} is not supported: only None "
            "(SD 1.x/2.x) and 'text_time' (SDXL)"
        )
    needed = ("addition_time_embed_dim", "projection_class_embeddings_input_dim")
    if kind == "text_time" and any(not isinstance(cfg[n], int) or cfg[n] <= 0 for n in needed):
        raise ValueError(
            f"UNet2DConditionModel: addition_embed_type 'text_time' needs {needed} as positive ints; "
            f"got {[cfg[n] for n in needed]}"
        )
