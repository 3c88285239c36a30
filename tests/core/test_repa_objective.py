"""train/main.py's `prepare` and `loss_fn` with REPA on: the targets are the clean images' DINOv2 patch tokens (grey
repeated to RGB, at the side giving the DiT's token count), and the loss is the denoising loss plus λ times the mean
negative cosine, recomputed here in numpy from the network's tokens after the chosen block."""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.diffusion import EDMPreconditioning, EDMSchedule, denoising_prediction
from eqxdiff.nn import DiT, Dinov2Model
from eqxdiff.run.conditions import Labels
from eqxdiff.training.repa import dinov2_targets, with_projector
import train_scripts  # noqa: F401 — train/ on sys.path: main's prepare and loss_fn

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

TOWER = Path(__file__).parents[1] / "data" / "dinov2" / "fd_dinov2" / "tower"


def test_repa_loss_is_the_denoising_loss_plus_lambda_times_the_negative_cosine():
    import main as train_main

    dino = Dinov2Model.from_transformers(TOWER, interpolate_offset=0.1)
    make = with_projector(lambda k: DiT(8, 2, 1, 32, 2, 4, num_classes=10, key=k), block=2, z_dim=32, projector_dim=16)
    rng = np.random.default_rng(0)
    params, static = eqx.partition(make(jax.random.key(1)), eqx.is_inexact_array)  # off adaLN-Zero's identity blocks
    model = eqx.combine(jax.tree.map(lambda p: p + 0.05 * rng.normal(size=p.shape).astype(np.float32), params), static)
    batch = {"image": rng.integers(0, 256, (4, 8, 8, 1), np.uint8), "label": np.arange(4, dtype=np.int32)}
    schedule, parameterization = EDMSchedule(), EDMPreconditioning(0.5)
    key = jax.random.key(3)
    kwargs = dict(condition=Labels(10), schedule=schedule, cond_dropout=0.0)
    prepared = jax.jit(lambda b, f: train_main.prepare(b, key, f, repa_side=56, **kwargs))(
        batch, {"repa_encoder": dino}
    )
    rgb = jnp.asarray(np.repeat(batch["image"], 3, axis=-1), jnp.float32)
    np.testing.assert_allclose(prepared["repa_targets"], dinov2_targets(dino, rgb, 56), rtol=1e-5, atol=1e-6)
    assert prepared["repa_targets"].shape == (4, 16, 32)  # 56² / 14² = 16 patches: the DiT's 4×4 tokens

    def loss(model, repa_weight):
        kwargs = dict(schedule=schedule, parameterization=parameterization, repa_weight=repa_weight)
        return train_main.loss_fn(model, prepared, key, **kwargs)

    with_repa, plain = jax.jit(loss, static_argnums=1)(model, 0.5), jax.jit(loss, static_argnums=1)(model.network, 0.0)
    args = (prepared["x0"], prepared["sigma"], prepared["noise"], prepared["cond"])
    tokens = denoising_prediction(model.network, schedule, parameterization, *args, key=key, tokens_after=2).tokens
    z, t = np.asarray(model.projector(tokens), np.float64), np.asarray(prepared["repa_targets"], np.float64)
    cos = (z * t).sum(-1) / np.linalg.norm(z, axis=-1) / np.linalg.norm(t, axis=-1)
    np.testing.assert_allclose(with_repa - plain, 0.5 * -cos.mean(), rtol=1e-4)
