"""EDM2's network (eqxdiff.nn.EDM2UNet) against NVlabs/edm2's own code (tools/make_edm2_fixtures.py: a random-weight
Precond pickled as EDM2's training loop writes snapshots, converted by tools/convert_edm2.py); its magnitude-
preserving layers, forced weight normalisation, learned loss weighting, Adam and learning-rate schedule against
their definitions in the paper (Karras et al. 2024) and EDM2's training_loop.py, written out here."""

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eqxdiff.run.conditions import Labels
from eqxdiff.diffusion import EDMPreconditioning, EDMSchedule, uncertainty_weighted
from eqxdiff.nn import (
    ConditionalModel,
    DiffusionModel,
    EDM2UNet,
    MPConv,
    MPFourier,
    force_weight_normalization,
    mp_cat,
    mp_silu,
    mp_sum,
    normalize,
    null_cond_of,
)
from eqxdiff.nn.torch_weights import leaf_layouts
from eqxdiff.pretrained import load_edm2
from eqxdiff.pretrained.edm2_checkpoints import eqxdiff_name
from eqxdiff.sharding import batch_sharding, make_mesh
from eqxdiff.training import adam_edm2, create_train_state, edm2_lr_schedule, make_train_step

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import main as train_main  # train/main.py
from eqxdiff.run import models

DATA = Path(__file__).parents[1] / "data" / "edm2"


def relative(ours, official) -> float:
    return float(np.abs(np.asarray(ours) - official).max() / np.abs(official).max())


def test_load_edm2_equals_the_official_forward():
    """D(x; σ, y) = Precond's, F = its UNet's at (c_in·x, ln(σ)/4), u(σ) = its logvar; the last label is no class
    (EDM2's zero label vector). The weights are EDM2's published float16, the reference their float32 forward."""
    ref = dict(np.load(DATA / "reference.npz"))
    denoiser = load_edm2(DATA / "network.safetensors")
    model = denoiser.model
    assert (model.num_classes, model.enc_names[-1], model.dec_names[0]) == (5, "4x4_block0", "4x4_in0")
    assert ref["y"][-1] == model.num_classes

    @eqx.filter_jit
    def outputs(denoiser, x, sigma, y):
        t = EDMSchedule().sigma_to_t(sigma)
        c_in = EDMPreconditioning(0.5).coefficients(sigma, EDMSchedule())[2]
        x_in = c_in[:, None, None, None] * x
        dropped = denoiser.model(x_in, t, y, key=jax.random.key(0))  # training: dropout 0.1 in each block
        return denoiser(x, sigma, y), denoiser.model(x_in, t, y), denoiser.model.logvar(t), dropped

    denoised, raw, logvar, dropped = outputs(denoiser, *(jnp.asarray(ref[k]) for k in ("x", "sigma", "y")))
    assert relative(denoised, ref["denoised"]) <= 1e-4  # measured 4e-7
    assert relative(raw, ref["raw"]) <= 1e-4  # measured 4e-7
    assert relative(logvar, ref["logvar"]) <= 1e-4  # measured 1e-7
    assert 1e-3 < relative(dropped, ref["raw"]) < 1  # EDM2 drops only in training mode: with a key
    assert json.loads((DATA / "network.json").read_text())["network"]["class_name"] == "Precond"


@pytest.mark.parametrize("preset", ["img512-xs", "img64-s"])
def test_presets_have_every_official_tensor(preset):
    """EDM2UNet.preset at full size (on shapes only) against the official state_dict of the network EDM2 publishes
    (tools/make_edm2_fixtures.py, torch's meta device): every key loads into one leaf of its shape, none is left."""
    official = json.loads((DATA / "official_shapes.json").read_text())[preset]
    channels = official["network"]["img_channels"]
    abstract = eqx.filter_eval_shape(lambda k: EDM2UNet.preset(preset, channels, 64, 1000, key=k), jax.random.key(0))
    ours = dict(zip(leaf_layouts(abstract), (tuple(x.shape) for x in jax.tree.leaves(abstract)), strict=True))
    renamed = {eqxdiff_name(k, abstract): tuple(v) for k, v in official["shapes"].items()}
    assert renamed == ours  # 203 tensors; 124,713,765 numbers for img512-xs (EDM2's "125M")


def test_load_edm2_without_its_config_names_the_file(tmp_path):
    (tmp_path / "net.safetensors").write_bytes((DATA / "network.safetensors").read_bytes())
    with pytest.raises(FileNotFoundError, match="net.json"):
        load_edm2(tmp_path / "net.safetensors")


def test_magnitude_preserving_layers_keep_unit_variance():
    """eq. 81: E[silu(z)²] = 0.596² for z ~ N(0, 1) (quadrature); eq. 88 and 103 on unit-RMS inputs; eq. 47: an
    MPConv of unit-variance input has unit variance whatever its weight's scale; eq. 75: cos features have RMS 1."""
    z = np.linspace(-12, 12, 200001)
    density = np.exp(-(z**2) / 2) / np.sqrt(2 * np.pi)
    conv = MPConv(16, 8, (3, 3), key=jax.random.key(3))
    conv = eqx.tree_at(lambda m: m.weight, conv, 7.0 * conv.weight)  # the scale of the stored weight does not matter
    fourier = MPFourier(4096, key=jax.random.key(5))

    @eqx.filter_jit  # the layers in one program: op by op, each of their ops compiled on its own
    def layers(z, conv, fourier):
        a, b = (normalize(jax.random.normal(k, (1, 4096))) for k in jax.random.split(jax.random.key(0)))
        a, b = a - a.mean(), b - b.mean()  # uncorrelated in the sample too
        u, v = (normalize(jax.random.normal(jax.random.key(i), (2, n))) for i, n in ((1, 3), (2, 5)))
        x = jax.random.normal(jax.random.key(4), (8, 32, 32, 16))
        sums = [mp_sum(a, b, t) for t in (0.3, 0.5, 0.8)]
        return mp_silu(z), a, b, sums, u, v, mp_cat(u, v, t=0.3), conv(x), conv(x, gain=0.5), fourier(jnp.ones(2))

    silu, a, b, sums, u, v, cat, convolved, half, features = jax.tree.map(np.asarray, layers(z, conv, fourier))
    assert abs(np.sqrt(np.trapezoid(np.asarray(silu, np.float64) ** 2 * density, z)) - 1) < 2e-3
    for t, ours in zip((0.3, 0.5, 0.8), sums, strict=True):  # (1 - t)·a + t·b over sqrt((1-t)² + t²): not symmetric
        np.testing.assert_allclose(ours, ((1 - t) * a + t * b) / np.sqrt((1 - t) ** 2 + t**2), atol=1e-6)
    assert abs(float(np.std(sums[0])) - float(np.std(a))) < 0.03
    # eq. 103: [a·(1-t)·C/sqrt(Na), b·t·C/sqrt(Nb)], C = sqrt((Na+Nb)/((1-t)²+t²))
    c = np.sqrt(8 / (0.7**2 + 0.3**2))
    np.testing.assert_allclose(cat, np.concatenate([u * 0.7 * c / np.sqrt(3), v * 0.3 * c / np.sqrt(5)], -1), rtol=1e-6)
    assert abs(float(np.std(convolved)) - 1) < 0.05 and abs(float(np.std(half)) - 0.5) < 0.03
    assert abs(float(np.sqrt(np.mean(features.astype(np.float64) ** 2))) - 1) < 0.03


def test_force_weight_normalization_is_its_definition():
    """eq. 66: every MPConv weight w -> w / (1e-4 + ‖w_i‖/sqrt(fan-in)) per output row i (numpy, float64); every
    other leaf unchanged."""
    keys = jax.random.split(jax.random.key(0), 3)
    net = {
        "convs": [MPConv(4, 3, (), key=keys[0]), MPConv(2, 5, (3, 3), key=keys[1])],
        "fourier": MPFourier(4, key=keys[2]),
        "gain": jnp.zeros(()),
    }
    net = jax.tree.map(lambda a: np.asarray(a) * 3.0 + np.float32(0.1), net)  # off the sphere, the gain off zero
    out = eqx.filter_jit(force_weight_normalization)(net)  # one program: op by op, each op compiled on its own
    is_mp = lambda m: isinstance(m, MPConv)  # noqa: E731
    pairs = zip(jax.tree.leaves(net, is_leaf=is_mp), jax.tree.leaves(out, is_leaf=is_mp), strict=True)
    convs = [(m, o) for m, o in pairs if is_mp(m)]
    assert len(convs) == 2
    for before, after in convs:
        w = np.asarray(before.weight, np.float64).reshape(before.weight.shape[0], -1)
        expected = w / (1e-4 + np.linalg.norm(w, axis=1, keepdims=True) / np.sqrt(w.shape[1]))
        np.testing.assert_allclose(np.asarray(after.weight).reshape(w.shape), expected, rtol=1e-5)
    others = lambda tree: jax.tree.leaves(jax.tree.map(lambda m: None if is_mp(m) else m, tree, is_leaf=is_mp))  # noqa: E731
    assert all(np.array_equal(a, b) for a, b in zip(others(net), others(out), strict=True))


class OneConv(eqx.Module):
    conv: MPConv
    scale: jax.Array


def test_train_step_renormalises_after_each_update():
    """make_train_step(after_update=force_weight_normalization): the stored weight after a step is normalize() of
    the weight the same step leaves without it; the rest of the model is the same either way."""
    mesh = make_mesh(-1, 1)
    optimizer, schedule = adam_edm2(0.1, 0, 0)
    loss = lambda m, b, key: jnp.mean((m.scale * m.conv(b["x"]) - b["y"]) ** 2)  # noqa: E731
    make = lambda key: OneConv(MPConv(4, 3, (), key=key), jnp.ones(()))  # noqa: E731
    batch = {"x": np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32), "y": np.ones((8, 3), np.float32)}
    states = []
    for hook in (None, force_weight_normalization):
        state, shardings = create_train_state(make, optimizer, jax.random.key(0), mesh, 2**20)
        step = make_train_step(
            prepare=lambda b, key: b,
            loss_fn=loss,
            optimizer=optimizer,
            lr_schedule=schedule,
            ema_decay=0.9,
            state_shardings=shardings,
            batch_sharding=batch_sharding(mesh),
            seed=0,
            after_update=hook,
        )
        states.append(step(state, jax.device_put(batch, batch_sharding(mesh)))[0].model)
    plain, renormalised = states
    w = np.asarray(plain.conv.weight, np.float64)
    assert abs(np.linalg.norm(w[0]) / 2 - 1) > 1e-3  # the update moved the weight off the sphere
    expected = w / (1e-4 + np.linalg.norm(w, axis=1, keepdims=True) / 2)  # fan-in 4
    np.testing.assert_allclose(renormalised.conv.weight, expected, rtol=1e-6)
    np.testing.assert_array_equal(renormalised.scale, plain.scale)


class ConstantLogvar(eqx.Module):
    u: jax.Array

    def logvar(self, t):
        return self.u


def test_main_loss_is_edm2_loss():
    """train/main.py's loss_fn with a network that has a logvar head is EDM2Loss (training_loop.py):
    mean((weight / exp(u)) · (D - y)² + u), weight = (σ² + σ_d²)/(σ·σ_d)², u = logvar(ln(σ)/4)."""

    class WithLogvar(eqx.Module):
        def __call__(self, x, t, cond=None, *, key=None):
            return jnp.tanh(0.7 * x + 0.1 * t[:, None, None, None])

        def logvar(self, t):
            return 0.3 - 0.8 * t

    key_x, key_n = jax.random.split(jax.random.key(0))
    x0 = jax.random.uniform(key_x, (4, 4, 4, 2), minval=-1, maxval=1)
    noise, sigma = jax.random.normal(key_n, x0.shape), jnp.array([0.01, 0.3, 1.5, 40.0])
    schedule, precond, model = EDMSchedule(), EDMPreconditioning(0.5), WithLogvar()
    batch = dict(x0=x0, sigma=sigma, noise=noise, cond=None)
    # Both sides jitted, each one program: op by op, each of their ops compiled on its own
    loss_fn = lambda m, batch: train_main.loss_fn(m, batch, None, schedule=schedule, parameterization=precond)  # noqa: E731
    ours = eqx.filter_jit(loss_fn)(model, batch)

    @jax.jit
    def edm2_loss(x0, sigma, noise):
        s = sigma[:, None, None, None]
        x = x0 + s * noise
        c_in, c_skip, c_out = 1 / jnp.sqrt(0.25 + s**2), 0.25 / (s**2 + 0.25), s * 0.5 / jnp.sqrt(s**2 + 0.25)
        denoised = c_skip * x + c_out * model(c_in * x, jnp.log(sigma) / 4)
        u = model.logvar(jnp.log(sigma) / 4)[:, None, None, None]
        weight = (s**2 + 0.25) / (s * 0.5) ** 2
        return jnp.mean(weight / jnp.exp(u) * (denoised - x0) ** 2 + u)

    np.testing.assert_allclose(ours, edm2_loss(x0, sigma, noise), rtol=1e-5)
    # The optimum of E[L/e^u + u] over u is u = ln E[L]; a network without the head: L unchanged.
    loss, t = jnp.array([0.2, 3.0]), jnp.zeros(2)
    grad = jax.jit(jax.grad(lambda u: jnp.sum(uncertainty_weighted(ConstantLogvar(u), t, loss))))
    np.testing.assert_allclose(grad(jnp.log(loss)), 0, atol=1e-6)
    assert np.all(np.abs(grad(jnp.log(loss) + 0.1)) > 0.05)
    np.testing.assert_array_equal(uncertainty_weighted(lambda x: x, t, loss), loss)


def test_edm2_lr_schedule_and_adam():
    """EDM2's learning_rate_schedule(cur_nimg, batch_size, ref_lr, ref_batches, rampup_Mimg), transcribed, at
    cur_nimg = t·batch; Adam with β = (0.9, 0.99) written out for two updates."""

    def learning_rate_schedule(cur_nimg, batch_size, ref_lr=100e-4, ref_batches=70e3, rampup_Mimg=10):
        lr = ref_lr
        if ref_batches > 0:
            lr /= np.sqrt(max(cur_nimg / (ref_batches * batch_size), 1))
        if rampup_Mimg > 0:
            lr *= min(cur_nimg / (rampup_Mimg * 1e6), 1)
        return lr

    batch = 2048
    ours = edm2_lr_schedule(0.012, 70000, 10e6 / batch)  # EDM2's 10 Mimg ramp-up, in steps
    for t in (0, 1, 1000, 4882, 4883, 70000, 250000):
        np.testing.assert_allclose(ours(t), learning_rate_schedule(t * batch, batch, 0.012, 70000, 10), rtol=1e-6)
    optimizer, _ = adam_edm2(0.5, 0, 0)
    grads = [jnp.array([0.3, -2.0]), jnp.array([-0.1, 1.0])]
    params, state = jnp.zeros(2), optimizer.init(jnp.zeros(2))
    m = v = np.zeros(2)
    expected = np.zeros(2)
    for i, g in enumerate(grads, 1):
        updates, state = optimizer.update(g, state, params)
        params = optax.apply_updates(params, updates)
        m, v = 0.9 * m + 0.1 * np.asarray(g), 0.99 * v + 0.01 * np.asarray(g) ** 2
        expected = expected - 0.5 * (m / (1 - 0.9**i)) / (np.sqrt(v / (1 - 0.99**i)) + 1e-8)
    np.testing.assert_allclose(params, expected, rtol=1e-6)


def test_models_table_builds_edm2():
    """--model edm2_tiny: an EDM2UNet for digits, labels one-hot with the null class as zeros; text refused."""
    args = models.model_args("edm2_tiny", (8, 8, 1), Labels(10))
    assert args["constructor"] == "EDM2UNet" and args["kwargs"]["num_classes"] == 10
    assert models.MODELS["edm2_xs"]((64, 64, 4))[1]["model_channels"] == 128
    labelled = eqx.filter_eval_shape(lambda k: models.build_model(args, False, k, Labels(10)), jax.random.key(0))
    plain = eqx.filter_eval_shape(lambda k: EDM2UNet(1, 8, model_channels=8, key=k), jax.random.key(0))
    assert isinstance(labelled, ConditionalModel) and null_cond_of(labelled, 4).shape == (4,)
    assert isinstance(plain, DiffusionModel) and null_cond_of(plain, 4) is None
    with pytest.raises(SystemExit, match="not text"):
        models.MODELS["edm2_tiny"]((8, 8, 1), context_dim=32, pooled_dim=0)


def test_a_run_is_rebuilt_from_its_ema_whatever_its_optimizer(tmp_path):
    """train/sample.py rebuilds a --lr_ref_steps run (its checkpoint holds EDM2's Adam state, not AdamW-cosine's clip +
    decay chain) as any other: the rebuild's abstract EMA, which holds no optimizer, restores the EMA saved beside
    either optimizer's state, bitwise."""
    from eqxdiff.checkpoint import Checkpoints
    from eqxdiff.run import rebuild
    from eqxdiff.training import abstract_train_state, run_optimizer

    mesh, labels, rng = make_mesh(-1, 1), Labels(10), np.random.default_rng(0)
    stored = {"image_shape": [8, 8, 1], "model_args": models.model_args("edm2_tiny", (8, 8, 1), labels)}
    make = lambda key: models.build_model(stored["model_args"], False, key, labels)  # noqa: E731
    for lr_ref_steps, adam_first in ((300, True), (0, False)):
        cfg = train_main.Config(model="edm2_tiny", lr_ref_steps=lr_ref_steps)
        optimizer = run_optimizer(cfg.lr, cfg.steps, 0, cfg.weight_decay, lr_ref_steps)[0]
        abstract_state, shardings = abstract_train_state(make, optimizer, mesh, 2**62)
        assert isinstance(abstract_state.opt_state[0], optax.ScaleByAdamState) == adam_first  # two structures
        # Each leaf its own random values (no init compiled): the EMA read back is the EMA, not the model or a moment
        state = jax.tree.map(
            lambda a, s: jax.device_put(rng.normal(size=a.shape).astype(a.dtype), s), abstract_state, shardings
        )
        with Checkpoints(tmp_path / str(lr_ref_steps)) as checkpoints:
            checkpoints.save(1, state, {}, {})
            checkpoints.wait()
            abstract, sharding = rebuild.abstract_run_ema(cfg, stored, labels, mesh)
            ema = checkpoints.restore_part(1, "ema", abstract, sharding)
        assert eqx.tree_equal(jax.tree.map(np.asarray, ema), jax.tree.map(np.asarray, state.ema)) is True
