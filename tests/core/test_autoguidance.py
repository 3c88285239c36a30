"""Autoguidance (Karras et al. 2024): D_w + w·(D - D_w), both denoisers on the same condition."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.diffusion import AutoGuidance, karras_sigmas, sample

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

MEANS = np.array([-1.0, 1.0])  # per class
VAR, WEAK_VAR, SCALE = 0.3, 0.8, 2.5  # the weak model: a blurrier Gaussian of the same class means


class GaussianDenoiser(eqx.Module):
    """E[x0 | x] for x0 ~ N(means[label], var), as a module with arrays (a network's weights stand-in)."""

    means: jax.Array
    var: jax.Array

    def __call__(self, x, sigma, labels):
        mean = self.means[labels][:, None]
        return mean + self.var / (self.var + sigma**2) * (x - mean)


def closed_form(x, sigma, labels, var):
    mean = MEANS[labels][:, None]
    return mean + var / (var + sigma**2) * (np.asarray(x, np.float64) - mean)


def models():
    return GaussianDenoiser(jnp.asarray(MEANS, jnp.float32), jnp.float32(VAR)), GaussianDenoiser(
        jnp.asarray(MEANS, jnp.float32), jnp.float32(WEAK_VAR)
    )


@pytest.mark.parametrize("sigma", [0.05, 0.7, 3.0])
def test_autoguidance_is_the_weak_model_extrapolated_to_the_good_one(sigma):
    good, weak = models()
    labels = np.array([0, 1, 1, 0, 1])
    x = 2 * jax.random.normal(jax.random.key(0), (5, 1))
    out = AutoGuidance(good, weak, SCALE, jnp.asarray(labels))(x, jnp.float32(sigma))
    d, d_weak = closed_form(x, sigma, labels, VAR), closed_form(x, sigma, labels, WEAK_VAR)
    np.testing.assert_allclose(out, d_weak + SCALE * (d - d_weak), rtol=1e-5, atol=1e-6)
    assert not np.allclose(d, d_weak)  # the two models disagree here: the scale is seen


def test_the_weak_model_sees_the_condition():
    """A weak model with its condition dropped (or another one) would pull towards another mean."""
    good, weak = models()
    labels = np.array([1, 1, 1])
    x = jnp.zeros((3, 1))
    out = AutoGuidance(good, weak, SCALE, jnp.asarray(labels))(x, jnp.float32(1.0))
    other = closed_form(x, 1.0, 1 - labels, WEAK_VAR)
    mine = closed_form(x, 1.0, labels, WEAK_VAR)
    d = closed_form(x, 1.0, labels, VAR)
    np.testing.assert_allclose(out, mine + SCALE * (d - mine), rtol=1e-5, atol=1e-6)
    assert not np.allclose(out, other + SCALE * (d - other))


def test_scale_one_is_the_good_model_alone():
    calls = []
    good, weak = models()

    def counted_weak(x, sigma, labels):
        calls.append(x.shape[0])
        return weak(x, sigma, labels)

    labels = jnp.array([0, 1])
    x = jnp.ones((2, 1))
    out = AutoGuidance(good, counted_weak, 1.0, labels)(x, jnp.float32(0.5))
    np.testing.assert_allclose(out, closed_form(x, 0.5, np.asarray(labels), VAR), rtol=1e-6)
    assert calls == []


def test_both_models_sample_in_one_compiled_program():
    """`sample` compiles once for the pair (one program holds both networks) and not again for new weights."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: (
            compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    good, weak = models()
    labels = jnp.array([0, 1, 1, 0, 1, 0, 1, 1])
    x = 80.0 * jax.random.normal(jax.random.key(3), (8, 1))
    sigmas = np.asarray(karras_sigmas(9, 0.002, 80.0), np.float32)  # a host grid: no conversion program
    start = len(compiles)
    out = sample(AutoGuidance(good, weak, SCALE, labels), x, sigmas, "heun")
    out.block_until_ready()
    first = len(compiles) - start
    again = sample(
        AutoGuidance(eqx.tree_at(lambda m: m.var, good, jnp.float32(0.2)), weak, SCALE, labels), x, sigmas, "heun"
    )
    again.block_until_ready()
    assert first == 1 and len(compiles) - start == 1, compiles[start:]
    # Samples land past the class means (guidance sharpens towards the good model's narrower class).
    assert np.isfinite(np.asarray(out)).all() and not np.allclose(out, again)
