"""Parameterizations and train/main.py's loss against the textbook objectives, each written out here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.diffusion import (
    PARAMETERIZATIONS,
    DataPrediction,
    Denoiser,
    EDMPreconditioning,
    EDMSchedule,
    EpsilonPrediction,
    FlowSchedule,
    FlowVelocity,
    VPrediction,
    VPSchedule,
    denoising_loss,
    denoising_prediction,
    loss_weight,
    parameterization_by_name,
)

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import main as train_main  # train/main.py

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

B, H, W, C = 6, 4, 4, 2


def toy_model(x, t, cond=None, *, key=None):
    """A fixed nonlinear function of the input and the time: stands in for a network."""
    return jnp.tanh(0.7 * x + 0.01 * t[:, None, None, None]) + 0.3 * jnp.sin(x[..., ::-1])


def main_loss(model, schedule, parameterization, x0, sigma, noise):
    """The loss train/main.py trains with, on a prepared batch."""
    batch = dict(x0=x0, sigma=sigma, noise=noise, cond=None)
    return train_main.loss_fn(model, batch, None, schedule=schedule, parameterization=parameterization)


@pytest.fixture
def batch():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x0 = jax.random.uniform(k1, (B, H, W, C), minval=-1, maxval=1)
    noise = jax.random.normal(k2, (B, H, W, C))
    return x0, noise, k3


def test_ddpm_epsilon_mse(batch):
    # Ho et al. 2020, eq. 14: ‖ε - ε_θ(sqrt(ᾱ_t)·x0 + sqrt(1-ᾱ_t)·ε, t)‖².
    x0, noise, key = batch
    schedule = VPSchedule.linear()
    t = jax.random.randint(key, (B,), 0, 1000)
    a = jnp.asarray(np.asarray(schedule.alphas_cumprod), jnp.float32)[t][:, None, None, None]
    x_t = jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise
    expected = jnp.mean((toy_model(x_t, t.astype(jnp.float32)) - noise) ** 2)
    sigma = jnp.asarray(schedule.sigmas, jnp.float32)[t]
    ours = main_loss(toy_model, schedule, EpsilonPrediction(), x0, sigma, noise)
    np.testing.assert_allclose(ours, expected, rtol=1e-4)


def test_v_prediction_mse(batch):
    # Salimans & Ho 2022, §4: v = α·ε - σ_t·x0, regress v_θ(α·x0 + σ_t·ε) on it.
    x0, noise, key = batch
    schedule = VPSchedule.cosine()
    t = jax.random.randint(key, (B,), 0, 1000)
    a = jnp.asarray(np.asarray(schedule.alphas_cumprod), jnp.float32)[t][:, None, None, None]
    alpha, sigma_t = jnp.sqrt(a), jnp.sqrt(1 - a)
    x_t = alpha * x0 + sigma_t * noise
    v = alpha * noise - sigma_t * x0
    expected = jnp.mean((toy_model(x_t, t.astype(jnp.float32)) - v) ** 2)
    sigma = jnp.asarray(schedule.sigmas, jnp.float32)[t]
    ours = main_loss(toy_model, schedule, VPrediction(), x0, sigma, noise)
    np.testing.assert_allclose(ours, expected, rtol=1e-4)


def test_edm_weighted_loss(batch):
    # Karras et al. 2022, eq. 2 and Table 1: λ(σ)‖D_θ(y + n; σ) - y‖², λ = (σ²+σ_d²)/(σ·σ_d)².
    x0, noise, key = batch
    sd = 0.5
    sigma = jnp.exp(-1.2 + 1.2 * jax.random.normal(key, (B,)))
    s = sigma[:, None, None, None]
    y = x0 + s * noise
    c_skip = sd**2 / (s**2 + sd**2)
    c_out = s * sd / jnp.sqrt(s**2 + sd**2)
    c_in = 1 / jnp.sqrt(s**2 + sd**2)
    D = c_skip * y + c_out * toy_model(c_in * y, jnp.log(sigma) / 4)
    lam = (s**2 + sd**2) / (s * sd) ** 2
    expected = jnp.mean(lam * (D - x0) ** 2)
    ours = main_loss(toy_model, EDMSchedule(), EDMPreconditioning(sd), x0, sigma, noise)
    np.testing.assert_allclose(ours, expected, rtol=1e-4)


def test_flow_matching_mse(batch):
    # Lipman et al. 2022 / Liu et al. 2022: x_t = (1-t)·x0 + t·ε, regress u_θ(x_t, t) on ε - x0.
    x0, noise, key = batch
    t = jax.random.uniform(key, (B,), minval=0.05, maxval=0.95)
    tt = t[:, None, None, None]
    x_t = (1 - tt) * x0 + tt * noise
    expected = jnp.mean((toy_model(x_t, 1000 * t) - (noise - x0)) ** 2)
    ours = main_loss(toy_model, FlowSchedule(), FlowVelocity(), x0, t / (1 - t), noise)
    np.testing.assert_allclose(ours, expected, rtol=1e-4)


def test_x0_prediction_mse(batch):
    x0, noise, key = batch
    sigma = jnp.exp(jax.random.normal(key, (B,)))
    s = sigma[:, None, None, None]
    expected = jnp.mean((toy_model(x0 + s * noise, jnp.log(sigma) / 4) - x0) ** 2)
    ours = main_loss(toy_model, EDMSchedule(), DataPrediction(), x0, sigma, noise)
    np.testing.assert_allclose(ours, expected, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(PARAMETERIZATIONS))
def test_loss_is_edm_form_with_lambda_one_over_c_out_squared(name, batch):
    # The F-space loss equals E λ(σ)‖D(x; σ) - x0‖² with λ = loss_weight (EDM eq. 2).
    x0, noise, key = batch
    schedule = FlowSchedule() if name == "flow" else VPSchedule.cosine()
    parameterization = parameterization_by_name(name)
    sigma = jnp.exp(jax.random.uniform(key, (B,), minval=-2.0, maxval=2.0))
    D = Denoiser(toy_model, schedule, parameterization)(x0 + sigma[:, None, None, None] * noise, sigma)
    lam = loss_weight(sigma, parameterization, schedule)[:, None, None, None]
    expected = jnp.mean(lam * (D - x0) ** 2)
    ours = main_loss(toy_model, schedule, parameterization, x0, sigma, noise)
    np.testing.assert_allclose(ours, expected, rtol=2e-3)


@pytest.mark.parametrize("name", sorted(PARAMETERIZATIONS))
def test_prediction_is_the_denoiser_and_its_squared_error(name, batch):
    x0, noise, key = batch
    schedule = FlowSchedule() if name == "flow" else EDMSchedule()
    parameterization = parameterization_by_name(name)
    sigma = jnp.exp(jax.random.uniform(key, (B,), minval=-1.0, maxval=1.5))
    D = Denoiser(toy_model, schedule, parameterization)(x0 + sigma[:, None, None, None] * noise, sigma)
    pred = denoising_prediction(toy_model, schedule, parameterization, x0, sigma, noise)
    np.testing.assert_allclose(pred.x0_hat, D, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pred.mse, jnp.mean((D - x0) ** 2, axis=(1, 2, 3)), rtol=2e-4)


def test_error_stays_accurate_at_tiny_sigma(batch):
    # At σ = 1e-4 D - x0 is ~1e-4 of x0: the F-space form keeps its digits, computed in float64 here.
    x0, noise, _ = batch
    sigma = jnp.full((B,), 1e-4)
    pred = denoising_prediction(toy_model, EDMSchedule(), EDMPreconditioning(), x0, sigma, noise)
    x0_, n_, s = (np.asarray(a, np.float64) for a in (x0, noise, 1e-4))
    c_skip, c_out, c_in = 0.25 / (s**2 + 0.25), s * 0.5 / np.sqrt(s**2 + 0.25), 1 / np.sqrt(s**2 + 0.25)
    x = x0_ + s * n_
    out = np.asarray(
        toy_model(jnp.asarray(c_in * x, jnp.float32), jnp.full((B,), np.log(s) / 4, jnp.float32)), np.float64
    )
    exact = np.mean((c_skip * x + c_out * out - x0_) ** 2, axis=(1, 2, 3))
    np.testing.assert_allclose(pred.mse, exact, rtol=1e-3)


def test_edm_lambda_and_snr_weights():
    sigma = jnp.array([0.01, 0.5, 3.0, 40.0])
    np.testing.assert_allclose(
        loss_weight(sigma, EDMPreconditioning(0.5), EDMSchedule()), (sigma**2 + 0.25) / (sigma * 0.5) ** 2, rtol=1e-5
    )
    np.testing.assert_allclose(loss_weight(sigma, EpsilonPrediction(), EDMSchedule()), 1 / sigma**2, rtol=1e-6)
    np.testing.assert_allclose(loss_weight(sigma, VPrediction(), EDMSchedule()), 1 + 1 / sigma**2, rtol=1e-5)


def test_denoising_loss_draws_from_the_schedule_and_is_jittable(batch):
    x0, _, key = batch
    loss = jax.jit(lambda k: denoising_loss(toy_model, EDMSchedule(), EDMPreconditioning(), x0, k))
    a, b = loss(key), loss(jax.random.key(99))
    assert a.shape == () and jnp.isfinite(a) and a != b


def test_unknown_parameterization_lists_choices():
    with pytest.raises(ValueError, match="choose one of .*'eps'"):
        parameterization_by_name("score")


def test_sigma_data_reaches_edm_preconditioning_by_name():
    # Latent runs pass σ_data = 1: EDM's λ(σ) = (σ² + σ_d²)/(σ·σ_d)² with σ_d = 1.
    sigma = jnp.array([0.01, 0.5, 3.0, 40.0])
    edm = parameterization_by_name("edm", sigma_data=1.0)
    np.testing.assert_allclose(loss_weight(sigma, edm, EDMSchedule()), (sigma**2 + 1) / sigma**2, rtol=1e-5)
    assert parameterization_by_name("edm").sigma_data == 0.5  # EDM's value for images in [-1, 1]
    assert parameterization_by_name("eps", sigma_data=1.0) == EpsilonPrediction()  # no σ_d to set


def test_the_quickstart_trains_main_py_s_loss_fn():
    """notebooks/quickstart.ipynb writes main.py's loss_fn out (notebooks import nothing from train/): the same
    function, line for line, so the tutorial trains what train/main.py trains."""
    import inspect
    import json
    from pathlib import Path

    notebook = json.loads((Path(__file__).parents[2] / "notebooks" / "quickstart.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")
    assert inspect.getsource(train_main.loss_fn) in code
