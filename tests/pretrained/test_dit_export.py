"""eqxdiff.pretrained.save_dit: an eqxdiff DiT in facebookresearch/DiT's layout. The official checkpoint
loaded and saved again is the same file's tensors; a DiT built as eqxdiff/run/models.py builds one comes back
from load_dit leaf for leaf; the official sizes' keys and shapes are models.py's (tests/data/dit/
official_shapes.json, written by the official code); what models.py cannot hold is refused. (The
official forward on a saved file: tools/check_dit_export.py.)"""

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from eqxdiff.nn import DiT
from eqxdiff.weights.torch_pickle import read_torch_file
from eqxdiff.pretrained import load_dit, save_dit
from eqxdiff.pretrained.dit_checkpoints import OFFICIAL_SIZES
from eqxdiff.pretrained.dit_export import official_state
from eqxdiff.sharding import make_mesh, placement
from eqxdiff.run.models import MODELS

DATA = Path(__file__).parents[1] / "data" / "dit"


def tensors(path) -> dict[str, np.ndarray]:
    with safe_open(str(path), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def drawn(build, seed: int = 0):
    """The model `build()` makes with every array leaf drawn at random (adaLN-Zero's zeros too), so a leaf put in the
    wrong place shows: its structure from an abstract build (DiT-S's eager init of 12 blocks takes seconds, and
    its values would be replaced anyway)."""
    rng = np.random.default_rng(seed)
    draw = lambda x: jnp.asarray(rng.normal(0, 0.2, x.shape).astype(x.dtype))  # noqa: E731
    return jax.tree.map(lambda x: draw(x) if isinstance(x, jax.ShapeDtypeStruct) else x, eqx.filter_eval_shape(build))


def assert_same_model(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)  # the static configuration too
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_an_official_checkpoint_saved_again_is_the_same_state_dict(tmp_path):
    model = load_dit(DATA / "ema.safetensors", num_heads=2)  # the fixture: depth 2, width 32, 2 heads
    saved = save_dit(model, tmp_path / "again.safetensors")
    official, ours = tensors(DATA / "ema.safetensors"), tensors(saved)
    assert ours.keys() == official.keys()
    for key in official:
        assert ours[key].dtype == np.float32 and ours[key].shape == official[key].shape, key
        np.testing.assert_array_equal(ours[key], official[key], err_msg=key)  # pos_embed as models.py sets it, too
    assert_same_model(load_dit(saved, num_heads=2), model)
    with safe_open(str(saved), framework="numpy") as f:
        assert f.metadata() == {"format": "pt", "num_heads": "2"}

    as_torch = save_dit(model, tmp_path / "again.pt")  # torch's zip format, a bare state_dict as DiT publishes
    state = read_torch_file(as_torch)
    assert list(state) == list(official_state(model)) and set(state) == set(official)
    for key in official:
        np.testing.assert_array_equal(state[key], official[key], err_msg=key)
    assert_same_model(load_dit(as_torch, num_heads=2), model)

    # An FSDP-sharded model (a training state's EMA over 8 devices) and a bfloat16 one save the same way.
    sharded = load_dit(DATA / "ema.safetensors", num_heads=2, place=placement(make_mesh(data=1, fsdp=8), min_size=64))
    assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated for x in jax.tree.leaves(sharded))
    assert tensors(save_dit(sharded, tmp_path / "sharded.safetensors")).keys() == official.keys()
    for key, value in tensors(tmp_path / "sharded.safetensors").items():
        np.testing.assert_array_equal(value, official[key], err_msg=key)
    bf16 = load_dit(DATA / "ema.safetensors", num_heads=2, dtype=jnp.bfloat16)
    for key, value in tensors(save_dit(bf16, tmp_path / "bf16.safetensors")).items():  # float32, the bf16 values
        assert value.dtype == np.float32
        expected = official[key] if key == "pos_embed" else official[key].astype(jnp.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(value, expected, err_msg=key)


@pytest.mark.parametrize(
    "name, learn_sigma, patch", [("dit_tiny", False, 2), ("dit_tiny", True, 4), ("dit_s", False, 2)]
)
def test_a_dit_built_as_train_models_builds_it_comes_back_from_load_dit(tmp_path, name, learn_sigma, patch):
    constructor, kwargs = MODELS[name]((8, 8, 4), num_classes=10)
    kwargs = {**kwargs, "patch_size": patch}
    build = DiT.small if constructor == "DiT.small" else lambda **kw: DiT(**kw, learn_sigma=learn_sigma)
    model = drawn(lambda: build(**kwargs, key=jax.random.key(1)))
    heads = model.blocks[0].attn.num_heads
    saved = save_dit(model, tmp_path / "m.safetensors")
    official = name == "dit_s"  # DiT-S: its heads come from the official table
    loaded = load_dit(saved) if official else load_dit(saved, num_heads=heads)
    assert_same_model(loaded, model)
    if official:
        return  # its leaves are equal; a forward of 12 blocks adds compile time, not a check
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8, 8, 4)), jnp.float32)
    t, y = jnp.array([0.0, 500.0, 999.0]), jnp.array([0, 9, 10])  # 10: the null class
    forward = eqx.filter_jit(lambda m: m(x, t, y))  # one compile for both (the same structure), not one per op
    np.testing.assert_array_equal(forward(loaded), forward(model))


@pytest.mark.parametrize("entry", ["DiT-S/2 256", "DiT-B/4 256", "DiT-L/8 256", "DiT-XL/2 256", "DiT-XL/2 512"])
def test_the_official_sizes_have_models_py_keys_and_shapes(entry):
    official = json.loads((DATA / "official_shapes.json").read_text())[entry]
    size, rest = entry.removeprefix("DiT-").split("/")
    patch, resolution = map(int, rest.split())
    (depth, hidden), (_, heads) = next((k, v) for k, v in OFFICIAL_SIZES.items() if v[0] == size)
    abstract = eqx.filter_eval_shape(
        lambda: DiT(
            resolution // 8, patch, 4, hidden, depth, heads, num_classes=1000, learn_sigma=True, key=jax.random.key(0)
        )
    )
    assert {k: list(v.shape) for k, v in official_state(abstract).items()} == official


def test_what_models_py_cannot_hold_is_refused(tmp_path):
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"text DiT \(context_dim=8\).*class labels only"):
        save_dit(DiT(8, 2, 4, 32, 1, 2, context_dim=8, key=key), tmp_path / "t.safetensors")
    with pytest.raises(ValueError, match=r"unconditional DiT \(num_classes=0\).*always adds a class embedding"):
        save_dit(DiT(8, 2, 4, 32, 1, 2, key=key), tmp_path / "u.safetensors")
    with pytest.raises(ValueError, match=r"DiT-S, whose 6 heads.*this model has 4"):
        save_dit(
            eqx.filter_eval_shape(lambda: DiT(8, 2, 4, 384, 12, 4, num_classes=10, key=key)), tmp_path / "h.safetensors"
        )
    with pytest.raises(ValueError, match=r"writes \.pt .* or \.safetensors, not 'm\.ckpt'"):
        save_dit(DiT(8, 2, 4, 32, 1, 2, num_classes=10, key=key), tmp_path / "m.ckpt")
    assert not list(tmp_path.iterdir())  # nothing written
