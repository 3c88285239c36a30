"""FlaxDiff 0.2.11's side of the side-by-side benchmarks (bench_train_vs_flaxdiff.py,
bench_sampling_vs_flaxdiff.py): its simple UNet as both compare it, and the input config its trainer
and samplers need for a model that takes no real condition.

Imported only where `flaxdiff` is installed (a separate venv: see bench_train_vs_flaxdiff.py).
"""

import jax.numpy as jnp
from flaxdiff.inputs import ConditionalInputConfig, DiffusionInputConfig
from flaxdiff.inputs.encoders import ConditioningEncoder
from flaxdiff.models.simple_unet import Unet

VERSION = "0.2.11"
UNET = "flaxdiff.models.simple_unet.Unet(emb 128, depths (32, 64, 128), no attention)"


class NullContextEncoder(ConditioningEncoder):
    """A `[b, 1, 1]` zero text context: the simple UNet's `__call__(x, temb, textcontext)` always reads
    `textcontext.shape` and FlaxDiff feeds it only through a `ConditionalInputConfig`; without attention
    the UNet reads only its shape. No model, no tokenizer, nothing downloaded."""

    @property
    def key(self):
        return "textcontext"  # the UNet's argument name, and the batch key it is read from

    def __call__(self, data):
        return jnp.zeros((len(data), 1, 1), jnp.float32)

    def serialize(self):
        return {}

    @staticmethod
    def deserialize(serialized_config):
        return NullContextEncoder(model=None, tokenizer=None)


def simple_unet(channels: int) -> Unet:
    """The UNet eqxdiff's `UNet.flaxdiff_simple(channels)` mirrors (2,141,379 params at 3 channels)."""
    return Unet(
        output_channels=channels,
        emb_features=128,
        feature_depths=(32, 64, 128),
        attention_configs=(None, None, None),
        num_res_blocks=2,
        num_middle_res_blocks=1,
    )


def input_config(image_shape: tuple) -> DiffusionInputConfig:
    """Images under "image" of `image_shape` (h, w, c), and the null context."""
    return DiffusionInputConfig(
        sample_data_key="image",
        sample_data_shape=tuple(image_shape),
        conditions=[ConditionalInputConfig(encoder=NullContextEncoder(model=None, tokenizer=None))],
    )
