"""Classifier-free guidance in a limited interval of σ (Kynkäänniemi et al. 2024): guided inside (lo, hi],
the conditional model elsewhere, from one network call on b rows there."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.diffusion import ClassifierFreeGuidance, karras_sigmas, sample

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

VAR = 0.3
MEANS = np.array([-1.0, 1.0, 0.0])  # classes 0, 1 and the null label 2
LO, HI, SCALE = 0.5, 2.0, 3.0


def gaussian_denoiser(x, sigma, labels):
    """E[x0 | x] for x0 ~ N(MEANS[label], VAR): the exact denoiser of a class-conditional Gaussian."""
    mean = jnp.asarray(MEANS, x.dtype)[labels][:, None]
    return mean + VAR / (VAR + sigma**2) * (x - mean)


def closed_form(x, sigma, labels, inside):
    """What guidance in the interval gives: D_u + w·(D_c - D_u) inside, D_c outside, in float64 numpy."""
    x = np.asarray(x, np.float64)
    shrink = VAR / (VAR + sigma**2)
    cond = MEANS[labels][:, None] + shrink * (x - MEANS[labels][:, None])
    uncond = MEANS[2] + shrink * (x - MEANS[2])
    return uncond + SCALE * (cond - uncond) if inside else cond


@pytest.mark.parametrize("jit", [False, True])
def test_interval_guides_inside_and_is_conditional_outside(jit):
    x = jax.random.normal(jax.random.key(0), (6, 1)) * 2
    labels = jnp.array([0, 1, 0, 1, 1, 0])
    guidance = ClassifierFreeGuidance(gaussian_denoiser, labels, SCALE, jnp.array([2]), interval=(LO, HI))
    call = eqx.filter_jit(lambda g, x, s: g(x, s)) if jit else (lambda g, x, s: g(x, s))
    # lo itself is outside, hi itself inside: the interval is (lo, hi].
    for sigma, inside in [
        (0.1, False),
        (LO, False),
        (0.51, True),
        (1.0, True),
        (HI, True),
        (2.01, False),
        (5.0, False),
    ]:
        out = call(guidance, x, jnp.asarray(sigma, jnp.float32))
        np.testing.assert_allclose(
            out, closed_form(x, sigma, np.asarray(labels), inside), rtol=1e-5, atol=1e-6, err_msg=f"sigma {sigma}"
        )
        # The two cases differ here, so the comparison decides which one was taken.
        assert not np.allclose(
            closed_form(x, sigma, np.asarray(labels), True), closed_form(x, sigma, np.asarray(labels), False)
        )


def test_outside_the_interval_the_network_runs_once_on_b_rows():
    """Counted as the compiled sampler runs (a callback in the network fires only in the branch taken):
    every call at a σ outside (lo, hi] sees the b conditional rows, every call inside the 2b doubled rows."""
    calls = []

    def counting_denoiser(x, sigma, labels):
        jax.debug.callback(lambda rows, s: calls.append((int(rows), float(s))), x.shape[0], sigma)
        return gaussian_denoiser(x, sigma, labels)

    b = 5
    labels = jnp.array([0, 1, 1, 0, 1])
    sigmas = karras_sigmas(12)
    guidance = ClassifierFreeGuidance(counting_denoiser, labels, SCALE, jnp.array([2]), interval=(LO, HI))
    out = sample(guidance, 80.0 * jax.random.normal(jax.random.key(1), (b, 1)), sigmas, "euler")
    jax.effects_barrier()
    assert np.isfinite(np.asarray(out)).all()
    levels = [float(s) for s in np.asarray(sigmas)[:-1]]  # euler: one call per step, at the step's σ
    assert [s for _, s in calls] == pytest.approx(levels)
    assert [rows for rows, _ in calls] == [2 * b if LO < s <= HI else b for s in levels]
    assert {rows for rows, _ in calls} == {b, 2 * b}  # the grid crosses the interval: both branches ran


def test_interval_sampling_equals_a_step_by_step_closed_form():
    """Euler on the Karras grid with guidance in the interval equals the same Euler steps on the closed form."""
    labels = np.array([0, 1, 1, 0])
    x0 = 80.0 * np.asarray(jax.random.normal(jax.random.key(2), (4, 1)))
    sigmas = np.asarray(karras_sigmas(10), np.float64)
    guidance = ClassifierFreeGuidance(gaussian_denoiser, jnp.asarray(labels), SCALE, jnp.array([2]), interval=(LO, HI))
    out = sample(guidance, jnp.asarray(x0, jnp.float32), sigmas, "euler")
    x = x0
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        denoised = closed_form(x, sigma, labels, LO < sigma <= HI)
        x = x + (sigma_next - sigma) * (x - denoised) / sigma
    np.testing.assert_allclose(out, x, rtol=1e-4, atol=1e-4)


def test_an_interval_needs_lo_below_hi_and_one_sigma_per_call():
    with pytest.raises(ValueError, match="0 <= sigma_lo < sigma_hi"):
        ClassifierFreeGuidance(gaussian_denoiser, jnp.array([0]), SCALE, jnp.array([2]), interval=(2.0, 1.0))
    guidance = ClassifierFreeGuidance(gaussian_denoiser, jnp.array([0, 1]), SCALE, jnp.array([2]), interval=(LO, HI))
    with pytest.raises(
        (ValueError, TypeError), match="one σ per call|parameter 'sigma'"
    ):  # under the type hook: its own
        guidance(jnp.zeros((2, 1)), jnp.array([1.0, 1.0]))
