"""eqxdiff.pretrained.sample_sit against willisma/SiT's own `transport/` sampling code
(tools/make_sit_sampling_fixtures.py): the tiny random-weight SiT of tests/data/sit, the same noise, labels
and, for the SDE, the same normals the official loop drew; with cfg, SiT's doubled batch and
forward_with_cfg. Fixed-step methods equal the official trajectory to float32 rounding; dopri5 equals
it to float64 rounding in float64, and in float32 stays within the official code's own rounding spread."""

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.diffusion import samplers
from eqxdiff.diffusion.samplers import Step, sample
from eqxdiff.pretrained import load_sit, sample_sit, sit_denoiser
from eqxdiff.pretrained.sit_sampling import SDE_SAMPLERS, SiTVelocity, first_step, sit_sigmas, sit_time_grid

DATA = Path(__file__).parents[1] / "data"
CASES = json.loads((DATA / "sit_sampling" / "cases.json").read_text())
with np.load(DATA / "sit_sampling" / "reference.npz") as f:
    REF = dict(f)
Z, Y = jnp.asarray(REF["z"]), jnp.asarray(REF["y"])
B = Z.shape[0]


@pytest.fixture(scope="module")
def model():
    return load_sit(DATA / "sit" / "ema.safetensors", num_heads=2)


def relative_error(ours, official) -> float:
    return float(np.abs(np.asarray(ours) - official).max() / np.abs(official).max())


def settings(name: str) -> dict:
    """sample_sit's keywords for a fixture case (SiT's CLI names lower-cased)."""
    case = CASES[name]
    kw = dict(method=case["mode"].lower(), sampler=case["sampling_method"].lower(), guidance=case["cfg_scale"])
    if kw["sampler"] == "dopri5":
        return kw | dict(atol=case["atol"], rtol=case["rtol"])
    kw["steps"] = case["num_steps"]
    if kw["method"] == "sde":
        kw |= {k: case[k] for k in ("diffusion_form", "diffusion_norm", "last_step", "last_step_size")}
        kw["brownian"] = REF[f"{name}/w"]
    return kw


@pytest.mark.parametrize("name", ["ode_heun", "ode_heun_cfg", "ode_euler"])
def test_fixed_step_ode_equals_official(model, name):
    """torchdiffeq's heun2 / euler on SiT's grid linspace(0, 1, 11): 10 steps; cfg 4 on SiT's doubled batch."""
    assert relative_error(sample_sit(model, Y, Z, **settings(name)), REF[f"{name}/x"][-1][:B]) <= 1e-5  # 9e-7


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("sde")])
def test_sde_equals_official(model, name):
    """SiT's sample_sde given the normals it drew: Euler–Maruyama or Heun, forms sigma/linear/decreasing,
    last steps Mean/Tweedie/Euler/None, with and without cfg."""
    assert relative_error(sample_sit(model, Y, Z, **settings(name)), REF[f"{name}/x"][-1][:B]) <= 1e-5  # 8e-7


# One case per SDE sampler (Euler–Maruyama with cfg, Heun with the decreasing form): every case's whole trajectory
# equals the official one above, which no wrong step passes; step by step is where to look when one fails.
@pytest.mark.parametrize("name", ["sde_euler_mean_cfg", "sde_heun_decreasing"])
def test_sde_step_by_step(model, name):
    """Each step from the official state before it, with the normal it drew, gives the official state after
    it — the last step (SiT's Mean from τ = 1 - last_step_size to 1) included."""
    kw = settings(name)
    xs = REF[f"{name}/x"]
    if kw["last_step"] is None:  # sample_sde still appends its "last step", the identity
        np.testing.assert_array_equal(xs[-1], xs[-2])
        xs = xs[:-1]
    start = np.concatenate([REF["z"]] * (xs.shape[1] // B))  # SiT's doubled batch with cfg
    before = jnp.asarray(np.concatenate([start[None], xs[:-1]]))
    sigmas = jnp.asarray(sit_sigmas(sit_time_grid(kw["steps"], "sde", kw["last_step"], kw["last_step_size"])))
    n = sigmas.shape[0] - 1
    assert n == xs.shape[0]
    velocity = SiTVelocity(model, Y, kw["guidance"])
    options = {k: kw[k] for k in ("diffusion_form", "diffusion_norm", "last_step")}
    options["brownian"] = jnp.asarray(kw["brownian"])

    @eqx.filter_jit
    def one(x, sigma, sigma_next, index):
        step = Step(sigma, sigma, sigma_next, index, x, None, num_steps=n, method=name)
        return SDE_SAMPLERS[kw["sampler"]](velocity, x, step, **options)[0]

    after = np.asarray(jax.vmap(one)(before, sigmas[:-1], sigmas[1:], jnp.arange(n)))
    errors = np.abs(after - xs).max(axis=(1, 2, 3, 4)) / np.abs(xs).max()
    assert errors.max() <= 1e-5, errors  # 4e-7


def test_dopri5_float64_equals_official(model):
    """In float64 (the official run too) the error estimates are exact enough that both solvers take the same
    steps: torchdiffeq's first step (Hairer's rule), its controller, its overshoot past τ = 1 and interpolation.
    Compiled as the scripts compile (not the tests' -O0, conftest.py): at -O0 on an AVX-512 CPU one step of the
    guided run sits at its controller's threshold and is taken the other way (2.5e-4 from the official result)."""
    optimised = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        with jax.enable_x64(True):
            model64 = load_sit(DATA / "sit" / "ema.safetensors", num_heads=2, dtype=np.float64)
            for name in ("ode_dopri5_f64", "ode_dopri5_cfg_f64"):
                ours = sample_sit(model64, Y, jnp.asarray(REF["z"], jnp.float64), **settings(name))
                assert ours.dtype == jnp.float64
                assert relative_error(ours, REF[f"{name}/x"][-1][:B]) <= 1e-6  # 2e-7, 2e-7
    finally:
        jax.config.update("jax_disable_most_optimizations", optimised)


def test_dopri5_float32_within_the_official_codes_own_rounding(model):
    """In float32 the error estimate (a difference of nearly equal stages) is at rounding level on the first
    steps, so step sizes follow rounding: the official float32 result is 2.6e-3 from its own float64 one
    (cfg). Ours stays within that spread, and its first step is torchdiffeq's (its 8th network call)."""
    for name in ("ode_dopri5", "ode_dopri5_cfg"):
        official, official64 = REF[f"{name}/x"][-1], REF[f"{name}_f64/x"][-1]
        spread = relative_error(official, official64)
        ours = sample_sit(model, Y, Z, **settings(name))
        assert relative_error(ours, official[:B]) <= max(1e-3, 1.5 * spread), (name, spread)  # 2e-4, 1.2e-3
        velocity = SiTVelocity(model, Y, CASES[name]["cfg_scale"])
        x = jnp.concatenate([Z] * (official.shape[0] // B))
        h = eqx.filter_jit(first_step)(velocity, x, CASES[name]["rtol"], CASES[name]["atol"])
        assert float(h) == pytest.approx(REF[f"{name}/t_calls"][7], rel=1e-5)


def test_cfg_is_forward_with_cfg(model):
    """Guided channels :3 are uncond + s·(cond - uncond) in both halves; channel 3 stays the network's
    own (conditional in the first half, unconditional in the second), all from the first half's x."""
    call = eqx.filter_jit(lambda f, *args: f(*args))  # a program per network, not op by op
    x = jax.random.normal(jax.random.key(0), (2 * B,) + Z.shape[1:])
    tau = jnp.asarray(0.3)
    v = np.asarray(call(SiTVelocity(model, Y, 4.0), x, tau))  # compared in numpy: no eager op compiled
    t = jnp.full((B,), tau)
    cond = np.asarray(call(model, x[:B], t, Y))[..., :4]
    uncond = np.asarray(call(model, x[:B], t, model.null_cond(B)))[..., :4]
    guided = uncond + 4.0 * (cond - uncond)
    np.testing.assert_allclose(v[:B, ..., :3], guided[..., :3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v[B:, ..., :3], guided[..., :3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v[:B, ..., 3], cond[..., 3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v[B:, ..., 3], uncond[..., 3], rtol=1e-5, atol=1e-5)
    every = np.asarray(call(SiTVelocity(model, Y, 4.0, guided_channels=None), x, tau))
    np.testing.assert_allclose(every[:B], guided, rtol=1e-5, atol=1e-5)
    official = REF["ode_heun_cfg/x"][-1][:B]
    all_channels = sample_sit(model, Y, Z, **settings("ode_heun_cfg") | dict(guided_channels=None))
    assert relative_error(all_channels, official) > 1e-2


def test_sit_denoiser_runs_eqxdiffs_sigma_space_samplers(model):
    """SiT's x_τ is eqxdiff's flow at σ = (1-τ)/τ with x̃ = x_τ/τ: from the official Euler state at τ = 0.1,
    eqxdiff's own "euler" (DDIM) down the σ grid of SiT's remaining τ grid lands on the official result;
    EDM's "heun" there is another method than torchdiffeq's heun2 (it averages ε̂, not v), 1% away."""
    denoise = lambda x, sigma: sit_denoiser(model)(x, sigma, Y)  # noqa: E731
    taus = np.linspace(0.0, 1.0, 11)[1:]
    for method, name, close in (("euler", "ode_euler", True), ("heun", "ode_heun", False)):
        xs = REF[f"{name}/x"]
        ours = sample(denoise, jnp.asarray(xs[1]) / taus[0], sit_sigmas(taus), method=method)
        assert (relative_error(ours, xs[-1]) <= 1e-5) == close  # 3e-7; heun 1.1e-2


def test_sde_key_draws_what_brownian_replays(model):
    """With `key` each SDE step draws its normal from its own split of the key (eqxdiff's `sample`); passing
    those normals as `brownian` gives the same sample, and another key another one, without a new compile."""
    kw = dict(method="sde", steps=6, guidance=1.5)
    key = jax.random.key(3)
    drawn = sample_sit(model, Y, Z, key=key, **kw)
    keys = jax.random.split(key, 6)  # 5 SDE steps and the last step
    normals = jnp.stack([jax.random.normal(k, (2 * B,) + Z.shape[1:]) for k in keys[:5]])
    np.testing.assert_allclose(sample_sit(model, Y, Z, brownian=normals, **kw), drawn, rtol=1e-6, atol=1e-6)
    traces = eqx.debug.get_num_traces(samplers._sample_traced)
    assert relative_error(sample_sit(model, Y, Z, key=jax.random.key(4), **kw), np.asarray(drawn)) > 1e-2
    assert eqx.debug.get_num_traces(samplers._sample_traced) == traces


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(method="flow"), "'ode' or 'sde'"),
        (dict(method="ode", sampler="dpmpp"), "choose one of"),
        (dict(method="ode", sampler="heun"), "steps >= 2"),
        (dict(method="sde", steps=5), "pass key"),
        (dict(method="sde", steps=5, brownian=np.zeros((5, 2, 8, 8, 4), np.float32)), r"brownian must be \(4, 2"),
        (dict(method="sde", steps=5, sampler="heun", last_step=None, key=jax.random.key(0)), "divides by 0"),
        (dict(method="sde", steps=5, diffusion_form="constant", key=jax.random.key(0)), "Linear path runs"),
        (dict(method="sde", steps=5, last_step="Median", key=jax.random.key(0)), "SiT's are"),
        (dict(method="sde", steps=5, last_step_size=0.0, key=jax.random.key(0)), "from 1 - last_step_size to 1"),
        (dict(guidance=0.5), "cfg_scale >= 1"),
    ],
)
def test_errors_name_the_fix(model, kw, match):
    with pytest.raises(ValueError, match=match):
        sample_sit(model, Y, Z, **kw)
