"""The model table: a name (--model) -> a diffusion network for the run's image shape and
condition (class labels, a pretrained tower's encoded text, or tokens read by a text tower
trained with the model). Used by train/main.py and train/sample.py."""

from eqxdiff.nn import DiT, UNet

# name -> (image shape, remat, key, **cond) -> model, where cond is `num_classes=n` (labels) or
# `context_dim=d, pooled_dim=p` (text). Add yours here: any callable
# `model(x[b,h,w,c], t[b], cond, *, key=None)` (eqxdiff.nn.DiffusionModel; eqxdiff.nn.Batched
# wraps a one-example Equinox module).
MODELS = {
    "unet": lambda shape, remat, key, **cond: UNet(shape[-1], (32, 64), 1, remat=remat, key=key, **text_options((), (0, 1), cond), **cond),
    # One level: every path of this script in a step that compiles in half the time of two levels.
    "unet_tiny": lambda shape, remat, key, **cond: UNet(shape[-1], (16,), 1, norm_groups=4, remat=remat, key=key, **text_options((), (0,), cond), **cond),
    # One level of 64 channels: for inputs already small, e.g. 4×4 latents (space_to_depth:2 of digits).
    "unet_flat": lambda shape, remat, key, **cond: UNet(shape[-1], (128,), 2, remat=remat, key=key, **text_options((0,), (0,), cond), **cond),
    "unet_flaxdiff": lambda shape, remat, key, **cond: UNet.flaxdiff_simple(shape[-1], remat=remat, key=key, **cond),
    "dit_s": lambda shape, remat, key, **cond: DiT.small(shape[0], shape[-1], 2, remat=remat, key=key, **cond),
    "dit_tiny": lambda shape, remat, key, **cond: DiT(shape[0], 2, shape[-1], 64, 2, 4, remat=remat, key=key, **cond),
}
# A text tower trained from scratch with the model (--text_encoder scratch, captioned_digits): a
# small CLIP-style transformer (transformers' CLIPTextConfig fields; vocabulary and length come
# from the tokenizer).
SCRATCH_TEXT_TOWER = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, hidden_act="gelu")
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


def build_model(name: str, image_shape: tuple, remat: bool, key, condition):
    """MODELS[name] for the run's condition (eqxdiff/conditions.py): its sizes, and where the condition
    trains its own text tower, that tower around the network."""
    return condition.build(lambda k, **sizes: MODELS[name](image_shape, remat, k, **sizes), key)
