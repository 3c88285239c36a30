"""Schedules and σ grids against their papers' closed forms and published numbers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.diffusion import (
    EDMSchedule,
    FlowSchedule,
    VPSchedule,
    karras_sigmas,
    logsnr_sigmas,
    schedule_by_name,
    vp_sigmas,
    vp_timesteps,
)

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)


def test_karras_grid_endpoints_and_shape():
    grid = karras_sigmas(18, sigma_min=0.002, sigma_max=80.0, rho=7.0)
    assert grid.shape == (19,)
    assert grid[0] == pytest.approx(80.0, rel=1e-12)
    assert grid[-2] == pytest.approx(0.002, rel=1e-12)
    assert grid[-1] == 0.0
    assert np.all(np.diff(grid) < 0)
    # ρ = 1 is a linear ramp; the midpoint of ρ = 7 is ((80^(1/7) + 0.002^(1/7))/2)^7 (EDM eq. 5).
    np.testing.assert_allclose(karras_sigmas(5, 1.0, 9.0, rho=1.0), [9, 7, 5, 3, 1, 0])
    mid = ((80 ** (1 / 7) + 0.002 ** (1 / 7)) / 2) ** 7
    assert karras_sigmas(3)[1] == pytest.approx(mid, rel=1e-12)


def test_logsnr_grid_is_uniform_in_log_snr():
    grid = logsnr_sigmas(10, 0.01, 50.0)
    log_snr = -2 * np.log(grid[:-1])
    np.testing.assert_allclose(np.diff(log_snr), np.diff(log_snr)[0], rtol=1e-10)
    assert grid[0] == pytest.approx(50.0) and grid[-2] == pytest.approx(0.01) and grid[-1] == 0


def test_vp_timesteps_match_diffusers_spacings():
    # Lin et al. 2023 ("Common Diffusion Noise Schedules and Sample Steps are Flawed"), Table 2.
    assert vp_timesteps(1000, 10, "leading").tolist() == [900, 800, 700, 600, 500, 400, 300, 200, 100, 0]
    assert vp_timesteps(1000, 10, "trailing").tolist() == [999, 899, 799, 699, 599, 499, 399, 299, 199, 99]
    assert vp_timesteps(1000, 10, "linspace").tolist() == [999, 888, 777, 666, 555, 444, 333, 222, 111, 0]
    schedule = VPSchedule.linear()
    grid = vp_sigmas(schedule, 10, "trailing")
    assert grid[0] == schedule.sigmas[999] and grid[-2] == schedule.sigmas[99] and grid[-1] == 0
    with pytest.raises(ValueError, match="choose one of"):
        vp_timesteps(1000, 10, "uniform")


def test_ddpm_linear_schedule_published_values():
    # DDPM (Ho et al. 2020): β from 1e-4 to 0.02 over 1000 steps; ᾱ_T ≈ 4.04e-5, so the
    # last σ ≈ 157.4 (the VP σ_max quoted by k-diffusion / EDM for this schedule).
    schedule = VPSchedule.linear()
    alpha_bar = np.asarray(schedule.alphas_cumprod)
    betas = np.linspace(1e-4, 0.02, 1000)
    assert alpha_bar[0] == pytest.approx(1 - 1e-4, rel=1e-12)
    assert alpha_bar[1] == pytest.approx((1 - betas[0]) * (1 - betas[1]), rel=1e-12)
    assert alpha_bar[-1] == pytest.approx(4.036e-5, rel=1e-3)
    assert schedule.sigma_max == pytest.approx(157.4, rel=1e-3)
    assert schedule.sigma_min == pytest.approx(math.sqrt(1e-4 / (1 - 1e-4)), rel=1e-9)


def test_cosine_alpha_bar_at_known_points():
    # ᾱ_t = f(t+1)/f(0) with f(u) = cos²((u/T + s)/(1 + s)·π/2), Nichol & Dhariwal 2021 eq. 17.
    schedule = VPSchedule.cosine()
    alpha_bar = np.asarray(schedule.alphas_cumprod)
    f = lambda u: math.cos((u / 1000 + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    for t in (0, 249, 499, 749, 900):
        assert alpha_bar[t] == pytest.approx(f(t + 1) / f(0), rel=1e-9)
    assert alpha_bar[499] == pytest.approx(0.4936, abs=1e-3)  # ≈ 1/2 at the midpoint
    # β is clipped at 0.999 near t = T (the paper's fix for the singularity at t = T).
    assert alpha_bar[-1] / alpha_bar[-2] == pytest.approx(1 - 0.999, rel=1e-9)


@pytest.mark.parametrize("name", ["vp_linear", "vp_cosine", "edm", "flow"])
def test_sigma_time_round_trip(name):
    schedule = schedule_by_name(name)
    sigma = jnp.geomspace(schedule.sigma_min * 1.01, schedule.sigma_max * 0.99, 50)
    np.testing.assert_allclose(schedule.t_to_sigma(schedule.sigma_to_t(sigma)), sigma, rtol=2e-4)


def test_vp_time_is_the_timestep_index_and_scale_is_sqrt_alpha_bar():
    schedule = VPSchedule.linear()
    t = np.array([0, 1, 10, 500, 998, 999])
    sigma = jnp.asarray(schedule.sigmas[t], jnp.float32)
    np.testing.assert_allclose(schedule.sigma_to_t(sigma), t, atol=2e-3)
    alpha_bar = np.asarray(schedule.alphas_cumprod)[t]
    np.testing.assert_allclose(schedule.scale(sigma), np.sqrt(alpha_bar), rtol=1e-6)


def test_flow_schedule_is_linear_interpolation():
    # x = s·(x0 + σ·ε) must equal (1 - t)·x0 + t·ε.
    schedule = FlowSchedule()
    t = jnp.array([0.1, 0.5, 0.9])
    sigma = t / (1 - t)
    np.testing.assert_allclose(schedule.scale(sigma), 1 - t, rtol=1e-6)
    np.testing.assert_allclose(schedule.scale(sigma) * sigma, t, rtol=1e-6)
    np.testing.assert_allclose(schedule.sigma_to_t(sigma), 1000 * t, rtol=1e-5)


def test_training_draws_follow_their_distributions():
    key = jax.random.key(0)
    n = 200_000
    log_sigma = np.log(np.asarray(EDMSchedule().sample_sigma(key, (n,))))
    assert log_sigma.mean() == pytest.approx(-1.2, abs=4 * 1.2 / math.sqrt(n))
    assert log_sigma.std() == pytest.approx(1.2, abs=0.01)

    sigma = np.asarray(FlowSchedule().sample_sigma(key, (n,)))
    logit_t = np.log(sigma)  # logit(t) = ln(t/(1-t)) = ln σ
    assert logit_t.mean() == pytest.approx(0.0, abs=4 / math.sqrt(n))
    assert logit_t.std() == pytest.approx(1.0, abs=0.01)

    schedule = VPSchedule.cosine()
    sigma = np.asarray(schedule.sample_sigma(key, (n,)))
    t = np.searchsorted(schedule.sigmas.astype(np.float32), sigma)
    assert np.all(schedule.sigmas.astype(np.float32)[t] == sigma)  # only grid σs
    counts = np.bincount(t // 100, minlength=10)  # uniform over the 1000 timesteps
    np.testing.assert_allclose(counts / n, 0.1, atol=4 * math.sqrt(0.09 / n))


def test_unknown_schedule_and_bad_vp_schedule_errors():
    with pytest.raises(ValueError, match="choose one of .*'edm'"):
        schedule_by_name("karras")
    with pytest.raises(ValueError, match="strictly decreasing"):
        VPSchedule(np.array([0.5, 0.9]))
