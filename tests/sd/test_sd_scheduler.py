"""`scheduler_from_diffusers`: diffusers' scheduler configs in eqxdiff's σ-space give the latents diffusers' own
scheduler loops give for the same model outputs (tests/data/sd_scheduler/, tools/make_sd_scheduler_fixtures.py)."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.diffusion import Denoiser, VPSchedule
from eqxdiff.sd.scheduler import scheduler_from_diffusers

DATA = Path(__file__).parents[1] / "data" / "sd_scheduler"
CASES = json.loads((DATA / "cases.json").read_text())
with np.load(DATA / "reference.npz") as _ref:
    REF = dict(_ref)

# Zero terminal SNR's Euler starts at σ ≈ 4096: its first step x + (σ_next - σ)·slope cancels 4096-sized terms, so
# one float32 ulp of that slope moves the final latents by 2.1e-5 relative (measured by nudging it in a numpy replay
# of diffusers' step): float32 bounds any two implementations' agreement there, diffusers' own op order included.
TOLERANCE = {"zsnr_euler": 1e-4}


def stand_in(x, t, cond):
    """The fixture's closed-form model, F(x_in, t) = 0.8·tanh(x_in)·cos(t/250) + 0.05·(t/1000)·x_in."""
    t = t.reshape(t.shape + (1,) * (x.ndim - 1)).astype(jnp.float32)
    return 0.8 * jnp.tanh(x) * jnp.cos(t / 250) + 0.05 * (t / 1000) * x


def latents(name: str, scheduler=None) -> np.ndarray:
    case = CASES[name]
    scheduler = scheduler or scheduler_from_diffusers(case["config"])
    denoise = Denoiser(stand_in, scheduler.schedule, scheduler.parameterization)
    noises = {"noises": jnp.asarray(REF[f"{name}_noises"])} if f"{name}_noises" in REF else {}
    return np.asarray(scheduler.sample(denoise, jnp.asarray(REF[f"{name}_noise"]), case["steps"], **noises))


def relative(ours, theirs) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.parametrize("name", sorted(CASES))
def test_latents_equal_diffusers(name):
    assert relative(latents(name), REF[f"{name}_latents"]) <= TOLERANCE.get(name, 1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_grid_and_network_times_equal_diffusers(name):
    """The σ grid diffusers steps on, and the t its loop feeds the model: what `Denoiser` computes from σ
    (schedule.sigma_to_t in float32), exact for integer t, to float32 ulps for Euler's fractional ones."""
    case = CASES[name]
    scheduler = scheduler_from_diffusers(case["config"])
    sigmas, theirs = scheduler.sigmas(case["steps"]), REF[f"{name}_sigmas"]
    finite = np.isfinite(theirs)  # DDIM's zero-SNR σ_T = ∞ is eqxdiff's 2**20
    np.testing.assert_allclose(sigmas[finite], theirs[finite], rtol=1e-6)
    t = np.asarray(scheduler.schedule.sigma_to_t(jnp.asarray(sigmas[:-1], jnp.float32)))
    ulp = np.spacing(np.abs(REF[f"{name}_t"]) + np.float32(1))
    assert np.all(np.abs(t - REF[f"{name}_t"]) <= 4 * ulp)  # measured: 2 ulps (Euler's Karras t at 24.7), else ≤ 1
    if float(np.abs(REF[f"{name}_t"] - REF[f"{name}_t"].round()).max()) == 0:
        np.testing.assert_array_equal(t, REF[f"{name}_t"])
    a, ours = REF[f"{name}_alphas_cumprod"].astype(np.float64), np.asarray(scheduler.schedule.alphas_cumprod)
    if case["config"].get("rescale_betas_zero_snr"):  # the rescale's float32 rounding near ᾱ = 0; ᾱ_T = 2**-24
        np.testing.assert_allclose(ours[:-1], a[:-1], rtol=5e-6)
    else:  # torch's float32 linspace and cumprod reproduced bit for bit
        np.testing.assert_array_equal(ours, a)


def test_sd15_folder_config_maps_as_ddim_from_config(tmp_path):
    """SD 1.5's scheduler_config.json names PNDMScheduler: read from a pipeline folder, it samples as
    `DDIMScheduler.from_config(it)` does (PNDM's PLMS steps are not ported)."""
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(CASES["sd15_ddim"]["folder_config"]))
    scheduler = scheduler_from_diffusers(tmp_path)
    assert (scheduler.class_name, scheduler.method, scheduler.steps_offset) == ("PNDMScheduler", "ddim", 1)
    assert relative(latents("sd15_ddim", scheduler), REF["sd15_ddim_latents"]) <= 1e-5


def test_mapping_reads_spacing_offset_and_prediction():
    """The keys the parity cases exercise, read as diffusers reads them (class defaults where absent)."""
    sd15 = CASES["sd15_ddim"]["folder_config"]
    assert scheduler_from_diffusers(dict(sd15, _class_name="EulerDiscreteScheduler")).spacing == "linspace"
    assert scheduler_from_diffusers(sd15).spacing == "leading"
    np.testing.assert_array_equal(scheduler_from_diffusers(sd15).timesteps(20)[[0, -1]], [951, 1])
    v = scheduler_from_diffusers(CASES["sd21_ddim_v"]["config"])
    assert type(v.parameterization).__name__ == "VPrediction"
    zsnr = scheduler_from_diffusers(CASES["zsnr_euler"]["config"])
    assert zsnr.schedule.alphas_cumprod[-1] == 2.0**-24 and zsnr.sigmas(10)[0] == pytest.approx(4096, rel=1e-6)


@pytest.mark.parametrize(
    "change, key",
    [
        (dict(beta_schedule="sqrt"), "beta_schedule"),
        (dict(prediction_type="flow_prediction"), "prediction_type"),
        (dict(timestep_spacing="uniform"), "timestep_spacing"),
        (dict(_class_name="LMSDiscreteScheduler"), "_class_name"),
        (dict(_class_name="DDIMScheduler", clip_sample=True), "clip_sample"),
        (dict(thresholding=True), "thresholding"),
        (dict(_class_name="DPMSolverMultistepScheduler", solver_order=3), "solver_order"),
        (dict(_class_name="DPMSolverMultistepScheduler", algorithm_type="sde-dpmsolver++"), "algorithm_type"),
        (dict(_class_name="EulerDiscreteScheduler", interpolation_type="log_linear"), "interpolation_type"),
        (dict(_class_name="EulerDiscreteScheduler", use_exponential_sigmas=True), "use_exponential_sigmas"),
        (dict(_class_name="DDIMScheduler", use_karras_sigmas=True), "use_karras_sigmas"),
        (dict(final_sigmas_type="sigma_min"), "final_sigmas_type"),
    ],
)
def test_unsupported_values_are_refused_naming_the_key(change, key):
    with pytest.raises(ValueError, match=f"scheduler config {key}="):
        scheduler_from_diffusers(dict(CASES["sd15_ddim"]["folder_config"], **change))


def test_ddim_without_class_clip_sample_key_is_refused():
    """DDIMScheduler's own default clips x0: a config without the key is refused, not silently unclipped."""
    config = {k: v for k, v in CASES["sd15_ddim"]["config"].items() if k != "clip_sample"}
    with pytest.raises(ValueError, match="clip_sample=True"):
        scheduler_from_diffusers(config)


def test_missing_folder_names_the_layout(tmp_path):
    with pytest.raises(FileNotFoundError, match="scheduler/scheduler_config.json"):
        scheduler_from_diffusers(tmp_path)


def test_linear_interpolation_inverts_diffusers_sigma_of_t():
    """interpolation="linear": σ(t) = np.interp(t, range(T), σ) (diffusers' Euler) and sigma_to_t invert each other
    at fractional t, where the log-σ interpolation does not."""
    alpha_bar = np.cumprod(1 - np.linspace(1e-4, 0.02, 1000))
    t = jnp.asarray([998.5, 500.25, 10.75, 0.5], jnp.float32)
    linear = VPSchedule(alpha_bar, interpolation="linear")
    sigma = np.interp(np.asarray(t, np.float64), np.arange(1000), linear.sigmas)
    np.testing.assert_allclose(linear.sigma_to_t(jnp.asarray(sigma, jnp.float32)), t, atol=2e-4)
    np.testing.assert_allclose(linear.t_to_sigma(t), sigma, rtol=1e-6)
    assert np.abs(np.asarray(VPSchedule(alpha_bar).sigma_to_t(jnp.asarray(sigma, jnp.float32))) - t).max() > 1e-3
    with pytest.raises(ValueError, match="interpolation"):
        VPSchedule(alpha_bar, interpolation="cubic")


def test_euler_ancestral_noises_replace_the_key():
    """euler_ancestral(noises=...) draws nothing: it needs no key and equals the key's draws when given them."""
    from eqxdiff.diffusion import sample

    sigmas = np.array([3.0, 1.0, 0.3, 0.0])
    x, key = jnp.ones((2, 4)), jax.random.key(0)
    keys = jax.random.split(key, 3)
    drawn = jnp.stack([jax.random.normal(k, x.shape) for k in keys])
    denoise = lambda x, s: 0.5 * x  # noqa: E731
    np.testing.assert_allclose(
        sample(denoise, x, sigmas, "euler_ancestral", noises=drawn),
        sample(denoise, x, sigmas, "euler_ancestral", key),
        rtol=1e-6,
    )


def test_trained_betas_give_the_schedule_of_those_betas():
    """`trained_betas` (a list in the json) replaces beta_schedule: SD's β's (from diffusers' ᾱ) given as a list give
    SD's ᾱ to float32 rounding; halving them gives another."""
    sd15 = CASES["sd15_ddim"]["config"]
    alpha_bar = np.asarray(scheduler_from_diffusers(sd15).schedule.alphas_cumprod)
    reference = REF["sd15_ddim_alphas_cumprod"].astype(np.float64)
    betas = (1 - reference / np.concatenate([[1.0], reference[:-1]])).astype(np.float32).tolist()
    given = scheduler_from_diffusers(dict(sd15, beta_schedule="unused", trained_betas=betas))
    np.testing.assert_allclose(given.schedule.alphas_cumprod, alpha_bar, rtol=1e-6)
    halved = scheduler_from_diffusers(dict(sd15, trained_betas=[b / 2 for b in betas]))
    assert halved.schedule.alphas_cumprod[-1] > 2 * alpha_bar[-1]
