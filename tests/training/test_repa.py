"""REPA's pieces against sihyun-yu/REPA's own code (tools/make_repa_fixture.py): the DINOv2 targets of clean
256² images (its preprocessing, the hub tower's patch tokens), its projector MLP, and its projection loss."""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.nn import Dinov2Model
from eqxdiff.training.repa import Projector, dinov2_targets, repa_loss, target_size

DATA = Path(__file__).parents[1] / "data"
TOWER = DATA / "dinov2" / "fd_dinov2" / "tower"


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(DATA / "repa" / "reference.npz") as f:
        return dict(f)


def relative(ours, theirs) -> float:
    return float(np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max())


def projector_of(ref) -> Projector:
    """A Projector holding the fixture's weights (torch's [out, in] transposed to Dense's [in, out])."""
    projector = Projector(24, 32, 40, key=jax.random.key(0))
    for i in (1, 2, 3):
        projector = eqx.tree_at(
            lambda p: (getattr(p, f"fc{i}").weight, getattr(p, f"fc{i}").bias),
            projector,
            (jnp.asarray(ref[f"fc{i}_weight"].T), jnp.asarray(ref[f"fc{i}_bias"])),
        )
    return projector


def test_targets_are_the_hub_towers_patch_tokens(ref):
    dinov2 = Dinov2Model.from_transformers(TOWER, interpolate_offset=0.1)  # the torch.hub model's resize
    targets = eqx.filter_jit(dinov2_targets)(dinov2, ref["images"].astype(np.float32))
    assert targets.shape == (2, 16 * 16, 32)  # 256² -> 224²: a 16×16 grid of 14² patches
    assert relative(targets, ref["targets"]) <= 1e-4


def test_projector_and_loss_are_repas(ref):
    targets = jnp.asarray(ref["targets"])
    projected = projector_of(ref)(jnp.asarray(ref["tokens"]))
    assert relative(projected, ref["projected"]) <= 1e-4
    np.testing.assert_allclose(repa_loss(targets, projected), ref["proj_loss"], rtol=1e-4)
    np.testing.assert_allclose(repa_loss(targets, targets), -1.0, rtol=1e-6)  # aligned: -1
    np.testing.assert_allclose(repa_loss(targets, 3 * targets), -1.0, rtol=1e-6)  # a cosine: scale-free


def test_sizes_follow_repa():
    assert (target_size(256), target_size(512)) == (224, 448)
    with pytest.raises(ValueError, match=r"give images of at least 256²"):
        target_size(64)


def test_a_repa_runs_network_is_drawn_as_without_it_and_its_block_follows_repas_depth():
    from eqxdiff.nn import DiT
    from eqxdiff.training.repa import Aligned, default_block, network_of, with_projector

    make = lambda key: DiT(8, 2, 1, 32, 2, 4, num_classes=10, key=key)  # noqa: E731
    aligned = with_projector(make, block=1, z_dim=24, projector_dim=40)(jax.random.key(5))
    plain = make(jax.random.key(5))
    assert isinstance(aligned, Aligned) and network_of(aligned) is aligned.network and network_of(plain) is plain
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(aligned.network), jax.tree.leaves(plain)))
    assert aligned.projector.fc1.weight.shape == (32, 40) and aligned.projector.fc3.weight.shape == (40, 24)
    assert [default_block(d) for d in (28, 24, 12, 6, 2)] == [8, 7, 3, 2, 1]  # REPA's 8 of SiT-XL/2's 28
