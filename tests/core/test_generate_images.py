"""eqxdiff.generate.generate_images: the one call that samples and decodes (the scripts' through
eqxdiff/run/sampling.py's Sampling.images, the notebooks') is `generate` for pixels and `decode_latents` of
`generate` for latents."""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.run.codecs import Latents, Pixels, codec_from_config
from eqxdiff.diffusion import parameterization_by_name, schedule_by_name
from eqxdiff.generate import decode_latents, generate, generate_images
from eqxdiff.sharding import make_mesh

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

FLUX_LIKE = Path(__file__).parents[1] / "data" / "autoencoder_kl" / "flux_like"  # 16 channels, f = 2, a shift


class LabelledDrift(eqx.Module):
    """A stand-in network whose output depends on x, t and the label (so guidance changes the samples)."""

    scale: jax.Array

    def __call__(self, x, t, cond, *, key=None):
        return self.scale * x + 0.01 * t[:, None, None, None] + 0.1 * cond[:, None, None, None].astype(x.dtype)


def sampled(codec, sample_shape: tuple) -> tuple[tuple, dict]:
    """generate's arguments for 8 guided samples of labels 0..7 (null label 10) with `codec`'s σ_data."""
    model = LabelledDrift(jnp.float32(0.3))
    labels = np.arange(8, dtype=np.int32)
    args = (model, schedule_by_name("edm"), parameterization_by_name("edm", codec.sigma_data), labels, 8, sample_shape)
    return args, dict(
        mesh=make_mesh(data=-1, fsdp=1), steps=3, method="heun", null_cond=np.array([10], np.int32), seed=5
    )


def test_pixels_are_what_generate_draws():
    (model, *rest), kwargs = sampled(Pixels(), (4, 4, 1))
    images, drawn = generate_images(model, Pixels(), *rest, guidance=2.5, **kwargs)
    expected = generate(model, *rest, guidance=2.5, **kwargs)
    np.testing.assert_array_equal(images, expected)
    assert drawn is images  # nothing to decode
    unguided, _ = generate_images(model, Pixels(), *rest, guidance=1.0, **kwargs)
    assert np.abs(unguided - images).max() > 1e-3  # the guidance scale reached the sampler


def test_latents_are_decoded_by_the_autoencoder_from_what_generate_draws():
    mesh = make_mesh(data=-1, fsdp=1)
    codec = codec_from_config({"kind": "latents", "autoencoder": str(FLUX_LIKE)}, mesh=mesh)  # replicated
    assert isinstance(codec, Latents)
    (model, *rest), kwargs = sampled(codec, (4, 4, 16))
    images, drawn = generate_images(model, codec, *rest, guidance=2.5, tiling="off", **kwargs)
    latents = generate(model, *rest, guidance=2.5, **kwargs)
    np.testing.assert_array_equal(drawn, latents)
    np.testing.assert_array_equal(images, decode_latents(codec.autoencoder, latents, mesh=mesh, tiling="off"))
    assert images.shape == (8, 8, 8, 3)  # the VAE's images, not the latents
