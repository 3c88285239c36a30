"""The model contract (`eqxdiff.nn.DiffusionModel`): the library's models keep it, and a model
written the Equinox way — one example, no batch axis — plugs in through `Batched` and trains."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import main as train_main  # train/main.py
from eqxdiff.run.conditions import Labels
from eqxdiff.diffusion import EDMPreconditioning, EDMSchedule
from eqxdiff.nn import Batched, ConditionalModel, DiffusionModel, DiT, UNet, null_cond_of
from eqxdiff.sharding import batch_sharding, make_mesh
from eqxdiff.training import adamw_cosine, create_train_state, make_train_step

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)


class OneExampleNet(eqx.Module):
    """An Equinox-style model: x[h, w, c], t[], label[] -> [h, w, c], with dropout."""

    conv: eqx.nn.Conv2d
    embed: eqx.nn.Embedding
    dropout: eqx.nn.Dropout

    def __init__(self, channels: int, num_classes: int, *, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(channels + 1, channels, 3, padding=1, key=k1)
        self.embed = eqx.nn.Embedding(num_classes + 1, channels, key=k2)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, x, t, label, *, key=None):
        h = jnp.concatenate([x, jnp.broadcast_to(jnp.sin(t), x.shape[:2] + (1,))], axis=-1)
        y = self.conv(jnp.moveaxis(h, -1, 0))  # equinox convs are channels-first
        y = self.dropout(y, key=key, inference=key is None)
        return jnp.moveaxis(y, 0, -1) + self.embed(label)

    def null_cond(self):
        return jnp.int32(self.embed.num_embeddings - 1)


def test_library_models_keep_the_contract():
    # Built from shapes only: the contract is the classes' call and null_cond, not their weights.
    key = jax.random.key(0)
    unet = eqx.filter_eval_shape(UNet, 1, (8,), 1, num_classes=3, norm_groups=4, key=key)
    dit = eqx.filter_eval_shape(DiT, 8, 2, 1, 16, 1, 2, num_classes=0, key=key)
    assert isinstance(unet, ConditionalModel) and isinstance(dit, DiffusionModel)
    assert null_cond_of(dit, 4) is None and null_cond_of(unet, 4).shape == (4,)


# Jitted: run op by op, every primitive of the model (and of its vmap) would compile on its own.
call = eqx.filter_jit(lambda model, *args, **kwargs: model(*args, **kwargs))


def test_batched_is_the_per_example_model_stacked():
    # The training test's net (1 channel, 10 classes): equinox draws its init eagerly, one
    # jax.random compile per parameter shape, so the two tests share those compiles.
    net = OneExampleNet(1, 10, key=jax.random.key(0))
    model = Batched(net)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, 5, 1)), jnp.float32)
    t, labels = jnp.array([0.1, 1.0, -2.0]), jnp.array([0, 3, 10])
    out = call(model, x, t, labels)
    for i in range(3):
        np.testing.assert_allclose(out[i], call(net, x[i], t[i], labels[i]), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(model.null_cond(3), [10, 10, 10])
    # dropout gets one key per example: two examples with equal inputs differ under a key
    same = jnp.broadcast_to(x[:1], (2, 5, 5, 1))
    a, b = call(model, same, t[:2] * 0, labels[:2] * 0, key=jax.random.key(1))
    assert not np.allclose(a, b)


def test_batched_equinox_model_trains_with_main_prepare_and_loss():
    mesh = make_mesh(data=-1, fsdp=1)
    schedule, parameterization = EDMSchedule(), EDMPreconditioning()
    optimizer, lr_schedule = adamw_cosine(3e-2, 40, 2)

    def make_model(key):
        return Batched(OneExampleNet(1, 10, key=key))

    state, shardings = create_train_state(make_model, optimizer, jax.random.key(0), mesh, 2**30)
    step = make_train_step(
        prepare=functools.partial(train_main.prepare, schedule=schedule, cond_dropout=0.1, condition=Labels(10)),
        loss_fn=functools.partial(train_main.loss_fn, schedule=schedule, parameterization=parameterization),
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        ema_decay=0.9,
        state_shardings=shardings,
        batch_sharding=batch_sharding(mesh),
        seed=0,
    )
    rng = np.random.default_rng(0)
    # one fixed batch: a model that learns at all lowers its loss on it
    batch = {
        "image": rng.integers(0, 256, (16, 6, 6, 1), dtype=np.uint8),
        "label": rng.integers(0, 10, 16).astype(np.int32),
    }
    batch = jax.device_put(batch, batch_sharding(mesh))
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert step.traces == 1 and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
