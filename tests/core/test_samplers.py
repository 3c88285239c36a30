"""Samplers against closed forms: Gaussian data has an exact denoiser and an exact PF-ODE flow.

For x0 ~ N(μ, diag(v)), x = x0 + σ·ε has D(x; σ) = μ + v/(v + σ²)·(x - μ), and the
probability-flow ODE dx/dσ = (x - D)/σ keeps (x - μ)/sqrt(v + σ²) constant.
"""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.diffusion import METHODS, VPSchedule, karras_sigmas, sample, vp_sigmas
from eqxdiff.diffusion import samplers as samplers_module
import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

MU = np.array([0.3, -1.0, 0.0])
VAR = np.array([0.25, 0.04, 1.0])


def gaussian_denoiser(x, sigma, *, sigma_end=None):
    del sigma_end  # meanflow's step asks for the average over [sigma_end, sigma]; this one gives D(x; sigma) at any end
    mu, var = (jnp.asarray(a, x.dtype) if isinstance(x, jax.Array) else a for a in (MU, VAR))
    return mu + var / (var + sigma**2) * (x - mu)


def exact_flow(x, sigma_from, sigma_to):
    return MU + (x - MU) * np.sqrt(VAR + sigma_to**2) / np.sqrt(VAR + sigma_from**2)


def unit_noise(n, dtype=jnp.float32, seed=0):
    return jax.random.normal(jax.random.key(seed), (n, MU.size), dtype)


def fitted_order(method):
    """Slope of log(error) against log(1/steps) on Karras grids that stop at σ_min."""
    steps = np.array([16, 32, 64, 128])
    errors = []
    with jax.enable_x64(True):
        x = 80.0 * unit_noise(16, jnp.float64)
        for n in steps:
            grid = karras_sigmas(int(n))[:-1]  # end at σ_min > 0: every step is a full step
            out = np.asarray(sample(gaussian_denoiser, x, grid, method))
            errors.append(np.abs(out - exact_flow(np.asarray(x), grid[0], grid[-1])).max())
    return -np.polyfit(np.log(steps), np.log(errors), 1)[0], errors


@pytest.mark.parametrize("method, order", [("euler", 1.0), ("heun", 2.0), ("dpmpp_2m", 2.0)])
def test_ode_solvers_converge_at_their_order(method, order):
    slope, errors = fitted_order(method)
    assert abs(slope - order) < 0.25, (slope, errors)
    assert errors[-1] < errors[0] / 2 ** (3 * order - 1)


def test_euler_matches_its_closed_form_product_in_float64():
    # Euler on the Gaussian ODE: x_{i+1} - μ = (x_i - μ)·(1 + (σ_{i+1} - σ_i)·σ_i/(v + σ_i²)).
    with jax.enable_x64(True):
        grid = karras_sigmas(12)
        x = 80.0 * unit_noise(4, jnp.float64)
        out = sample(gaussian_denoiser, x, grid, "euler")
        assert out.dtype == jnp.float64
        factor = np.ones_like(VAR)
        for s, sn in zip(grid[:-1], grid[1:]):
            factor = factor * (1 + (sn - s) * s / (VAR + s**2))
        np.testing.assert_allclose(np.asarray(out), MU + (np.asarray(x) - MU) * factor, rtol=0, atol=1e-10)


def test_heun_one_step_is_edm_algorithm_1_in_float64():
    with jax.enable_x64(True):
        s0, s1 = 2.0, 0.7
        x = 2.0 * unit_noise(3, jnp.float64)
        out = sample(gaussian_denoiser, x, np.array([s0, s1]), "heun")
        x = np.asarray(x)
        d = (x - gaussian_denoiser(x, s0)) / s0
        x_e = x + (s1 - s0) * d
        d2 = (x_e - gaussian_denoiser(x_e, s1)) / s1
        np.testing.assert_allclose(np.asarray(out), x + (s1 - s0) * (d + d2) / 2, atol=1e-12)


def test_dpmpp_2m_two_steps_follow_lu_et_al_in_float64():
    # DPM-Solver++(2M) in λ = -ln σ (Lu et al. 2022, Alg. 2, VE form α_t = 1).
    with jax.enable_x64(True):
        grid = np.array([3.0, 1.2, 0.4])
        x = 3.0 * unit_noise(3, jnp.float64)
        out = sample(gaussian_denoiser, x, grid, "dpmpp_2m")
        lam = -np.log(grid)
        x = np.asarray(x)
        d0 = gaussian_denoiser(x, grid[0])
        h1 = lam[1] - lam[0]
        x1 = grid[1] / grid[0] * x - np.expm1(-h1) * d0
        d1 = gaussian_denoiser(x1, grid[1])
        h2 = lam[2] - lam[1]
        r = h1 / h2
        dd = (1 + 1 / (2 * r)) * d1 - 1 / (2 * r) * d0
        expected = grid[2] / grid[1] * x1 - np.expm1(-h2) * dd
        np.testing.assert_allclose(np.asarray(out), expected, atol=1e-12)


def step_noise(key, num_steps, shape):
    """The unit noise `sample` hands step i (float64): its key split once per step."""
    return [np.asarray(jax.random.normal(k, shape, jnp.float64)) for k in jax.random.split(key, num_steps)]


def test_heun_with_churn_one_step_is_edm_algorithm_2_in_float64():
    # Karras et al. 2022, Alg. 2 with N = 1: γ = min(S_churn/N, √2 - 1) for t_i in [S_tmin, S_tmax],
    # t̂ = t_i + γ·t_i, x̂ = x_i + sqrt(t̂² - t_i²)·S_noise·ε, then Heun's step from t̂ to t_{i+1}.
    with jax.enable_x64(True):
        t0, t1, churn, s_noise = 2.0, 0.7, 0.3, 1.007
        x, key = 2.0 * unit_noise(3, jnp.float64), jax.random.key(5)
        (eps,) = step_noise(key, 1, x.shape)
        x = np.asarray(x)
        # t_0 in [S_tmin, S_tmax], then above S_tmax (no churn: Alg. 1).
        for s_tmin, s_tmax, gamma in ((0.5, 10.0, min(churn, np.sqrt(2) - 1)), (0.5, 1.9, 0.0)):
            out = sample(
                gaussian_denoiser,
                jnp.asarray(x),
                np.array([t0, t1]),
                "heun",
                key,
                s_churn=churn,
                s_tmin=s_tmin,
                s_tmax=s_tmax,
                s_noise=s_noise,
            )
            t_hat = t0 + gamma * t0
            x_hat = x + np.sqrt(t_hat**2 - t0**2) * s_noise * eps
            d = (x_hat - gaussian_denoiser(x_hat, t_hat)) / t_hat
            x_next = x_hat + (t1 - t_hat) * d
            d_next = (x_next - gaussian_denoiser(x_next, t1)) / t1
            np.testing.assert_allclose(np.asarray(out), x_hat + (t1 - t_hat) * (d + d_next) / 2, rtol=0, atol=1e-12)


def test_dpmpp_2m_sde_two_steps_follow_k_diffusion_in_float64():
    # k-diffusion's sample_dpmpp_2m_sde (midpoint) in λ = -ln σ, h = λ_next - λ: the SDE-DPM-Solver++
    # step x ← (σ_next/σ)·e^{-ηh}·x + (1 - e^{-(1+η)h})·D, from the 2nd step the midpoint correction
    # + ½(1 - e^{-(1+η)h})·(D - D_prev)/r with r = h_prev/h, then noise σ_next·sqrt(1 - e^{-2ηh})·s_noise·z.
    with jax.enable_x64(True):
        grid, eta, s_noise = np.array([3.0, 1.2, 0.4]), 0.8, 1.1
        x, key = 3.0 * unit_noise(3, jnp.float64), jax.random.key(9)
        out = sample(gaussian_denoiser, x, grid, "dpmpp_2m_sde", key, eta=eta, s_noise=s_noise)
        z = step_noise(key, 2, x.shape)
        x, lam = np.asarray(x), -np.log(grid)
        old, h_last = None, None
        for i in range(2):
            d = gaussian_denoiser(x, grid[i])
            h = lam[i + 1] - lam[i]
            x = grid[i + 1] / grid[i] * np.exp(-eta * h) * x + (1 - np.exp(-h - eta * h)) * d
            if old is not None:
                x = x + 0.5 * (1 - np.exp(-h - eta * h)) * (d - old) / (h_last / h)
            x = x + z[i] * grid[i + 1] * np.sqrt(1 - np.exp(-2 * eta * h)) * s_noise
            old, h_last = d, h
        np.testing.assert_allclose(np.asarray(out), x, rtol=0, atol=1e-12)


def test_noisy_samplers_at_eta_zero_are_their_deterministic_ones():
    with jax.enable_x64(True):
        grid = karras_sigmas(8)
        x, key = 80.0 * unit_noise(4, jnp.float64), jax.random.key(2)
        for noisy, plain in (("dpmpp_2m_sde", "dpmpp_2m"), ("euler_ancestral", "euler")):
            out = sample(gaussian_denoiser, x, grid, noisy, key, eta=0.0)
            np.testing.assert_allclose(
                np.asarray(out), np.asarray(sample(gaussian_denoiser, x, grid, plain)), rtol=0, atol=1e-12
            )


def test_last_step_to_zero_returns_the_denoised_sample():
    # Every method's step to σ = 0 lands on D(x; σ_last) (no noise, no second-order term).
    with jax.enable_x64(True):
        x = 0.5 * unit_noise(4, jnp.float64)
        grid = np.array([0.5, 0.0])
        for method in METHODS:
            out = sample(gaussian_denoiser, x, grid, method, key=jax.random.key(1))
            np.testing.assert_allclose(np.asarray(out), gaussian_denoiser(np.asarray(x), 0.5), atol=1e-12)


def test_ddim_eta0_on_a_vp_grid_equals_euler_in_float64():
    with jax.enable_x64(True):
        for spacing in ("leading", "trailing", "linspace"):
            grid = vp_sigmas(VPSchedule.cosine(), 25, spacing)
            x = grid[0] * unit_noise(8, jnp.float64)
            ddim = sample(gaussian_denoiser, x, grid, "ddim")
            euler = sample(gaussian_denoiser, x, grid, "euler")
            np.testing.assert_allclose(np.asarray(ddim), np.asarray(euler), rtol=0, atol=1e-10)


def test_ddpm_ddim_eta1_and_euler_ancestral_are_one_process():
    # Ho et al.'s posterior, Song et al.'s η = 1 and k-diffusion's ancestral step, written
    # independently, draw the same sample from the same noise.
    with jax.enable_x64(True):
        grid = vp_sigmas(VPSchedule.linear(), 20, "trailing")
        x = grid[0] * unit_noise(8, jnp.float64)
        key = jax.random.key(7)
        ddpm = sample(gaussian_denoiser, x, grid, "ddpm", key)
        ddim = sample(gaussian_denoiser, x, grid, "ddim", key, eta=1.0)
        anc = sample(gaussian_denoiser, x, grid, "euler_ancestral", key)
        np.testing.assert_allclose(np.asarray(ddpm), np.asarray(ddim), atol=1e-10)
        np.testing.assert_allclose(np.asarray(ddpm), np.asarray(anc), atol=1e-10)


@pytest.mark.usefixtures("optimised_compile")  # 20,000 samples through up to 1000 steps
@pytest.mark.parametrize(
    "method, options, grid",
    [
        ("ddpm", {}, vp_sigmas(VPSchedule.linear(), 1000, "leading")),
        ("euler_ancestral", {}, karras_sigmas(800)),
        ("dpmpp_2m_sde", {}, karras_sigmas(400)),
        ("heun", dict(s_churn=40.0, s_tmin=0.05, s_tmax=50.0), karras_sigmas(200)),
    ],
)
def test_stochastic_samplers_reproduce_the_data_distribution(method, options, grid):
    n = 20_000
    x = float(grid[0]) * unit_noise(n)
    out = np.asarray(sample(gaussian_denoiser, x, grid, method, jax.random.key(3), **options))
    std = np.sqrt(VAR)
    # Monte-Carlo standard errors of the mean and of the std, with a 4-sigma band.
    np.testing.assert_array_less(np.abs(out.mean(0) - MU), 4 * std / np.sqrt(n))
    np.testing.assert_array_less(np.abs(out.std(0) - std), 4 * std / np.sqrt(2 * n) + 0.005 * std)


def test_dtype_is_kept():
    grid = karras_sigmas(4)

    def out_dtype(x, method):
        # The traced program's output type: eval_shape traces `sample` as a call does, without a compile per method.
        return jax.eval_shape(lambda x: sample(gaussian_denoiser, x, grid, method, key=jax.random.key(0)), x).dtype

    x = 80.0 * unit_noise(2)
    for method in METHODS:
        assert out_dtype(x, method) == jnp.float32
    with jax.enable_x64(True):
        assert out_dtype(np.asarray(x, np.float64), "dpmpp_2m_sde") == jnp.float64


def test_sample_compiles_once_for_repeated_calls():
    class Scaled(eqx.Module):
        gain: jax.Array

        def __call__(self, x, sigma):
            return self.gain * gaussian_denoiser(x, sigma)

    traced = samplers_module._sample_traced
    before = eqx.debug.get_num_traces(traced)
    for seed in range(3):
        grid = karras_sigmas(10, sigma_max=80.0 - seed)  # new values, same shape
        out = sample(Scaled(jnp.array(1.0 + seed)), 80.0 * unit_noise(5, seed=seed), grid, "heun")
        out.block_until_ready()
    assert eqx.debug.get_num_traces(traced) - before == 1


def test_bad_arguments_raise_clear_errors():
    x = unit_noise(2)
    grid = karras_sigmas(3)
    with pytest.raises(ValueError, match="choose one of .*'euler'"):
        sample(gaussian_denoiser, x, grid, "rk45")
    with pytest.raises(ValueError, match="pass key="):
        sample(gaussian_denoiser, x, grid, "ddpm")
    with pytest.raises(ValueError, match="1-D grid"):
        sample(gaussian_denoiser, x, grid[:1], "euler")
    with pytest.raises(ValueError, match="eta applies"):
        sample(gaussian_denoiser, x, grid, "heun", eta=0.5)


def test_registry_is_the_one_list_of_methods(monkeypatch):
    assert tuple(METHODS) == tuple(samplers_module.SAMPLERS)
    # A new entry is a method by name: nothing else lists methods, METHODS included.
    monkeypatch.setitem(samplers_module.SAMPLERS, "euler_again", samplers_module.euler)
    assert "euler_again" in METHODS
    grid = karras_sigmas(5)
    x = 80.0 * unit_noise(2)
    again = sample(gaussian_denoiser, x, grid, "euler_again")
    np.testing.assert_array_equal(np.asarray(again), np.asarray(sample(gaussian_denoiser, x, grid, "euler")))


def test_sampler_registered_from_train_is_a_flag_choice(monkeypatch, tmp_path, capsys):
    """`SAMPLERS["midpoint"] = ...` in train/main.py (after its flag table is built) makes
    `--sample_method midpoint` and `train/sample.py --method midpoint` valid; before, both refuse."""
    import main as train_main
    import sample as train_sample

    def parse():
        cfg = train_main.parse_config(["--run_dir", str(tmp_path / "run"), "--sample_method", "midpoint"])
        args = train_sample.parse_args(["--run_dir", str(tmp_path / "run"), "--method", "midpoint"])
        return cfg.sample_method, args.method

    with pytest.raises(SystemExit) as refused:
        parse()
    assert refused.value.code == 2 and "invalid choice: 'midpoint'" in capsys.readouterr().err
    monkeypatch.setitem(samplers_module.SAMPLERS, "midpoint", samplers_module.heun)
    assert parse() == ("midpoint", "midpoint")


def test_a_users_step_function_is_a_sampler():
    def hand_written_euler(denoise, x, step):
        denoised = denoise(x, step.sigma)
        return x + (step.sigma_next - step.sigma) * ((x - denoised) / step.sigma), denoised

    grid = karras_sigmas(12)
    x = 80.0 * unit_noise(4)
    traced = samplers_module._sample_traced
    before = eqx.debug.get_num_traces(traced)
    mine = sample(gaussian_denoiser, x, grid, hand_written_euler)
    sample(gaussian_denoiser, 0.5 * x, grid, hand_written_euler)
    assert eqx.debug.get_num_traces(traced) - before == 1
    np.testing.assert_array_equal(np.asarray(mine), np.asarray(sample(gaussian_denoiser, x, grid, "euler")))


def test_a_users_options_come_from_its_signature():
    def partial_euler(denoise, x, step, *, fraction: float = 1.0):
        """Takes `fraction` of each Euler step: fraction = 0 leaves x where it is."""
        denoised = denoise(x, step.sigma)
        return x + fraction * (step.sigma_next - step.sigma) * (x - denoised) / step.sigma, denoised

    grid = karras_sigmas(6)
    x = 80.0 * unit_noise(3)
    np.testing.assert_array_equal(np.asarray(sample(gaussian_denoiser, x, grid, partial_euler, fraction=0.0)), x)
    full = sample(gaussian_denoiser, x, grid, partial_euler)  # the signature's default, 1
    np.testing.assert_allclose(np.asarray(full), np.asarray(sample(gaussian_denoiser, x, grid, "euler")), rtol=1e-6)
    message = r"eta applies to .*'ddim'.*not 'partial_euler', whose options are \('fraction',\)"
    with pytest.raises(ValueError, match=message):
        sample(gaussian_denoiser, x, grid, partial_euler, eta=1.0)


def test_unknown_options_name_what_the_method_takes():
    x = unit_noise(2)
    grid = karras_sigmas(3)
    with pytest.raises(
        ValueError, match=r"s_churn applies to \('heun',\), not 'ddim', whose options are \('eta', 'sigmas_to'\)"
    ):
        sample(gaussian_denoiser, x, grid, "ddim", s_churn=1.0)
    with pytest.raises(ValueError, match=r"not 'euler', whose options are none"):
        sample(gaussian_denoiser, x, grid, "euler", s_noise=1.0)
    with pytest.raises(ValueError, match="'heun', whose options are .*'s_churn', 's_tmin', 's_tmax', 's_noise'"):
        sample(gaussian_denoiser, x, grid, "heun", eta=0.5)
    with pytest.raises(ValueError, match="etaa applies to no built-in sampler"):
        sample(gaussian_denoiser, x, grid, "dpmpp_2m_sde", etaa=0.5)


def test_only_options_that_draw_noise_need_a_key():
    x = 80.0 * unit_noise(2)
    grid = karras_sigmas(4)
    drawing = [("ddpm", {}), ("ddim", dict(eta=0.5)), ("heun", dict(s_churn=10.0)), ("dpmpp_2m_sde", {})]
    drawing += [("euler_ancestral", {})]
    for method, options in drawing:
        with pytest.raises(ValueError, match=f"'{method}' is stochastic with these options: pass key="):
            sample(gaussian_denoiser, x, grid, method, **options)
    # Deterministic option sets run without a key, and a key given to them changes nothing.
    for method, options in [("ddim", {}), ("heun", dict(s_churn=0.0)), ("euler_ancestral", dict(eta=0.0))]:
        without = sample(gaussian_denoiser, x, grid, method, **options)
        with_key = sample(gaussian_denoiser, x, grid, method, jax.random.key(0), **options)
        np.testing.assert_array_equal(np.asarray(without), np.asarray(with_key))


def test_the_readme_names_every_method():
    """docs/core.md's Samplers paragraph (the front page's table sends a reader there) names each method."""
    core = (Path(__file__).parents[2] / "docs" / "core.md").read_text()
    samplers_paragraph = core[core.index("Samplers (") :]
    for method in METHODS:
        assert f"`{method}`" in samplers_paragraph, method
