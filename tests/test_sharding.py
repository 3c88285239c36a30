"""The FSDP rule, the mesh, and where every leaf of a real TrainState ends up."""

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from eqxdiff.nn import UNet
from eqxdiff.sharding import batch_sharding, fsdp_spec, make_mesh, sharding_summary
from eqxdiff.training import adamw_cosine, create_train_state


@pytest.mark.parametrize(
    "shape, fsdp, min_size, expected",
    [
        ((3, 3, 16, 32), 4, 100, P(None, None, None, "fsdp")),  # largest divisible axis
        ((3, 3, 32, 32), 4, 100, P(None, None, "fsdp")),  # tie: the earliest axis
        ((64, 64), 8, 100, P("fsdp")),
        ((30, 8), 4, 100, P(None, "fsdp")),  # the largest axis does not divide, the next does
        ((30, 7), 4, 100, P()),  # nothing divides: replicate
        ((8, 8), 4, 100, P()),  # below the threshold
        ((128,), 4, 128, P("fsdp")),  # exactly at the threshold
        ((64, 64), 1, 1, P()),  # fsdp=1 is plain data parallelism
        ((), 4, 0, P()),  # scalars
    ],
)
def test_fsdp_spec(shape, fsdp, min_size, expected):
    assert fsdp_spec(shape, fsdp, min_size) == expected


def test_make_mesh_shapes_and_errors():
    assert dict(make_mesh(-1, 4).shape) == {"data": 2, "fsdp": 4}
    assert dict(make_mesh(8, 1).shape) == {"data": 8, "fsdp": 1}
    assert dict(make_mesh(1, 2, jax.devices()[:2]).shape) == {"data": 1, "fsdp": 2}
    with pytest.raises(ValueError, match="3 x fsdp=2 = 6 devices, but 8 are present"):
        make_mesh(3, 2)
    with pytest.raises(ValueError, match="fsdp=3 must be >= 1 and divide the 8 devices"):
        make_mesh(-1, 3)


def tiny_unet(key):
    return UNet(1, (16, 32), 1, num_classes=10, norm_groups=4, key=key)


def test_fsdp_state_params_ema_and_adam_moments_share_one_layout():
    optimizer, _ = adamw_cosine(1e-3, 10, 1)
    state, _ = create_train_state(tiny_unet, optimizer, jax.random.key(0), make_mesh(-1, 4), min_size=1024)
    params = jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array))
    ema = jax.tree.leaves(eqx.filter(state.ema, eqx.is_inexact_array))
    adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
    mu, nu = jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu)
    assert len(params) == len(ema) == len(mu) == len(nu)
    sharded = 0
    for p, e, m, v in zip(params, ema, mu, nu):
        expected = fsdp_spec(p.shape, 4, 1024)
        for leaf in (p, e, m, v):
            assert leaf.sharding.spec == expected, (p.shape, leaf.sharding.spec)
        if p.size >= 1024:
            assert expected != P(), p.shape  # every large UNet weight has a divisible axis
            sharded += 1
            assert p.addressable_shards[0].data.size == p.size // 4  # really split, not replicated
    assert sharded > 10
    assert state.step.sharding.spec == P() and state.bad_steps.sharding.spec == P()


def test_fsdp1_shards_nothing_and_summary_counts_bytes():
    optimizer, _ = adamw_cosine(1e-3, 10, 1)
    state, shardings = create_train_state(tiny_unet, optimizer, jax.random.key(0), make_mesh(-1, 1), min_size=1024)
    for leaf in jax.tree.leaves(eqx.filter(state, eqx.is_array)):
        assert leaf.sharding.is_fully_replicated
    total = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(state, eqx.is_array)))
    line = sharding_summary(state, shardings)
    assert "0 sharded over fsdp" in line and f"{total / 2**20:.1f} MiB per device" in line


def test_batch_is_split_over_both_axes():
    mesh = make_mesh(-1, 4)
    x = jax.device_put(np.zeros((16, 8, 8, 1), np.float32), batch_sharding(mesh))
    assert x.sharding.spec == P(("data", "fsdp"))
    assert {s.data.shape for s in x.addressable_shards} == {(2, 8, 8, 1)}
