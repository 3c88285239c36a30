"""The model table: a name (--model) -> a diffusion network for the run's image shape and
condition (class labels, a pretrained tower's encoded text, or tokens read by a text tower
trained with the model). Data a script extends: train/main.py adds its own entries to MODELS and
CONSTRUCTORS (docs/edits.md, edit (b), "Your own model"); a checkpoint stores the constructor's name and
arguments, which `build_model` (and eqxdiff/run/rebuild.py's `load_run`) read back."""

import json
from collections.abc import Sequence

from eqxdiff.nn import DiT, EDM2UNet, UNet
from eqxdiff.sd import SDUNet


def sd_unet(config: dict, *, remat: bool, key, context_dim: int = 0, pooled_dim: int = 0, num_classes: int = 0):
    """diffusers' UNet2DConditionModel of `config` (its config.json as a dict; eqxdiff/run/finetune.py's --init sd:FOLDER
    stores it as the model's arguments), random weights; the condition's text width must be its cross_attention_dim."""
    del pooled_dim  # SD 1.x/2.x's UNet reads the context only
    model = None if num_classes or not context_dim else SDUNet.from_config(config, remat=remat, key=key)
    if model is None or context_dim != model.context_dim:
        raise ValueError(
            f"SDUNet takes a text context of width {config.get('cross_attention_dim')} "
            f"(cross_attention_dim), not labels; got context_dim={context_dim}, "
            f"num_classes={num_classes}"
        )
    return model


# name -> (image shape, **sizes) -> (constructor, keyword arguments): the network is
# CONSTRUCTORS[constructor](**arguments, remat=..., key=...), where sizes are the condition's:
# `num_classes=n` (labels) or `context_dim=d, pooled_dim=p` (text). A checkpoint stores the constructor
# and its arguments (`model_args`), so an edit here changes new runs only. Add yours: a constructor
# (any callable returning a `model(x[b,h,w,c], t[b], cond, *, key=None)`, eqxdiff.nn.DiffusionModel;
# eqxdiff.nn.Batched wraps a one-example Equinox module) and an entry.

CONSTRUCTORS = {
    "UNet": UNet,
    "UNet.flaxdiff_simple": UNet.flaxdiff_simple,
    "DiT": DiT,
    "DiT.small": DiT.small,
    "EDM2UNet": EDM2UNet,
    "SDUNet": sd_unet,
}
MODELS = {
    "unet": lambda shape, **sizes: (
        "UNet",
        dict(in_channels=shape[-1], channels=(32, 64), num_res_blocks=1, **text_options((), (0, 1), sizes), **sizes),
    ),
    # One level: every path of this script in a step that compiles in half the time of two levels.
    "unet_tiny": lambda shape, **sizes: (
        "UNet",
        dict(
            in_channels=shape[-1],
            channels=(16,),
            num_res_blocks=1,
            norm_groups=4,
            **text_options((), (0,), sizes),
            **sizes,
        ),
    ),
    # One level of 128 channels: for inputs already small, e.g. 4×4 latents (space_to_depth:2 of digits).
    "unet_flat": lambda shape, **sizes: (
        "UNet",
        dict(in_channels=shape[-1], channels=(128,), num_res_blocks=2, **text_options((0,), (0,), sizes), **sizes),
    ),
    "unet_flaxdiff": lambda shape, **sizes: ("UNet.flaxdiff_simple", dict(in_channels=shape[-1], **sizes)),
    "dit_s": lambda shape, **sizes: (
        "DiT.small",
        dict(image_size=shape[0], in_channels=shape[-1], patch_size=2, **sizes),
    ),
    "dit_tiny": lambda shape, **sizes: (
        "DiT",
        dict(image_size=shape[0], patch_size=2, in_channels=shape[-1], hidden_size=64, depth=2, num_heads=4, **sizes),
    ),
    # EDM2's magnitude-preserving U-Net at a size digits train on a CPU: two levels, attention only in the
    # innermost decoder block (EDM2's in0).
    "edm2_tiny": lambda shape, **sizes: edm2(
        shape, sizes, 32, channel_mult=(1, 2), num_blocks=1, attn_resolutions=(), channels_per_head=32
    ),
    # For 32×32 images: three levels, attention at 8×8.
    "edm2_small": lambda shape, **sizes: edm2(
        shape, sizes, 64, channel_mult=(1, 2, 2), num_blocks=2, attn_resolutions=(8,), channels_per_head=32
    ),
    # EDM2's own sizes: width and dropout of train_edm2.py's edm2-img512-* presets (img64-* share them).
    "edm2_xxs": lambda shape, **sizes: edm2(shape, sizes, *EDM2UNet.PRESETS["img512-xxs"]),
    "edm2_xs": lambda shape, **sizes: edm2(shape, sizes, *EDM2UNet.PRESETS["img512-xs"]),
    "edm2_s": lambda shape, **sizes: edm2(shape, sizes, *EDM2UNet.PRESETS["img512-s"]),
    "edm2_m": lambda shape, **sizes: edm2(shape, sizes, *EDM2UNet.PRESETS["img512-m"]),
    "edm2_l": lambda shape, **sizes: edm2(shape, sizes, *EDM2UNet.PRESETS["img512-l"]),
    "edm2_xl": lambda shape, **sizes: edm2(shape, sizes, *EDM2UNet.PRESETS["img512-xl"]),
    "edm2_xxl": lambda shape, **sizes: edm2(shape, sizes, *EDM2UNet.PRESETS["img512-xxl"]),
    # Stable Diffusion's UNet (diffusers' UNet2DConditionModel), small: trained here on a VP schedule with ε
    # (--schedule vp_linear --parameterization eps, diffusers' "linear" betas), save_pipeline gives diffusers it.
    "sd_tiny": lambda shape, **sizes: (
        "SDUNet",
        dict(
            config=dict(
                _class_name="UNet2DConditionModel",
                in_channels=shape[-1],
                out_channels=shape[-1],
                sample_size=shape[0],
                block_out_channels=[32, 64],
                layers_per_block=1,
                norm_num_groups=8,
                attention_head_dim=8,
                down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
                cross_attention_dim=sizes.get("context_dim", 0),
            ),
            **sizes,
        ),
    ),
}
# A text tower trained from scratch with the model (--text_encoder scratch, captioned_digits): a
# small CLIP-style transformer (transformers' CLIPTextConfig fields; vocabulary and length come
# from the tokenizer).
SCRATCH_TEXT_TOWER = dict(
    hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, hidden_act="gelu"
)
# Causal, as CLIP: the second digit of "a 7 right of a 3" reads the words before it, "right" among them,
# so its token alone says where it goes. Bidirectional towers learned which digits, not where
# (BENCHMARKS.md "Text-to-image without weights").
SCRATCH_TEXT_CAUSAL = True
# No pooled vector into the time embedding: it names the digits but not their places, and a network
# given it learned "which" through it and "where" (cross-attention) later: seed 0 learned the order
# within 450 steps without it, not with it (BENCHMARKS.md "Text-to-image without weights").
SCRATCH_TEXT_POOLED = False


def text_options(self_levels: tuple[int, ...], cross_levels: tuple[int, ...], cond: dict) -> dict:
    """What a text UNet adds: cross-attention to the caption at `cross_levels`, self-attention at
    `self_levels` only (attention over pixels costs much of a CPU step, and captioned_digits learned
    the order of its digits sooner without it: the convolutions carry the image's own context),
    and a position embedding (so "left of" in a caption can bind to places); nothing for labels."""
    if not cond.get("context_dim"):
        return {}
    return dict(attention_levels=self_levels, cross_attention_levels=cross_levels, position_embedding=True)


def model_args(name: str, image_shape: Sequence[int], condition) -> dict:
    """What MODELS[name] declares for the run's image shape and condition (eqxdiff/run/conditions.py): the
    constructor's name and its keyword arguments, as a checkpoint stores them (JSON: tuples as lists)."""
    constructor, kwargs = MODELS[name](tuple(image_shape), **condition.model_kwargs())
    return json.loads(json.dumps({"constructor": constructor, "kwargs": kwargs}))


def build_model(args: dict, remat: bool, key, condition, constructors: dict | None = None):
    """The network `model_args` described, for the run's condition: where the condition trains its own text
    tower, that tower around it. JSON's lists become tuples again (static fields must hash). `constructors`:
    the table that names it (default CONSTRUCTORS)."""
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in args["kwargs"].items()}
    construct = (constructors or CONSTRUCTORS)[args["constructor"]]
    return condition.build(lambda k, **sizes: construct(**(kwargs | sizes), remat=remat, key=k), key)


def changed_args(saved: dict, now: dict) -> list[str]:
    """The arguments whose value differs between two `model_args`, as `name saved -> now`."""
    if saved["constructor"] != now["constructor"]:
        return [f"constructor {saved['constructor']} -> {now['constructor']}"]
    names = sorted(saved["kwargs"].keys() | now["kwargs"].keys())
    missing = "(default)"
    return [
        f"{k} {saved['kwargs'].get(k, missing)} -> {now['kwargs'].get(k, missing)}"
        for k in names
        if saved["kwargs"].get(k, missing) != now["kwargs"].get(k, missing)
    ]


def edm2(shape: tuple, sizes: dict, model_channels: int, dropout: float = 0.0, **network) -> tuple[str, dict]:
    """An EDM2UNet entry (eqxdiff/nn/edm2.py): class labels or none, not text (its label input is EDM2's one-hot)."""
    if sizes.get("context_dim"):
        raise SystemExit("--model edm2_*: EDM2UNet takes class labels or no condition, not text; use --model unet")
    return "EDM2UNet", dict(
        in_channels=shape[-1], image_size=shape[0], model_channels=model_channels, dropout=dropout, **network, **sizes
    )
