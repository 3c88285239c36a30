"""Denoiser plumbing (input scale, time, output combination) and classifier-free guidance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.diffusion import (
    ClassifierFreeGuidance,
    Denoiser,
    EDMSchedule,
    FlowSchedule,
    VPSchedule,
    drop_condition,
    karras_sigmas,
    parameterization_by_name,
    sample,
)
from eqxdiff.nn import TextCond

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

MU, VAR = 0.2, 0.3


def true_denoiser(x, sigma):
    return MU + VAR / (VAR + sigma**2) * (x - MU)


def textbook_input_scale(schedule, name, sigma):
    if name == "edm":
        return 1 / jnp.sqrt(sigma**2 + 0.25)  # Karras et al. 2022, Table 1
    if isinstance(schedule, VPSchedule):
        return 1 / jnp.sqrt(1 + sigma**2)  # sqrt(ᾱ)
    if isinstance(schedule, FlowSchedule):
        return 1 / (1 + sigma)  # 1 - t
    return jnp.ones_like(sigma)


def textbook_target(name, x, D, sigma):
    """What an ideal network outputs, by each parameterization's definition."""
    eps = (x - D) / sigma
    if name == "eps":
        return eps
    if name == "x0":
        return D
    if name == "v":  # α·ε - σ_t·x0, α = sqrt(ᾱ)
        alpha = 1 / jnp.sqrt(1 + sigma**2)
        return alpha * eps - sigma * alpha * D
    if name == "flow":  # ε - x0
        return eps - D
    c_skip = 0.25 / (sigma**2 + 0.25)
    c_out = sigma * 0.5 / jnp.sqrt(sigma**2 + 0.25)
    return (D - c_skip * x) / c_out


@pytest.mark.parametrize(
    "schedule_name, name",
    [("vp_linear", "eps"), ("vp_cosine", "v"), ("vp_cosine", "x0"), ("edm", "edm"), ("flow", "flow"), ("edm", "eps")],
)
def test_denoiser_of_an_ideal_network_is_the_true_denoiser(schedule_name, name):
    from eqxdiff.diffusion import schedule_by_name

    schedule = schedule_by_name(schedule_name)

    def ideal_network(inp, t, cond=None):
        sigma = schedule.t_to_sigma(t)[:, None]
        x = inp / textbook_input_scale(schedule, name, sigma)
        return textbook_target(name, x, true_denoiser(x, sigma), sigma)

    denoiser = Denoiser(ideal_network, schedule, parameterization_by_name(name))
    sigma = jnp.geomspace(schedule.sigma_min * 2, min(schedule.sigma_max, 80.0) / 2, 7)
    x = MU + jnp.sqrt(VAR + sigma[:, None] ** 2) * jax.random.normal(jax.random.key(0), (7, 5))
    np.testing.assert_allclose(denoiser(x, sigma), true_denoiser(x, sigma[:, None]), rtol=2e-3, atol=2e-4)


def test_sampling_an_ideal_edm_network_gives_the_data_distribution():
    schedule = EDMSchedule()

    def ideal_network(inp, t, cond=None):
        sigma = schedule.t_to_sigma(t)[:, None]
        x = inp * jnp.sqrt(sigma**2 + 0.25)
        return textbook_target("edm", x, true_denoiser(x, sigma), sigma)

    denoiser = Denoiser(ideal_network, schedule, parameterization_by_name("edm"))
    x = 80.0 * jax.random.normal(jax.random.key(1), (20_000, 1))
    out = sample(denoiser, x, karras_sigmas(40), "heun")
    assert float(out.mean()) == pytest.approx(MU, abs=4 * np.sqrt(VAR / 20_000))
    assert float(out.std()) == pytest.approx(np.sqrt(VAR), rel=0.02)


class CountingDenoiser:
    """A conditional denoiser whose output depends on the label; counts its calls and batch sizes."""

    def __init__(self):
        self.batch_sizes = []

    def __call__(self, x, sigma, labels):
        self.batch_sizes.append(x.shape[0])
        return x * 0.5 + labels[:, None].astype(x.dtype) + sigma


def test_guidance_is_one_call_on_the_doubled_batch():
    x = jax.random.normal(jax.random.key(0), (4, 3))
    labels = jnp.array([0, 1, 2, 3])
    null = 10
    counting = CountingDenoiser()
    guided = ClassifierFreeGuidance(counting, labels, 3.0, jnp.array([null]))(x, jnp.array(0.7))
    assert counting.batch_sizes == [8]
    reference = CountingDenoiser()
    cond = reference(x, 0.7, labels)
    uncond = reference(x, 0.7, jnp.full_like(labels, null))
    np.testing.assert_allclose(guided, uncond + 3.0 * (cond - uncond), rtol=1e-6)


def test_guidance_scale_one_is_the_conditional_model_alone():
    x = jax.random.normal(jax.random.key(0), (4, 3))
    labels = jnp.array([3, 1, 2, 0])
    counting = CountingDenoiser()
    out = ClassifierFreeGuidance(counting, labels, 1.0, jnp.array([10]))(x, jnp.array(0.3))
    assert counting.batch_sizes == [4]
    np.testing.assert_allclose(out, CountingDenoiser()(x, 0.3, labels))


def test_guided_sampling_compiles_and_steers():
    # A class-dependent Gaussian: guidance w > 1 pushes samples past the class mean, away from
    # the unconditional (null-class) mean, by the factor w on the mean difference.
    means = jnp.array([-1.0, 1.0, 0.0])  # classes 0, 1 and the null label 2 (the mixture mean)

    def denoiser(x, sigma, labels):
        return means[labels][:, None] + VAR / (VAR + sigma**2) * (x - means[labels][:, None])

    labels = jnp.ones(4000, jnp.int32)
    x = 80.0 * jax.random.normal(jax.random.key(2), (4000, 1))
    out = sample(ClassifierFreeGuidance(denoiser, labels, 2.0, jnp.array([2])), x, karras_sigmas(30), "heun")
    assert float(out.mean()) == pytest.approx(2.0, abs=0.05)


def test_drop_condition_rate_and_untouched_labels():
    labels = jnp.arange(100_000) % 10
    dropped = drop_condition(jax.random.key(0), labels, 0.1, jnp.array([10]))
    is_null = np.asarray(dropped == 10)
    assert is_null.mean() == pytest.approx(0.1, abs=4 * np.sqrt(0.09 / 100_000))
    np.testing.assert_array_equal(np.asarray(dropped)[~is_null], np.asarray(labels)[~is_null])


def text_condition(b, n=5, d=3, seed=0):
    """A text condition: context [b, n, d], mask [b, n], pooled [b, d]."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    return TextCond(
        context=jax.random.normal(k1, (b, n, d)),
        mask=jnp.arange(n)[None, :] < jnp.arange(1, b + 1)[:, None] % n + 1,
        pooled=jax.random.normal(k2, (b, d)),
    )


def test_drop_condition_replaces_whole_examples_of_a_pytree():
    cond = text_condition(2000)
    null = TextCond(jnp.zeros((1, 5, 3)), jnp.zeros((1, 5), bool), jnp.full((1, 3), -7.0))
    dropped = drop_condition(jax.random.key(3), cond, 0.3, null)
    assert isinstance(dropped, TextCond)
    gone = np.asarray(dropped.pooled[:, 0] == -7.0)
    assert 0.25 < gone.mean() < 0.35
    # every leaf of a dropped example is null, every leaf of a kept one untouched
    np.testing.assert_array_equal(np.asarray(dropped.context)[gone], 0.0)
    np.testing.assert_array_equal(np.asarray(dropped.mask)[gone], False)
    for k in ("context", "mask", "pooled"):
        np.testing.assert_array_equal(np.asarray(getattr(dropped, k))[~gone], np.asarray(getattr(cond, k))[~gone])
    assert drop_condition(jax.random.key(3), None, 0.3, None) is None


def text_denoiser(x, sigma, cond):
    """Depends on every leaf of a text condition, masked context included."""
    context = jnp.sum(cond.context * cond.mask[..., None], axis=1)  # [b, d]
    return 0.5 * x + context.sum(-1, keepdims=True) * cond.pooled[:, :1] + sigma


def test_guidance_over_a_pytree_condition_equals_two_calls():
    x = jax.random.normal(jax.random.key(0), (4, 3))
    cond = text_condition(4)
    null = jax.tree.map(lambda a: jnp.zeros_like(a[:1]), cond)
    calls = []

    def counting(x, sigma, c):
        calls.append(x.shape[0])
        return text_denoiser(x, sigma, c)

    guided = ClassifierFreeGuidance(counting, cond, 2.5, null)(x, jnp.array(0.7))
    assert calls == [8]
    conditional = text_denoiser(x, 0.7, cond)
    unconditional = text_denoiser(x, 0.7, jax.tree.map(lambda c, n: jnp.broadcast_to(n, c.shape), cond, null))
    np.testing.assert_allclose(guided, unconditional + 2.5 * (conditional - unconditional), rtol=1e-5, atol=1e-6)


def test_guidance_rejects_a_null_condition_of_another_structure():
    cond = text_condition(4)
    with pytest.raises(ValueError, match="null condition"):
        ClassifierFreeGuidance(text_denoiser, cond, 2.0, {"pooled": jnp.zeros((1, 3))})(
            jnp.zeros((4, 3)), jnp.array(1.0)
        )
    no_pooled = TextCond(jnp.zeros((1, 5, 3)), jnp.ones((1, 5), bool))  # a null for a net without a pooled vector
    with pytest.raises(ValueError, match="null condition"):
        ClassifierFreeGuidance(text_denoiser, cond, 2.0, no_pooled)(jnp.zeros((4, 3)), jnp.array(1.0))
