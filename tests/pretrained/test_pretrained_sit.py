"""eqxdiff.pretrained.load_sit against willisma/SiT's own code (tools/make_sit_fixtures.py): a
random-weight SiT, every trainable parameter moved off its init, saved as SiT publishes checkpoints
(bare state_dict, train.py's {"model", "ema", "opt", "args"}, safetensors), gives the official
forward(x, t, y) — t in [0, 1], learn_sigma's second half dropped — as the first c channels, NHWC."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from eqxdiff.weights.torch_pickle import TorchFileError, read_torch_file
from eqxdiff.pretrained import load_sit
from official_fixtures import call, reference, safetensors_state  # tests/official_fixtures.py
from official_fixtures import relative_errors as official_relative_errors

DATA = Path(__file__).parents[1] / "data" / "sit"
CONFIG, REF = reference(DATA)


def relative_errors(model) -> np.ndarray:
    """Per example: max |ours[..., :c] - official| / max |official|."""
    c = CONFIG["in_channels"]
    assert call(model, REF["x"], REF["t"], REF["y"]).shape == REF["out"].shape[:-1] + (2 * c,)  # variance head kept
    return official_relative_errors(model, REF, c)


@pytest.mark.parametrize("name", ["ema.pt", "train_checkpoint.pt", "ema.safetensors"])
def test_equals_the_official_forward(name):
    """t in [0, 1] (0, 0.02, 0.5, 1) unscaled into the embedding; the last label the null class."""
    model = load_sit(DATA / name, num_heads=CONFIG["num_heads"])
    assert (model.num_classes, model.learn_sigma, model.image_size) == (10, True, 8)
    assert REF["y"][-1] == model.num_classes
    assert relative_errors(model).max() <= 1e-4  # measured 1.0e-6 (t = 0.02)


def test_train_checkpoint_loads_ema_not_model():
    """SiT's find_model takes "ema"; the fixture's "model" is the same network moved further."""
    checkpoint = read_torch_file(DATA / "train_checkpoint.pt", skip=("argparse.Namespace",))
    table = "y_embedder.embedding_table.weight"
    assert not np.allclose(checkpoint["model"][table], checkpoint["ema"][table])
    loaded = load_sit(DATA / "train_checkpoint.pt", num_heads=2).label_embed.weight
    np.testing.assert_array_equal(np.asarray(loaded), checkpoint["ema"][table])


def test_t_is_read_as_sits_time_not_dits_index():
    """The same network given t·1000 (DiT's scale) computes something else: the test sees the scale."""
    model = load_sit(DATA / "ema.safetensors", num_heads=2)
    scaled = np.asarray(call(model, jnp.asarray(REF["x"]), jnp.asarray(REF["t"] * 1000), jnp.asarray(REF["y"])))
    c = CONFIG["in_channels"]
    assert np.abs(scaled[1:, ..., :c] - REF["out"][1:]).max() > 0.1 * np.abs(REF["out"]).max()


def test_errors_name_sit():
    """A width outside the table asks for num_heads naming SiT's sizes; no state_dict names SiT's repo."""
    with pytest.raises(ValueError, match=r"none of the official SiTs.*SiT-XL \(depth 28, width 1152\): 16"):
        load_sit(DATA / "ema.safetensors")
    with pytest.raises(TorchFileError, match="not SiT's state_dict or a train.py"):
        load_sit(Path(__file__).parents[1] / "data" / "torch_pickle" / "state_dict.pth")


def test_a_changed_pos_embed_is_refused(tmp_path):
    state = safetensors_state(DATA / "ema.safetensors")
    state["pos_embed"] = state["pos_embed"] + 0.01
    save_file(state, tmp_path / "edited.safetensors")
    with pytest.raises(ValueError, match="pos_embed is not SiT's fixed sin-cos"):
        load_sit(tmp_path / "edited.safetensors", num_heads=2)
