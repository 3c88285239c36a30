"""The training step's arithmetic against numpy: clipped AdamW under the warm-up/cosine lr, the
logged lr, the EMA recurrence (constant and warmed-up decay), and the bf16 policy (bf16 compute, float32 state).

The AdamW/EMA tests train a linear regression (one `Dense`), whose gradient has a closed form,
so the numpy reference needs nothing from JAX: gradients, clipping, Adam, decoupled weight
decay, schedule and EMA are all recomputed here in float64.
"""

import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff import xla_cpu
from eqxdiff.nn import Dense, UNet
from eqxdiff.sharding import batch_sharding, make_mesh
from eqxdiff.training import (
    abstract_train_state,
    adamw_cosine,
    create_train_state,
    ema_warmup,
    make_train_step,
)

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

IN, OUT, BATCH = 8, 4, 16
LR, STEPS, WARMUP, WEIGHT_DECAY, CLIP, EMA_DECAY = 0.05, 6, 2, 0.1, 1.0, 0.8
B1, B2, EPS = 0.9, 0.999, 1e-8  # optax.adamw's defaults, which adamw_cosine keeps
TARGET_SCALES = (1.0, 8.0, 0.2, 3.0, 0.2)  # large targets give clipped steps, small ones unclipped
MIN_SIZE = 8  # small enough that the 8×4 weight and its moments are sharded over fsdp


def identity_prepare(batch, key):
    return batch


def regression_loss(model, batch, key):
    """mean over examples and outputs of (x·W + b - y)²."""
    return jnp.mean((model(batch["x"]).astype(jnp.float32) - batch["y"]) ** 2)


def make_dense(key):
    return Dense(IN, OUT, key=key)


def regression_batches():
    rng = np.random.default_rng(0)
    w_true = rng.normal(size=(IN, OUT))
    out = []
    for scale in TARGET_SCALES:
        x = rng.normal(size=(BATCH, IN))
        y = scale * (x @ w_true + 0.1 * rng.normal(size=(BATCH, OUT)))
        out.append({"x": x.astype(np.float32), "y": y.astype(np.float32)})
    return out


# --- the independent reference -------------------------------------------------------------


def numpy_lr(step: int) -> float:
    """Linear warm-up from 0 over WARMUP steps, then cosine to 0 at STEPS (adamw_cosine's doc)."""
    if step < WARMUP:
        return LR * step / WARMUP
    return LR * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def numpy_training(params0: dict, batches: list[dict]) -> list[dict]:
    """Clip-by-global-norm then AdamW (Kingma & Ba 2015, bias-corrected; Loshchilov & Hutter 2019
    decoupled decay, here multiplied by the lr as optax does), then EMA; float64, one dict per step."""
    p = {k: v.astype(np.float64) for k, v in params0.items()}
    ema = dict(p)
    mu = {k: np.zeros_like(v) for k, v in p.items()}
    nu = {k: np.zeros_like(v) for k, v in p.items()}
    out = []
    for t, batch in enumerate(batches, start=1):
        x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
        residual = x @ p["weight"] + p["bias"] - y
        grads = {"weight": 2 * x.T @ residual / residual.size, "bias": 2 * residual.sum(0) / residual.size}
        norm = math.sqrt(sum(float(np.sum(g**2)) for g in grads.values()))
        clipped = {k: g * min(1.0, CLIP / norm) for k, g in grads.items()}
        lr = numpy_lr(t - 1)  # the t-th update reads the schedule at count t - 1
        for k in p:
            mu[k] = B1 * mu[k] + (1 - B1) * clipped[k]
            nu[k] = B2 * nu[k] + (1 - B2) * clipped[k] ** 2
            adam = (mu[k] / (1 - B1**t)) / (np.sqrt(nu[k] / (1 - B2**t)) + EPS)
            p[k] = p[k] - lr * (adam + WEIGHT_DECAY * p[k])
            ema[k] = EMA_DECAY * ema[k] + (1 - EMA_DECAY) * p[k]
        out.append(
            dict(
                loss=float(np.mean(residual**2)),
                grad_norm=norm,
                lr=lr,
                clipped=norm > CLIP,
                params=dict(p),
                ema=dict(ema),
                mu=dict(mu),
                nu=dict(nu),
            )
        )
    return out


# --- the real step ---------------------------------------------------------------------------


def dense_arrays(dense) -> dict:
    return {"weight": np.asarray(dense.weight), "bias": np.asarray(dense.bias)}


@pytest.fixture(scope="module")
def regression_run():
    return train_regression(EMA_DECAY)


def train_regression(ema_decay):
    """(initial params, what the step reported and held after each of len(TARGET_SCALES) steps)
    on a (data=2, fsdp=4) mesh, through the public training API."""
    mesh = make_mesh(-1, 4)
    optimizer, schedule = adamw_cosine(LR, STEPS, WARMUP, weight_decay=WEIGHT_DECAY, clip_norm=CLIP)
    abstract, shardings = abstract_train_state(make_dense, optimizer, mesh, MIN_SIZE)
    step = make_train_step(
        prepare=identity_prepare,
        loss_fn=regression_loss,
        optimizer=optimizer,
        lr_schedule=schedule,
        ema_decay=ema_decay,
        state_shardings=shardings,
        batch_sharding=batch_sharding(mesh),
        seed=0,
    )
    state, _ = create_train_state(make_dense, optimizer, jax.random.key(1), mesh, MIN_SIZE, shardings=shardings)
    assert state.model.weight.sharding.spec == jax.sharding.PartitionSpec("fsdp")
    params0 = dense_arrays(state.model)
    observed = []
    for batch in regression_batches():
        state, metrics = step(state, jax.device_put(batch, batch_sharding(mesh)))
        adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw = chain(scale_by_adam, ...)
        held = dict(params=state.model, ema=state.ema, mu=adam.mu, nu=adam.nu)
        observed.append(
            dict(
                {k: float(v) for k, v in metrics.items()},
                step=int(state.step),
                adam_count=int(adam.count),
                **{name: dense_arrays(tree) for name, tree in held.items()},
            )
        )
    return params0, observed


def close(got, want, atol, where):
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=where)


def test_reference_covers_warmup_cosine_and_both_clipping_branches(regression_run):
    params0, _ = regression_run
    reference = numpy_training(params0, regression_batches())
    lrs = [r["lr"] for r in reference]
    assert lrs[0] == 0 and 0 < lrs[1] < LR and lrs[2] == LR and 0 < lrs[4] < lrs[3] < LR  # warm-up, peak, cosine
    clipped = [r["clipped"] for r in reference]
    assert any(clipped) and not all(clipped), [r["grad_norm"] for r in reference]


def test_adamw_clipping_and_schedule_match_numpy(regression_run):
    params0, observed = regression_run
    reference = numpy_training(params0, regression_batches())
    for t, (got, want) in enumerate(zip(observed, reference, strict=True), start=1):
        assert got["finite"] and got["step"] == t and got["adam_count"] == t
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
        np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-5)  # logged before clipping
        for k in ("weight", "bias"):
            for name in ("mu", "nu"):  # float32 sums of gradients: error relative to the array's scale
                close(got[name][k], want[name][k], 2e-5 * np.abs(want[name][k]).max(), f"step {t} {name}.{k}")
            # float32 rounding of the gradient moves m/sqrt(v) by ~1e-5 relative; an update is ~LR
            close(got["params"][k], want["params"][k], 4e-5 * LR, f"step {t} {k}")


def test_logged_lr_is_the_schedule_at_the_step_being_taken(regression_run):
    # metrics["lr"] is lr_schedule(state.step) before the increment: the lr this update used.
    _, observed = regression_run
    for t, got in enumerate(observed, start=1):
        np.testing.assert_allclose(got["lr"], numpy_lr(t - 1), rtol=1e-6, atol=0)


def test_ema_follows_its_recurrence_over_real_updates(regression_run):
    # e_k = d·e_{k-1} + (1 - d)·p_k with e_0 = p_0, p_k the step's own parameters after update k.
    params0, observed = regression_run
    moved = [
        np.abs(o["params"]["weight"] - prev["weight"]).max()
        for o, prev in zip(observed, [params0] + [o["params"] for o in observed[:-1]])
    ]
    assert sum(m > 1e-3 for m in moved) >= 3, moved  # at least 3 updates with lr > 0 moved the weights
    ema = {k: v.astype(np.float64) for k, v in params0.items()}
    for t, got in enumerate(observed, start=1):
        for k in ema:
            ema[k] = EMA_DECAY * ema[k] + (1 - EMA_DECAY) * got["params"][k]
            np.testing.assert_allclose(got["ema"][k], ema[k], rtol=1e-6, atol=1e-7, err_msg=f"step {t} ema.{k}")
    assert np.abs(observed[-1]["ema"]["weight"] - observed[-1]["params"]["weight"]).max() > 1e-2  # EMA lags


def test_ema_warmup_follows_tensorflows_num_updates_decay():
    # tf.train.ExponentialMovingAverage(decay, num_updates=t): d_t = min(decay, (1 + t) / (10 + t)) at
    # the update that follows t earlier ones. Decay 0.25 is reached at t = 2: both branches in 5 updates.
    params0, observed = train_regression(ema_warmup(0.25))
    ema = {k: v.astype(np.float64) for k, v in params0.items()}
    decays = [min(0.25, (1 + t) / (10 + t)) for t in range(len(observed))]
    assert decays[0] == 0.1 and decays[-1] == 0.25 and decays[1] < 0.25
    for t, (got, d) in enumerate(zip(observed, decays, strict=True)):
        for k in ema:
            ema[k] = d * ema[k] + (1 - d) * got["params"][k]
            np.testing.assert_allclose(got["ema"][k], ema[k], rtol=1e-6, atol=1e-7, err_msg=f"update {t} ema.{k}")


# --- bf16 --------------------------------------------------------------------------------------


def bf16_unet(key):
    """A small UNet whose zero-initialised output conv gets weights, so the output is not 0.

    No res blocks per level and no middle: conv_in, conv_mid_out, the final ResBlock (norms,
    its embedding projection, a 1x1 skip conv) and conv_out already hold every layer kind the
    bf16 cast reaches, in the fewest kernels for the two steps (fp32, bf16) to compile."""
    unet = UNet(1, (8,), 0, num_middle_res_blocks=0, emb_features=16, norm_groups=4, key=key)
    rng = np.random.default_rng(3)
    weight = 0.05 * rng.normal(size=unet.conv_out.weight.shape)
    return eqx.tree_at(lambda m: m.conv_out.weight, unet, jnp.asarray(weight, jnp.float32))


def unet_loss(model, batch, key):
    return jnp.mean((model(batch["x"], batch["t"], None).astype(jnp.float32) - batch["y"]) ** 2)


def unet_batch():
    rng = np.random.default_rng(4)
    return {
        "x": rng.normal(size=(8, 8, 8, 1)).astype(np.float32),
        "t": rng.uniform(-1, 1, size=(8,)).astype(np.float32),
        "y": rng.normal(size=(8, 8, 8, 1)).astype(np.float32),
    }


def ops_with_operand_dtypes(hlo: str, op: str) -> list[str]:
    """The operand types, e.g. 'tensor<8x8x8x1xbf16>, tensor<3x3x1x8xbf16>', of every `op` line."""
    return re.findall(rf"stablehlo\.{op}\b.*?:\s*\(([^)]*)\)\s*->", hlo)


@pytest.fixture(scope="module")
def unet_step_fns():
    """{precision: (mesh, optimizer, abstract state, shardings, TrainStep)} for fp32 and bf16."""
    mesh = make_mesh(1, 1, jax.devices()[:1])
    optimizer, schedule = adamw_cosine(1e-3, 100, 1)
    out = {}
    for precision in ("fp32", "bf16"):
        abstract, shardings = abstract_train_state(bf16_unet, optimizer, mesh, 256)
        step = make_train_step(
            prepare=identity_prepare,
            loss_fn=unet_loss,
            optimizer=optimizer,
            lr_schedule=schedule,
            ema_decay=0.9,
            state_shardings=shardings,
            batch_sharding=batch_sharding(mesh),
            seed=0,
            precision=precision,
        )
        out[precision] = (mesh, optimizer, abstract, shardings, step)
    return out


@pytest.fixture(scope="module")
def unet_steps(unet_step_fns):
    """{precision: (mesh, state, TrainStep)}, each state freshly built from key 0."""
    out = {}
    for precision, (mesh, optimizer, _, shardings, step) in unet_step_fns.items():
        state, _ = create_train_state(bf16_unet, optimizer, jax.random.key(0), mesh, 256, shardings=shardings)
        out[precision] = (mesh, state, step)
    return out


def test_bf16_step_convolves_and_multiplies_in_bf16(unet_step_fns):
    # Lowered from the abstract state and batch: the HLO's operand types, with nothing compiled or allocated.
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), unet_batch())
    for precision, (_, _, abstract, _, step) in unet_step_fns.items():
        # Without switch 8: its channel sums are reductions written as matvecs with ones (GroupNorm's in float32
        # by design), not the network's matmuls.
        with xla_cpu.only(xla_cpu.DEFAULT - {"channel_sum_matmul"}):
            hlo = step.lower(abstract, batch).as_text()
        convs, dots = ops_with_operand_dtypes(hlo, "convolution"), ops_with_operand_dtypes(hlo, "dot_general")
        assert len(convs) >= 6 and len(dots) >= 2, (len(convs), len(dots))  # forward and backward
        if precision == "fp32":
            assert all("bf16" not in c for c in convs + dots)
        else:  # every conv and matmul of the forward and backward pass, both operands
            assert all(c.count("xbf16>") == 2 for c in convs + dots), [c for c in convs + dots if "f32>" in c]


@pytest.mark.slow  # compiles and runs the conv UNet step twice (fp32, bf16); the HLO test above is its quick half
def test_bf16_loss_is_near_fp32_and_state_stays_float32(unet_steps):
    losses, grad_norms = {}, {}
    for precision, (mesh, state, step) in unet_steps.items():
        state, metrics = step(state, jax.device_put(unet_batch(), batch_sharding(mesh)))
        losses[precision], grad_norms[precision] = float(metrics["loss"]), float(metrics["grad_norm"])
        assert metrics["loss"].dtype == jnp.float32 and metrics["grad_norm"].dtype == jnp.float32
        for tree in (state.model, state.ema, state.opt_state):  # master weights, EMA, Adam moments
            for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array)):
                assert leaf.dtype == jnp.float32
    assert losses["bf16"] != losses["fp32"]  # bf16 rounding shows: it did compute in bf16
    np.testing.assert_allclose(losses["bf16"], losses["fp32"], rtol=1e-2)
    np.testing.assert_allclose(grad_norms["bf16"], grad_norms["fp32"], rtol=5e-2)
