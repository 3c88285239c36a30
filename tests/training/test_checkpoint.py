"""Checkpoints: byte-equal roundtrip, restore onto other meshes, and every failure a clear error.

A truncated checkpoint file is tested through train/main.py in test_resume.py, in its own
process: orbax leaves tensorstore callbacks behind after a failed read, which would surface
as unraisable-exception warnings in whichever test runs next."""

import re
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from eqxdiff import xla_cpu
from eqxdiff.checkpoint import ARRAY_HANDLERS, CheckpointError, Checkpoints, all_finite
from eqxdiff.sharding import make_mesh, state_shardings
from eqxdiff.training import abstract_train_state, adamw_cosine, create_train_state

MIN_SIZE = 256
OPTIMIZER, _ = adamw_cosine(1e-3, 100, 10, 0.0)


def make_model(key, width=64):
    return eqx.nn.MLP(16, 16, width, depth=2, activation=jax.nn.gelu, key=key)  # gelu: a non-array leaf


def trained_state(mesh):
    """A state in which every array leaf holds its own random values (model, EMA, Adam's mu and
    nu, the counters), each in its sharding: a restore that swaps two same-shaped leaves (mu for
    nu, EMA for model) changes the values at some path. The values need not be reachable by
    training (nu may be negative); a checkpoint only stores them."""
    state, _ = create_train_state(make_model, OPTIMIZER, jax.random.key(0), mesh, MIN_SIZE)
    rng = np.random.default_rng(0)

    def distinct(x):
        if not eqx.is_array(x):
            return x
        if jnp.issubdtype(x.dtype, jnp.inexact):
            value = rng.normal(size=x.shape).astype(x.dtype)
        else:
            value = rng.integers(1, 1000, size=x.shape).astype(x.dtype)
        return jax.device_put(value, x.sharding)

    return eqx.tree_at(lambda s: s.step, jax.tree.map(distinct, state), jnp.asarray(7, jnp.int32))


def arrays(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def assert_same_leaves(saved, restored):
    """Leaf by leaf, matched by path: equal values, dtypes and paths."""
    want = jax.tree_util.tree_flatten_with_path(eqx.filter(saved, eqx.is_array))[0]
    got = jax.tree_util.tree_flatten_with_path(eqx.filter(restored, eqx.is_array))[0]
    assert [jax.tree_util.keystr(p) for p, _ in got] == [jax.tree_util.keystr(p) for p, _ in want]
    for (path, a), (_, b) in zip(want, got, strict=True):
        assert a.dtype == b.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))


def test_test_state_tells_model_ema_and_moments_apart():
    state = trained_state(make_mesh(data=2, fsdp=4))
    adam = state.opt_state[1][0]
    weights = [np.asarray(t.layers[1].weight) for t in (state.model, state.ema, adam.mu, adam.nu)]
    for i in range(4):
        for j in range(i):
            assert not np.any(weights[i] == weights[j]), (i, j)
    counters = [int(state.step), int(state.bad_steps), int(adam.count), int(state.opt_state[1][2].count)]
    assert len(set(counters)) == 4, counters


def restore_on(checkpoints, step, mesh, make=make_model):
    abstract, shardings = abstract_train_state(make, OPTIMIZER, mesh, MIN_SIZE)
    return checkpoints.restore(step, abstract, shardings)


def test_roundtrip_is_byte_equal_with_data_and_config(tmp_path):
    mesh = make_mesh(data=2, fsdp=4)
    state = trained_state(mesh)
    with Checkpoints(tmp_path) as checkpoints:
        assert checkpoints.save(7, state, {"examples_consumed": 448, "seed": 3}, {"model": "mlp"}) == "saved"
        checkpoints.wait()
        assert checkpoints.steps == [7] and (tmp_path / "7" / "state").is_dir()
        restored, data, config = restore_on(checkpoints, 7, mesh)
    assert data == {"examples_consumed": 448, "seed": 3} and config == {"model": "mlp"}
    assert isinstance(restored.model, eqx.nn.MLP) and restored.model.activation is jax.nn.gelu
    for a, b in zip(arrays(state), arrays(restored), strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    big = restored.opt_state[1][0].mu.layers[1].weight  # an Adam moment of a 64×64 weight
    assert big.sharding.spec == jax.sharding.PartitionSpec("fsdp")


@pytest.mark.parametrize("target", [(4, 2), (8, 1), (1, 1)], ids=["fsdp2", "data8", "one-device"])
def test_restore_onto_another_mesh(tmp_path, target):
    state = trained_state(make_mesh(data=2, fsdp=4))
    with Checkpoints(tmp_path) as checkpoints:
        checkpoints.save(7, state, {}, {})
        checkpoints.wait()
        data, fsdp = target
        mesh = make_mesh(data=data, fsdp=fsdp, devices=jax.devices()[: data * fsdp])
        restored, _, _ = restore_on(checkpoints, 7, mesh)
    assert_same_leaves(state, restored)
    weight = restored.ema.layers[1].weight
    assert weight.sharding.mesh.shape == {"data": data, "fsdp": fsdp}
    assert weight.sharding.spec == (jax.sharding.PartitionSpec("fsdp") if fsdp > 1 else jax.sharding.PartitionSpec())


@pytest.mark.parametrize("layout", [True, False], ids=["layout", "written_before_layouts"])
def test_structure_mismatch_is_a_checkpoint_error(tmp_path, layout):
    """Named leaf by leaf before orbax reads an array: from the checkpoint's layout item, or from orbax's metadata
    for a checkpoint written without one (which still restores)."""
    mesh = make_mesh(data=8)
    state = trained_state(mesh)
    with Checkpoints(tmp_path) as checkpoints:
        checkpoints.save(3, state, {}, {})
        checkpoints.wait()
        assert (tmp_path / "3" / "layout").is_dir()
        if not layout:
            shutil.rmtree(tmp_path / "3" / "layout")
        assert_same_leaves(state, restore_on(checkpoints, 3, mesh)[0])
        with pytest.raises(
            CheckpointError,
            match=r"step 3 .* cannot be restored into this run's state, which differs "
            r"in: .*ema\.layers\.0\.weight: saved \(\(64, 16\), 'float32'\), this run has "
            r"\(\(32, 16\), 'float32'\).*original flags",
        ):
            restore_on(checkpoints, 3, mesh, make=lambda key: make_model(key, width=32))
        with pytest.raises(CheckpointError, match=r"No checkpoint for step 5 .* complete ones: \[3\]"):
            restore_on(checkpoints, 5, mesh)
        if layout:  # a torn layout item: one CheckpointError naming the step, not orbax's own
            (tmp_path / "3" / "layout" / "metadata").write_text("{not json")
            with pytest.raises(CheckpointError, match=r"Step 3 in .*: cannot read the layout of its state"):
                restore_on(checkpoints, 3, mesh)


@pytest.mark.parametrize("layout", [True, False], ids=["layout", "written_before_layouts"])
def test_the_ema_restores_alone_without_reading_the_rest(tmp_path, monkeypatch, layout):
    """`restore_part` reads the EMA's arrays and no other (orbax's array reads counted), each as saved, onto
    another mesh; an EMA of another shape is refused in one line naming its leaf, checked against the EMA's saved
    leaves alone (a changed optimizer is no error: the sampling rebuild does not know it), from the layout item or
    orbax's metadata."""
    state = trained_state(make_mesh(data=2, fsdp=4))
    mesh = make_mesh(data=8)
    replicated = lambda tree: state_shardings(tree, mesh, 2**62)  # noqa: E731 — min_size 2**62: all replicated
    handler, read = ARRAY_HANDLERS.get(jax.Array), []
    deserialize = handler.deserialize

    async def counted(infos, args=None):
        read.extend(infos)
        return await deserialize(infos, args)

    monkeypatch.setattr(handler, "deserialize", counted)
    with Checkpoints(tmp_path) as checkpoints:
        checkpoints.save(3, state, {}, {})
        checkpoints.wait()
        if not layout:
            shutil.rmtree(tmp_path / "3" / "layout")
        abstract = eqx.filter_eval_shape(make_model, jax.random.key(0))
        ema = checkpoints.restore_part(3, "ema", abstract, replicated(abstract))
        assert_same_leaves(state.ema, ema)
        assert isinstance(ema, eqx.nn.MLP) and ema.activation is jax.nn.gelu  # the static parts: the abstract's
        assert all(x.sharding.spec == P() for x in jax.tree.leaves(eqx.filter(ema, eqx.is_array)))
        assert len(read) == len(arrays(state.ema)) < len(arrays(state)) / 3  # EMA only: not model, mu, nu
        narrower = eqx.filter_eval_shape(lambda key: make_model(key, width=32), jax.random.key(0))
        with pytest.raises(CheckpointError) as refused:
            checkpoints.restore_part(3, "ema", narrower, replicated(narrower))
    message = str(refused.value)
    assert "\n" not in message and "model." not in message and "opt_state" not in message  # the EMA's leaves alone
    assert re.search(
        r"step 3 .* cannot be restored into this run's ema, which differs in: .*ema\.layers\.0\.weight: saved "
        r"\(\(64, 16\), 'float32'\), this run has \(\(32, 16\), 'float32'\).*original flags",
        message,
    )


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_all_finite_on_the_host_and_jitted_agree_on_each_shard(bad):
    # A leaf sharded over 8 devices (the bad value in the last device's shard), a replicated one,
    # bf16 and an integer leaf (never checked: counters are finite by construction).
    mesh = make_mesh(data=8)
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    good = {
        "sharded": jax.device_put(np.arange(32, dtype=np.float32), sharded),
        "replicated": jax.device_put(np.ones((3, 3), jnp.bfloat16), replicated),
        "count": jax.device_put(np.int32(7), replicated),
    }
    trees = {
        "good": (good, True),
        "last_shard": ({**good, "sharded": good["sharded"].at[31].set(bad)}, False),
        "bf16": ({**good, "replicated": good["replicated"].at[2, 1].set(bad)}, False),
    }
    for name, (tree, expected) in trees.items():
        assert xla_cpu.host_all_finite(jax.tree.leaves(tree)) is not None  # the host path is the one taken
        with xla_cpu.disabled():
            assert xla_cpu.host_all_finite(jax.tree.leaves(tree)) is None
            assert all_finite(tree) is expected, name  # the jitted reduction
        assert all_finite(tree) is expected, name


def test_a_non_finite_state_never_replaces_a_good_checkpoint(tmp_path):
    mesh = make_mesh(data=8)
    good = trained_state(mesh)
    poisoned = eqx.tree_at(lambda s: s.model.layers[0].bias, good, jnp.full((64,), jnp.nan))
    with Checkpoints(tmp_path, keep=1) as checkpoints:
        assert checkpoints.save(3, good, {}, {}) == "saved"
        assert checkpoints.save(4, poisoned, {}, {}) == "non_finite"  # with keep=1 it would have deleted step 3
        assert checkpoints.save(3, poisoned, {}, {}) == "exists"  # an existing step is never overwritten
        assert checkpoints.save(2, good, {}, {}) == "not_newest"  # orbax keeps steps in order
        checkpoints.wait()
        assert checkpoints.steps == [3]
        restored, _, _ = restore_on(checkpoints, 3, mesh)
    for a, b in zip(arrays(restored.model), arrays(good.model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="--keep_checkpoints must be >= 1"):
        Checkpoints(tmp_path, keep=0)
