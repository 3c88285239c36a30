"""MeanFlow (Geng et al. 2025): train/main.py's loss equals the official code's in value and gradient (fixtures
from Gsunshine/meanflow, tools/make_meanflow_fixtures.py), its draws are the official ones in law, the networks of
two times keep a network of one time as it was, and the MeanFlow sampler is exact where u is known in closed form."""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import main as train_main  # train/main.py
from eqxdiff import xla_cpu
from eqxdiff.diffusion import draw_condition_drop, draw_times, meanflow_prediction
from eqxdiff.diffusion.meanflow import TIME_SCALE

FIXTURE = Path(__file__).parents[1] / "data" / "meanflow" / "official_loss.npz"


@pytest.fixture(autouse=True)
def forward_mode():
    """The workarounds train/main.py leaves off for MeanFlow (custom_vjp has no jvp), off here too."""
    with xla_cpu.only(xla_cpu.switched_on() - xla_cpu.NO_FORWARD_MODE):
        yield


class TinyNet(eqx.Module):
    """tools/make_meanflow_fixtures.py's `tiny_u` as an eqxdiff model of two times: it sees FlowSchedule's times
    1000·t and 1000·(t − r) and embeds t and t − r as the official network sees them."""

    p: dict
    num_classes: int = eqx.field(static=True)

    def __call__(self, x, t, cond, *, key=None, interval=None):
        p, b = self.p, x.shape[0]
        t, h = t / TIME_SCALE, interval / TIME_SCALE
        feats = lambda s: jnp.concatenate([jnp.sin(s[:, None] * p["freq"]), jnp.cos(s[:, None] * p["freq"])], -1)  # noqa
        hid = jnp.tanh(x.reshape(b, -1) @ p["w_z"] + feats(t) @ p["w_t"] + feats(h) @ p["w_h"] + p["embed"][cond])
        return (hid @ p["w_out"] + p["b_out"]).reshape(x.shape)

    def null_cond(self, b):
        return jnp.full((b,), self.num_classes, jnp.int32)


@pytest.mark.parametrize("case", ["guided", "kappa0"])
def test_loss_and_gradient_equal_the_official_code(case):
    data = np.load(FIXTURE)
    params = {k.removeprefix("param_"): jnp.asarray(data[k]) for k in data if k.startswith("param_")}
    model = TinyNet(params, num_classes=int(params["embed"].shape[0]) - 1)
    omega, kappa, t_start, t_end, norm_p, norm_eps = data[f"{case}_hparams"].tolist()
    b = data["x"].shape[0]
    batch = dict(
        x0=jnp.asarray(data["x"]),
        cond=jnp.asarray(data["labels"]),
        null_cond=model.null_cond(b),
        drop=jnp.asarray(data[f"{case}_drop"]),
        t=jnp.asarray(data[f"{case}_t"]),
        r=jnp.asarray(data[f"{case}_r"]),
        noise=jnp.asarray(data[f"{case}_noise"]),
    )

    @eqx.filter_jit
    def loss_and_grad(model):
        def loss(model):
            return train_main.meanflow_loss_fn(
                model, batch, None, omega=omega, kappa=kappa, norm_p=norm_p, norm_eps=norm_eps, t_range=(t_start, t_end)
            )

        return eqx.filter_value_and_grad(loss)(model)

    loss, grads = loss_and_grad(model)
    np.testing.assert_allclose(loss, data[f"{case}_loss"], rtol=2e-6)
    for name, g in grads.p.items():
        want = data[f"{case}_grad_{name}"]
        assert np.abs(want).max() > 1e-4, name  # every weight matters, so a wrong path shows
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=name)
    # u itself, through the official monitor ‖u - v‖² per example
    u, _ = eqx.filter_jit(meanflow_prediction)(
        model, batch["x0"], batch["noise"], batch["t"], batch["r"], batch["cond"], batch["null_cond"], batch["drop"]
    )
    v = batch["noise"] - batch["x0"]
    np.testing.assert_allclose(jnp.sum((u - v) ** 2, axis=(1, 2, 3)), data[f"{case}_v_loss"], rtol=1e-5)


def test_draws_follow_the_official_law():
    """t, r: the larger and smaller of two logit-normals, logit ~ N(-0.4, 1) (E max = μ + σ/√π, E min = μ - σ/√π,
    var = σ²(1 - 1/π)); r = t on exactly the first 75% of the batch; dropped examples a prefix of Binomial(b, p)."""
    b = 200_000
    t, r = jax.jit(lambda key: draw_times(key, b, p_mean=-0.4, p_std=1.0, r_neq_t=0.25))(jax.random.key(0))
    t, r = np.asarray(t, np.float64), np.asarray(r, np.float64)
    same = int(b * 0.75)
    np.testing.assert_array_equal(r[:same], t[:same])
    assert np.all(r[same:] < t[same:])
    logit = lambda p: np.log(p / (1 - p))  # noqa: E731
    for values, sign in ((logit(t), 1), (logit(r[same:]), -1)):
        assert abs(values.mean() - (-0.4 + sign / np.sqrt(np.pi))) < 0.02, values.mean()
        assert abs(values.std() - np.sqrt(1 - 1 / np.pi)) < 0.02, values.std()
    drop = np.asarray(jax.jit(lambda key: draw_condition_drop(key, b, 0.1))(jax.random.key(1)))
    count = int(drop.sum())
    np.testing.assert_array_equal(drop, np.arange(b) < count)
    assert abs(count / b - 0.1) < 0.005


def perturbed(model, scale=0.05):
    """Every parameter moved off its (partly zero) init, so every layer reaches the output; numpy draws."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    rng = np.random.default_rng(1)
    params = jax.tree.map(
        lambda a: jax.device_put(np.asarray(a) + scale * rng.normal(size=a.shape).astype(a.dtype)), params
    )
    return eqx.combine(params, static)


def tiny_unet(**kw):
    from eqxdiff.nn import UNet

    return UNet(1, (8,), 1, num_classes=3, norm_groups=4, emb_features=16, key=jax.random.key(0), **kw)


def tiny_dit(**kw):
    from eqxdiff.nn import DiT

    return DiT(4, 2, 1, 16, 1, 2, num_classes=3, key=jax.random.key(0), **kw)


def tiny_edm2(**kw):
    from eqxdiff.nn import EDM2UNet

    return EDM2UNet(1, 4, num_classes=3, model_channels=8, channel_mult=(1,), num_blocks=1, key=jax.random.key(0), **kw)


def without_time_embed_interval(two):
    """A UNet's or DiT's network of two times with its time embedding of t alone."""
    return eqx.tree_at(lambda m: m.time_embed, two, two.time_embed.time)


def without_edm2_interval(two):
    """An EDM2UNet of two times with neither of its interval's layers."""
    return eqx.tree_at(lambda m: (m.emb_interval_fourier, m.emb_interval), two, (None, None))


call = eqx.filter_jit(lambda model, x, t, cond, **kw: model(x, t, cond, **kw))


@pytest.mark.parametrize(
    "make, without_interval",
    [
        (tiny_unet, without_time_embed_interval),
        (tiny_dit, without_time_embed_interval),
        (tiny_edm2, without_edm2_interval),
    ],
    ids=["unet", "dit", "edm2"],
)
def test_a_network_of_one_time_is_the_two_time_one_without_its_interval_embedding(make, without_interval):
    one, two = make(), make(interval_embedding=True)
    # Same leaves, same values: the option draws its own key, and a network of one time has only the leaves it had.
    without = without_interval(two)
    assert jax.tree.structure(without) == jax.tree.structure(one)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(without), strict=True):
        np.testing.assert_array_equal(a, b)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, 4, 1)), jnp.float32)
    t, labels = jnp.array([300.0, 800.0]), jnp.array([0, 2])
    with pytest.raises(ValueError, match="interval_embedding=True"):
        call(one, x, t, labels, interval=t)
    two = perturbed(two)
    at_zero = call(two, x, t, labels, interval=jnp.zeros(2))
    np.testing.assert_array_equal(call(two, x, t, labels), at_zero)  # no interval: r = t
    assert not np.allclose(call(two, x, t, labels, interval=jnp.array([100.0, 500.0])), at_zero, atol=1e-4)


def test_meanflow_takes_an_attention_form_jvp_can_differentiate_on_a_tpu(monkeypatch):
    """On a TPU, DiT's 256 tokens take the one_block kernel, whose gradient is a custom_vjp: jax.jvp cannot go
    through it, so MeanFlow's target is traced in `forward_mode()`, where XLA's form is chosen."""
    from eqxdiff.nn import DiT
    from eqxdiff.nn import attention as attention_module

    monkeypatch.setattr(attention_module, "platform", lambda: "tpu")
    monkeypatch.setattr(jax, "device_count", lambda backend=None: 1)
    assert attention_module.chosen_form(256, 256, False) == "one_block"
    model = DiT(16, 1, 1, 16, 1, 2, key=jax.random.key(0), interval_embedding=True)  # 16² tokens of one pixel
    x0, noise = (jax.random.normal(k, (2, 16, 16, 1)) for k in jax.random.split(jax.random.key(1)))
    t, r = jnp.array([0.9, 0.5]), jnp.array([0.2, 0.5])

    def loss(model):
        u, target = meanflow_prediction(model, x0, noise, t, r)
        return jnp.mean((u - target) ** 2)

    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model)  # one program, not op by op
    assert np.isfinite(value) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_meanflow_flags_that_cannot_work_are_refused_naming_the_fix():
    import dataclasses

    from checks import check_objective, with_two_times  # train/checks.py
    from eqxdiff.run.conditions import Labels
    from eqxdiff.run.models import model_args

    cfg = train_main.Config(objective="meanflow")  # the edm schedule and parameterization by default
    with pytest.raises(SystemExit, match="--schedule flow --parameterization flow"):
        check_objective(cfg)
    flow = dataclasses.replace(cfg, schedule="flow", parameterization="flow")
    check_objective(flow)
    with pytest.raises(SystemExit, match="--xla_cpu on"):
        check_objective(dataclasses.replace(flow, xla_cpu="auto"))
    args = model_args("unet", (8, 8, 1), Labels(10))
    assert with_two_times(flow, args)["kwargs"]["interval_embedding"] is True
    assert "interval_embedding" not in args["kwargs"]  # the table's own entry untouched
    assert with_two_times(dataclasses.replace(flow, objective="denoising"), args) == args
    with pytest.raises(SystemExit, match="unet or dit"):
        with_two_times(dataclasses.replace(flow, model="edm2_tiny"), model_args("edm2_tiny", (8, 8, 1), Labels(10)))


class GaussianFlow(eqx.Module):
    """The exact average velocity of the flow z_t = (1 - t)·x0 + t·ε for Gaussian data x0 ~ N(μ, s²) per element:
    the probability-flow ODE maps z_t to z_r = m_r + (σ_r/σ_t)·(z_t - m_t), m_t = (1 - t)·μ,
    σ_t² = (1 - t)²·s² + t², so u(z_t, r, t) = (z_t - z_r)/(t - r); at r = t the instantaneous velocity
    v = -μ + (σ_t'/σ_t)·(z_t - m_t). A model of two times in FlowSchedule's units (1000·t)."""

    mu: jax.Array
    s: float = eqx.field(static=True)

    def std(self, t):
        return jnp.sqrt((1 - t) ** 2 * self.s**2 + t**2)

    def endpoint(self, z, t, r):
        t, r = t[:, None, None, None], r[:, None, None, None]
        return (1 - r) * self.mu + self.std(r) / self.std(t) * (z - (1 - t) * self.mu)

    def __call__(self, x, t, cond=None, *, key=None, interval=None):
        t = t / TIME_SCALE
        h = jnp.zeros_like(t) if interval is None else interval / TIME_SCALE
        r = t - h
        tb, hb = t[:, None, None, None], h[:, None, None, None]
        dstd = ((t - 1) * self.s**2 + t) / self.std(t)
        velocity = -self.mu + dstd[:, None, None, None] / self.std(tb) * (x - (1 - tb) * self.mu)
        average = (x - self.endpoint(x, t, r)) / jnp.where(hb > 0, hb, 1.0)
        return jnp.where(hb > 0, average, velocity)


def test_meanflow_steps_land_on_the_exact_ode_endpoint_of_gaussian_data():
    from eqxdiff.diffusion import Denoiser, FlowSchedule, FlowVelocity, flow_time_sigmas, sample

    rng = np.random.default_rng(0)
    model = GaussianFlow(jnp.asarray(rng.normal(size=(1, 4, 4, 2)), jnp.float32), s=0.3)
    schedule = FlowSchedule()
    denoise = Denoiser(model, schedule, FlowVelocity())
    noise = jnp.asarray(rng.normal(size=(6, 4, 4, 2)), jnp.float32)
    t_max = schedule.sigma_max / (1 + schedule.sigma_max)
    exact = model.endpoint(t_max * noise, jnp.full(6, t_max), jnp.zeros(6))  # z at t_max = x·s(σ_max) = t_max·ε
    for steps in (1, 3):
        sigmas = flow_time_sigmas(steps, schedule.sigma_max)
        out = sample(denoise, sigmas[0] * noise, sigmas, "meanflow")
        np.testing.assert_allclose(out, exact, rtol=1e-4, atol=1e-4)
    # Euler's one step of the instantaneous velocity is far from it: the test sees the average velocity.
    euler = sample(denoise, sigmas[0] * noise, flow_time_sigmas(1, schedule.sigma_max), "euler")
    assert np.abs(euler - exact).max() > 0.1


def test_meanflow_grid_is_uniform_in_flow_time():
    from eqxdiff.diffusion import FlowSchedule
    from eqxdiff.generate import sampling_grid

    # FlowSchedule's t_max = 0.999: t = 0.999, 0.666, 0.333, 0 -> σ = t/(1 - t)
    np.testing.assert_allclose(
        sampling_grid("meanflow", 3, FlowSchedule()), [999.0, 0.666 / 0.334, 0.333 / 0.667, 0.0], rtol=1e-9
    )
    assert sampling_grid("heun", 3, FlowSchedule())[1] < 100  # the others keep EDM's Karras grid


MEANFLOW_DIGITS = [
    "--objective",
    "meanflow",
    "--schedule",
    "flow",
    "--parameterization",
    "flow",
    "--meanflow_omega",
    "1",
    "--meanflow_kappa",
    "0",
    "--label_dropout",
    "0.1",
    "--sample_method",
    "meanflow",
    "--sample_steps",
    "1",
    "--guidance",
    "1",
    "--sample_every",
    "0",
    "--wandb",
    "disabled",
    "--log_every",
    "50",
]


@pytest.mark.slow
@pytest.mark.usefixtures("optimised_compile")  # the step optimised: unoptimised, its 125 runs cost more than it saves
def test_meanflow_on_digits_one_step_samples_improve_with_training(tmp_path):
    """train/main.py --objective meanflow on the digits, briefly (docs/meanflow.md's job, 125 steps): the one-step
    samples' scorecard moves the right way between an early checkpoint and the last, and two steps beat one. The
    whole path (flags, two-time network, jvp step on 8 devices, checkpoint, rebuild, sampler) end to end; it does
    not pin the objective (a sign flipped in the target still passes at 150 steps: the fixture test catches it)."""
    import sample  # train/sample.py
    from runs import train_here

    from eqxdiff.eval import digits_sample_metrics

    run_dir = tmp_path / "meanflow"
    train_here(
        *MEANFLOW_DIGITS,
        "--run_dir",
        run_dir,
        "--steps",
        125,  # the last 25 of 150 moved no margin below (100 leaves the nearest-image ratio 1.24-1.28 of its 1.3)
        "--ckpt_every",
        25,
        "--keep_checkpoints",
        5,
        "--warmup_steps",
        20,
        "--batch_size",
        64,  # half the job's: the direction shows as clearly, in half the time
    )
    # The scorecards' two sampler programs (one and two steps) each run a few times: unoptimised, as the suite compiles
    jax.config.update("jax_disable_most_optimizations", True)  # (the fixture puts the suite's setting back after)

    def scorecard(step: int, steps: int) -> dict:
        out = tmp_path / f"s{step}-{steps}.npz"
        sample.main(
            sample.parse_args(
                [
                    "--run_dir",
                    str(run_dir),
                    "--step",
                    str(step),
                    "--out",
                    str(out),
                    "--num",
                    "200",
                    "--guidance",
                    "1",
                    "--method",
                    "meanflow",
                    "--steps",
                    str(steps),
                ]
            )
        )
        with np.load(out) as drawn:
            return digits_sample_metrics(drawn["images"], drawn["labels"])

    # Measured at batch 64 (8 devices, 2026-12-07, seeds 0 and 1): step 25 accuracy 0.14/0.155, FD 5.95/5.67;
    # step 125 0.985/0.985, FD 3.43/3.20, nearest-image ratio 1.19/1.18; two steps FD 1.83/1.86, diversity
    # 0.66/0.66 against one step's 0.47/0.48.
    early, late, two = scorecard(25, 1), scorecard(125, 1), scorecard(125, 2)
    assert late["class_accuracy"] > max(0.9, early["class_accuracy"] + 0.3), (early, late)
    assert late["fd"] < early["fd"] and 0.7 < late["nn_ratio"] < 1.3, (early, late)
    assert two["fd"] < late["fd"] and two["diversity_ratio"] > late["diversity_ratio"], (late, two)
