"""Dinov2Model against transformers' PyTorch towers (fixtures by tools/make_dinov2_fixtures.py): `Dinov2Model`,
ViT-g's SwiGLU MLP and `Dinov2WithRegistersModel`, at the stored patch grid and at others (the bicubic resize of
the position embeddings, up, down and non-square); the full-size configurations' parameter counts; loading by
the saved keys (missing/unexpected named); options not supported."""

import dataclasses
import functools
import json
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from eqxdiff.nn import Dinov2Model
from eqxdiff.nn.bicubic import bicubic_matrix

DATA = Path(__file__).parents[1] / "data" / "dinov2"
INPUTS = {"small": 3, "swiglu": 2, "registers": 2}  # inputs per fixture (reference.npz's pixels_<i>)


@functools.cache
def load(name: str, interpolate_offset: float = 0.0) -> Dinov2Model:
    return Dinov2Model.from_transformers(DATA / name, interpolate_offset=interpolate_offset)


@functools.cache
def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / name / "reference.npz") as ref:
        return dict(ref)


@eqx.filter_jit
def run(model: Dinov2Model, pixels):
    return model(pixels)


def relative_errors(model: Dinov2Model, name: str, i: int) -> tuple[float, float]:
    """max |ours - transformers'| / max |transformers'| of last_hidden_state and pooler_output for input i."""
    ref = reference(name)
    hidden, pooled = run(model, ref[f"pixels_{i}"])
    errors = []
    for ours, theirs in ((hidden, ref[f"last_hidden_state_{i}"]), (pooled, ref[f"pooler_output_{i}"])):
        assert ours.shape == theirs.shape
        errors.append(float(np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max()))
    return errors[0], errors[1]


@pytest.mark.parametrize("name, i", [(name, i) for name, n in INPUTS.items() for i in range(n)])
def test_matches_transformers(name, i):
    hidden, pooled = relative_errors(load(name), name, i)
    assert hidden <= 1e-4 and pooled <= 1e-4, (hidden, pooled)


def test_fixtures_resize_the_position_embeddings():
    """Inputs off the stored grid (and non-square ones) exercise the resize: a grid taken as the stored one at
    another size differs, and the hub's sampling step (interpolate_offset 0.1) is not transformers 5's."""
    ref = reference("small")
    assert ref["pixels_0"].shape[1:3] == (16, 16) and ref["pixels_1"].shape[1:3] == (24, 20)
    hub = load("small", interpolate_offset=0.1)
    assert relative_errors(hub, "small", 0)[0] <= 1e-4  # the stored grid: no resize either way
    for i in (1, 2):
        assert relative_errors(hub, "small", i)[0] > 1e-3
    assert relative_errors(with_antialias(load("small"), True), "small", 1)[0] > 1e-3  # the registers model's resize
    assert relative_errors(with_antialias(load("registers"), False), "registers", 1)[0] > 1e-3


def with_antialias(model: Dinov2Model, antialias: bool) -> Dinov2Model:
    return eqx.tree_at(lambda m: m.embeddings, model, dataclasses.replace(model.embeddings, antialias=antialias))


def test_registers_sit_between_the_cls_and_the_patch_tokens():
    model, ref = load("registers"), reference("registers")
    assert model.num_prefix_tokens == 5 and load("small").num_prefix_tokens == 1
    hidden, pooled = run(model, ref["pixels_1"])  # 20×16 images, patch 4: a 5×4 grid
    assert hidden.shape == (2, 5 + 20, 32)
    np.testing.assert_array_equal(pooled, hidden[:, 0])


def test_swiglu_halves_are_gate_then_up():
    """weights_in's first half goes through SiLU (transformers' gate_proj), its second is the linear half."""
    model = load("swiglu")
    swapped = eqx.tree_at(
        lambda m: m.encoder.layer[0].mlp.weights_in.weight,
        model,
        np.roll(np.asarray(model.encoder.layer[0].mlp.weights_in.weight), 64, axis=1),
    )
    assert model.encoder.layer[0].mlp.weights_in.weight.shape == (24, 128)  # 2 × ((int(96·2/3) + 7) // 8 · 8)
    assert relative_errors(swapped, "swiglu", 0)[0] > 1e-3


def test_full_size_parameter_counts_are_transformers():
    """ViT-S/B/L/g/14 and the registers' ViT-L/14 (configurations no fixture holds) have transformers'
    num_parameters() (built without weights)."""
    sizes = json.loads((DATA / "full_size.json").read_text())
    assert set(sizes) == {"dinov2-small", "dinov2-base", "dinov2-large", "dinov2-giant", "dinov2-with-registers-large"}
    for name, entry in sizes.items():
        model = eqx.filter_eval_shape(Dinov2Model.from_config, entry["config"], key=jax.random.key(0))
        count = sum(x.size for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct))
        assert count == entry["num_parameters"], name


def test_resize_matrices_are_torch_rules():
    """Spot values of torch's bicubic rules (torch 2.13's `interpolate` of the unit vectors, 4 -> 8): rows sum
    to 1; the plain kernel clamps its taps at the edges; the antialiased one at scale 1 is the identity."""
    up = bicubic_matrix(4, 8)
    np.testing.assert_allclose(up.sum(1), 1, atol=1e-12)
    np.testing.assert_allclose(up[3], [-0.10546875, 0.87890625, 0.26171875, -0.03515625], atol=1e-7)
    np.testing.assert_allclose(up[0], [1.1054688, -0.10546875, 0, 0], atol=1e-7)  # src -0.25: taps -2..1 clamped
    assert np.allclose(bicubic_matrix(5, 5, antialias=True), np.eye(5))
    hub = bicubic_matrix(37, 16, scale_factor=16.1 / 37)  # the hub's offset: another step than 37/16
    assert np.abs(hub - bicubic_matrix(37, 16)).max() > 1e-2


def copy_with(tmp_path: Path, state: dict, name: str = "small", **config) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(json.loads((DATA / name / "config.json").read_text()) | config))
    save_file(state, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_missing_and_unexpected_keys_are_named(tmp_path):
    state = load_file(str(DATA / "small" / "model.safetensors"))
    missing = {k: v for k, v in state.items() if k != "encoder.layer.1.layer_scale2.lambda1"}
    with pytest.raises(ValueError, match=r"missing keys \(1\): encoder\.layer\.1\.layer_scale2\.lambda1"):
        Dinov2Model.from_transformers(copy_with(tmp_path / "a", missing))
    extra = state | {"embeddings.register_tokens": np.zeros((1, 4, 32), np.float32)}  # a registers model's key
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): embeddings\.register_tokens"):
        Dinov2Model.from_transformers(copy_with(tmp_path / "b", extra))
    no_mask = {k: v for k, v in state.items() if k != "embeddings.mask_token"}  # use_mask_token false: no such key
    model = Dinov2Model.from_transformers(copy_with(tmp_path / "c", no_mask, use_mask_token=False))
    assert model.embeddings.mask_token is None and relative_errors(model, "small", 1)[0] <= 1e-4


SMALL = json.loads((DATA / "small" / "config.json").read_text())


@pytest.mark.parametrize(
    "option, value",
    [
        ("hidden_act", "relu"),
        ("model_type", "vit"),
        ("patch_size", [4, 2]),
        ("num_attention_heads", 5),
        ("rope_theta", 100.0),
    ],
)
def test_unsupported_option_is_named(option, value):
    with pytest.raises(ValueError, match=option):
        eqx.filter_eval_shape(Dinov2Model.from_config, SMALL | {option: value}, key=jax.random.key(0))


def test_images_smaller_than_a_patch_raise():
    with pytest.raises(ValueError, match=r"images 3×16 are smaller than one 4² patch"):
        load("small")(np.zeros((1, 3, 16, 3), np.float32))
