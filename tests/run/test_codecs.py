"""eqxdiff.run.codecs: what x0 is, and its round trip through a checkpoint's config.
(Latents' posterior draw against float64: tests/scripts/test_latent_training.py.)"""

import jax
import numpy as np
import pytest

from eqxdiff.run.codecs import Latents, Pixels, codec_from_config
from eqxdiff.sharding import make_mesh

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)


def test_pixels_map_uint8_to_minus_one_one_and_decode_to_themselves():
    image = np.array([0, 51, 255], np.uint8).reshape(1, 1, 3, 1)
    x0 = np.asarray(Pixels().x0({"image": image}, jax.random.key(0)))
    np.testing.assert_allclose(x0.ravel(), [-1.0, 51 / 127.5 - 1, 1.0], rtol=1e-6)
    assert Pixels().decode(x0, mesh=make_mesh(data=-1, fsdp=1)) is x0
    assert Pixels().image_shape((8, 8, 1)) == (8, 8, 1)


def test_latents_round_trip_through_their_config_and_decode_by_the_autoencoder():
    """space_to_depth:2 with its scaling 1, shift 0: a 4×4×4 latent is a 8×8×1 image, pixel (2i+a, 2j+b) its
    channel 2a+b at (i, j)."""
    codec = codec_from_config({"kind": "latents", "autoencoder": "space_to_depth:2"})
    assert isinstance(codec, Latents) and codec.sigma_data == 1.0
    assert (
        codec_from_config(codec.to_config()).to_config()
        == codec.to_config()
        == {"kind": "latents", "autoencoder": "space_to_depth:2"}
    )
    assert codec.image_shape((4, 4, 4)) == (8, 8, 1)
    z = np.random.default_rng(0).normal(size=(8, 4, 4, 4)).astype(np.float32)
    images = codec.decode(z, mesh=make_mesh(data=-1, fsdp=1))
    for a in range(2):
        for b in range(2):
            np.testing.assert_array_equal(images[:, a::2, b::2, 0], z[..., 2 * a + b])


def test_a_config_without_a_codec_is_pixels():
    """Checkpoints from before codecs were stored hold none."""
    assert isinstance(codec_from_config(None), Pixels) and Pixels().sigma_data == 0.5
