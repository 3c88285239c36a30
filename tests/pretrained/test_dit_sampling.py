"""eqxdiff.pretrained.sample_dit against facebookresearch/DiT's own `diffusion/` package
(tools/make_dit_sampling_fixtures.py), on tests/data/dit/'s random-weight DiT: respacing keeps the official
timesteps; DDIM equals `ddim_sample_loop` without and with guidance (3 channels, all channels); every DDPM step's
mean and log-variance equal `p_mean_variance`'s; the DDPM loop replaying the official noise equals `p_sample_loop`."""

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.diffusion import samplers as samplers_module
from eqxdiff.diffusion import (
    ClassifierFreeGuidance,
    EpsilonPrediction,
    LearnedVarianceDenoiser,
    learned_range_posterior,
    sample,
    spaced_sigmas,
    spaced_timesteps,
)
from eqxdiff.pretrained import dit_schedule, load_dit, sample_dit
from eqxdiff.pretrained.dit_sampling import dit_denoiser

DATA = Path(__file__).parents[1] / "data"
with np.load(DATA / "dit_sampling" / "reference.npz") as _ref:
    REF = dict(_ref)
LABELS, NOISE = jnp.asarray(REF["labels"]), jnp.asarray(REF["noise"])


@pytest.fixture(scope="module")
def model():
    return load_dit(DATA / "dit" / "ema.safetensors", num_heads=2)


def relative_error(ours, official) -> float:
    return float(np.abs(np.asarray(ours) - official).max() / np.abs(official).max())


def test_respacing_keeps_the_official_timesteps():
    """`space_timesteps(1000, spec)` for step counts, section counts and "ddimN"; an int is its string."""
    official = json.loads((DATA / "dit_sampling" / "respacing.json").read_text())
    assert {"250", "25", "ddim50", "10,15,20"} <= set(official)
    for spec, kept in official.items():
        np.testing.assert_array_equal(spaced_timesteps(1000, spec), kept, err_msg=spec)
    np.testing.assert_array_equal(spaced_timesteps(1000, 25), official["25"])
    schedule = dit_schedule()
    sigmas = spaced_sigmas(schedule, "ddim50")
    np.testing.assert_array_equal(sigmas, np.append(schedule.sigmas[official["ddim50"][::-1]], 0.0))
    assert sigmas[0] == schedule.sigmas[980] and sigmas[-2] == schedule.sigmas[0]
    for bad, message in [
        ("ddim600", "no stride gives exactly 600"),
        ("1,1000", "section 1 has 500"),
        ("0", "between 1 and 1000"),
        ("ddimx", "ddimN"),
        ("ten", "step count"),
    ]:
        with pytest.raises(ValueError, match=message):
            spaced_timesteps(1000, bad)


def test_the_schedule_is_iddpms_linear_one():
    """get_named_beta_schedule("linear", T): β from 1e-4 to 0.02 at T = 1000, scaled by 1000/T."""
    for T in (1000, 4000):
        betas = np.linspace(0.1 / T, 20 / T, T)
        np.testing.assert_allclose(dit_schedule(T).alphas_cumprod, np.cumprod(1 - betas), rtol=1e-12)


def test_the_network_sees_the_kept_timesteps():
    """As `_WrappedModel` feeds them: the original index of each kept step (float32 σ's, exactly)."""
    schedule = dit_schedule()
    sigmas = jnp.asarray(spaced_sigmas(schedule, "25")[:-1], jnp.float32)

    def time_as_v(x, t, cond):
        return jnp.concatenate([x, jnp.broadcast_to(t[:, None, None, None], x.shape)], -1)

    out = LearnedVarianceDenoiser(time_as_v, schedule, EpsilonPrediction())(jnp.ones((25, 2, 2, 1)), sigmas)
    np.testing.assert_array_equal(np.asarray(out[:, 0, 0, 1]), spaced_timesteps(1000, "25")[::-1])


@pytest.mark.parametrize(
    "steps, cfg_scale, cfg_channels",
    [("ddim10", 1.0, 3), ("ddim10", 1.5, 3), ("ddim10", 4.0, 3), ("ddim10", 4.0, None), ("10", 4.0, 3)],
)
def test_ddim_equals_the_official_loop(model, steps, cfg_scale, cfg_channels):
    """ddim_sample_loop (eta 0) from the same x_T; guidance on DiT's 3 channels, and on all 4 (None)."""
    name = f"ddim_{steps}_cfg{cfg_scale}" + ("_all" if cfg_channels is None else "")
    out = sample_dit(model, LABELS, NOISE, steps=steps, method="ddim", guidance=cfg_scale, guided_channels=cfg_channels)
    assert relative_error(out, REF[name]) <= 1e-3  # measured ≤ 7e-5


@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_each_ddpm_step_is_p_mean_variance(model, cfg_scale):
    """The step's mean and learned log-variance at respaced steps of "25": the first (t = 24), the second, a
    middle one, the second-to-last and the last (t = 0, where iDDPM clips β̃ to the step before's)."""
    sigmas = spaced_sigmas(dit_schedule(), "25")
    denoise = dit_denoiser(model, LABELS, cfg_scale)
    n, c = len(sigmas) - 1, NOISE.shape[-1]

    @eqx.filter_jit  # one program for the five steps (σ's traced), not the DiT's forward op by op
    def posterior(denoise, x, sigma_prev, sigma, sigma_next):
        out = denoise(x, sigma)
        return learned_range_posterior(x, out[..., :c], out[..., c:], sigma_prev, sigma, sigma_next)

    for i, x_t, mean_t, log_variance_t in zip(
        REF["pmv_t"], REF["pmv_x"], REF[f"pmv_mean_cfg{cfg_scale}"], REF[f"pmv_log_variance_cfg{cfg_scale}"]
    ):
        k = n - 1 - i  # respaced step i is the k-th of the scan
        sigma_prev, sigma, sigma_next = (jnp.float32(sigmas[j]) for j in (max(k - 1, 0), k, k + 1))
        x = jnp.asarray(x_t) * jnp.sqrt(1 + sigma**2)
        mean, log_variance = posterior(denoise, x, sigma_prev, sigma, sigma_next)
        assert relative_error(mean / jnp.sqrt(1 + sigma_next**2), mean_t) <= 1e-4, i  # measured ≤ 5e-5
        assert relative_error(log_variance, log_variance_t) <= 1e-4, i  # measured ≤ 3e-6


def test_the_ddpm_loop_replaying_the_official_noise_is_p_sample_loop(model):
    """p_sample_loop at "25" steps and cfg 4 (sample.py's protocol but the step count), the unit noise of
    every step the one the official loop drew; a fresh key's noise gives another sample."""
    noises = jnp.asarray(REF["ddpm_25_noises"])
    out = sample_dit(model, LABELS, NOISE, steps=25, method="ddpm", guidance=4.0, noises=noises)
    official = REF["ddpm_25_cfg4.0"]
    assert relative_error(out, official) <= 1e-3  # measured 4e-5
    drawn = sample_dit(model, LABELS, NOISE, steps=25, method="ddpm", guidance=4.0, key=jax.random.key(0))
    assert relative_error(drawn, official) > 0.05


def test_without_a_learned_variance_the_step_is_ddpm():
    """v = -1 (a denoiser of c channels) is the posterior variance β̃: Ho et al.'s step (`ddpm`), same key."""
    with jax.enable_x64(True):
        x = 3.0 * jax.random.normal(jax.random.key(1), (3, 4, 4, 2), jnp.float64)
        denoise = lambda x, sigma: 0.3 * x / (1 + sigma**2)  # noqa: E731
        grid = spaced_sigmas(dit_schedule(), "ddim5")
        ours = sample(denoise, x, grid, "ddpm_learned_variance", jax.random.key(2))
        theirs = sample(denoise, x, grid, "ddpm", jax.random.key(2))
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-10, atol=1e-12)


def test_bad_arguments_name_the_fix(model):
    with pytest.raises(ValueError, match="DiT's protocol has"):
        sample_dit(model, LABELS, NOISE, steps=10, method="heun")
    with pytest.raises(ValueError, match="pass key="):
        sample_dit(model, LABELS, NOISE, steps=10)
    with pytest.raises(ValueError, match="guided_channels=5"):
        sample_dit(model, LABELS, NOISE, steps=10, method="ddim", guided_channels=5)
    with pytest.raises(ValueError, match=r"noise must be \[b, 8, 8, 4\]"):
        sample_dit(model, LABELS, NOISE[:, :4], steps=10, method="ddim")
    with pytest.raises(ValueError, match="noises .* per step"):
        sample_dit(model, LABELS, NOISE, steps=10, noises=jnp.zeros((9, *NOISE.shape)))


def test_sampling_compiles_once_per_shape_and_protocol(model):
    """New noise, labels and key: the same program (one scan in one jit, DESIGN.md rule 3)."""
    before = eqx.debug.get_num_traces(samplers_module._sample_traced)
    for seed in range(3):
        noise = jax.random.normal(jax.random.key(seed), NOISE.shape)
        labels = LABELS.at[0].set(seed)
        sample_dit(model, labels, noise, steps="ddim5", method="ddpm", guidance=1.5, key=jax.random.key(seed))
    assert eqx.debug.get_num_traces(samplers_module._sample_traced) - before == 1


def test_guidance_on_the_first_channels_takes_the_rest_from_the_conditional_half():
    """ClassifierFreeGuidance(channels=k): D_u + w·(D_c - D_u) on channels < k, D_c on the others."""

    def label_denoiser(x, sigma, labels):
        return x + labels.astype(x.dtype)[:, None, None, None] * jnp.arange(1.0, 6.0)

    x = jnp.zeros((2, 1, 1, 5))
    out = ClassifierFreeGuidance(label_denoiser, jnp.array([1, 2]), 3.0, jnp.array([0]), channels=2)(x, jnp.array(1.0))
    cond = np.array([1, 2])[:, None] * np.arange(1.0, 6.0)
    np.testing.assert_allclose(np.asarray(out[:, 0, 0]), np.concatenate([3 * cond[:, :2], cond[:, 2:]], axis=1))
