"""eqxdiff.pretrained.load_dit against facebookresearch/DiT's own code (tools/make_dit_fixtures.py): a
random-weight DiT, every trainable parameter moved off its init, saved as DiT publishes checkpoints
(bare state_dict, train.py's {"model", "ema", "opt", "args"}, safetensors), gives the official
forward(x, t, y) in NHWC; configurations and heads of the official table from the official shapes;
files naming code refused by name, wrong shapes refused naming the key."""

import json
import os
import pickle
import re
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from eqxdiff.nn import DiT
from eqxdiff.nn.dit import layer_norm as dit_layer_norm
from eqxdiff.weights.torch_pickle import Skipped, TorchFileError, read_torch_file
from eqxdiff.pretrained import load_dit
from eqxdiff.pretrained.dit_checkpoints import dit_config
from official_fixtures import call, reference, safetensors_state  # tests/official_fixtures.py
from official_fixtures import relative_errors as official_relative_errors

DATA = Path(__file__).parents[1] / "data" / "dit"
CONFIG, REF = reference(DATA)


def relative_errors(model) -> np.ndarray:
    """Per example: max |ours - official| / max |official|."""
    assert call(model, REF["x"], REF["t"], REF["y"]).shape == REF["out"].shape  # [b, h, w, 2c]: variance kept
    return official_relative_errors(model, REF)


@pytest.mark.parametrize("name", ["ema.safetensors", "ema_legacy.pt", "train_checkpoint.pt"])
def test_equals_the_official_forward(name):
    """Bare state_dict (legacy torch format, as DiT-XL-2-256x256.pt), train.py's zip checkpoint and
    safetensors; the batch's last label is the null class."""
    model = load_dit(DATA / name, num_heads=CONFIG["num_heads"])
    assert (model.num_classes, model.learn_sigma, model.image_size) == (10, True, 8)
    errors = relative_errors(model)
    assert errors.max() <= 1e-4  # measured 1.7e-5 (t = 999)
    # float32 sin/cos of t·freq: numpy's and torch's exp differ by an ulp, 6e-5 in the embedding at
    # t = 999; at t <= 17 (1.6e-6 measured) a tighter bound sees exact-vs-tanh GELU (1e-4 here).
    assert errors[REF["t"] <= 17].max() <= 1e-5
    assert REF["y"][-1] == model.num_classes


def test_train_checkpoint_loads_ema_not_model():
    """DiT's find_model takes "ema"; the fixture's "model" is the same network moved further."""
    checkpoint = read_torch_file(DATA / "train_checkpoint.pt", skip=("argparse.Namespace",))
    table = "y_embedder.embedding_table.weight"
    assert not np.allclose(checkpoint["model"][table], checkpoint["ema"][table])
    loaded = load_dit(DATA / "train_checkpoint.pt", num_heads=2).label_embed.weight
    np.testing.assert_array_equal(np.asarray(loaded), checkpoint["ema"][table])


def test_a_flattened_train_checkpoint_in_safetensors_loads_its_ema(tmp_path):
    """{"ema.*", "model.*"} keys in one safetensors file (the "model" half moved): the "ema." half."""
    ema = safetensors_state(DATA / "ema.safetensors")
    moved = {f"model.{k}": v + 1 for k, v in ema.items()}
    save_file({**moved, **{f"ema.{k}": v for k, v in ema.items()}}, tmp_path / "flat.safetensors")
    assert relative_errors(load_dit(tmp_path / "flat.safetensors", num_heads=2)).max() <= 1e-4


def test_args_namespace_is_skipped_not_built():
    """train.py's "args" reads as an inert placeholder; without the skip the reader refuses it."""
    checkpoint = read_torch_file(DATA / "train_checkpoint.pt", skip=("argparse.Namespace",))
    assert isinstance(checkpoint["args"], Skipped) and checkpoint["args"].global_name == "argparse.Namespace"
    assert not hasattr(checkpoint["args"], "model")  # its state (the flags) was dropped, not set
    assert set(checkpoint) == {"model", "ema", "opt", "args"} and "param_groups" in checkpoint["opt"]
    with pytest.raises(TorchFileError, match="refused the global argparse.Namespace"):
        read_torch_file(DATA / "train_checkpoint.pt")


class _RunsCode:
    def __reduce__(self):
        return os.system, ("touch dit_pickle_ran",)


def test_a_checkpoint_naming_code_is_refused_by_name(tmp_path, monkeypatch):
    """A train.py-shaped checkpoint whose "args" is os.system(...): refused naming it, nothing run."""
    monkeypatch.chdir(tmp_path)
    with zipfile.ZipFile(tmp_path / "evil.pt", "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"ema": {}, "args": _RunsCode()}, protocol=2))
    with pytest.raises(TorchFileError, match=re.escape(f"refused the global {os.system.__module__}.system")):
        load_dit(tmp_path / "evil.pt", num_heads=2)
    assert not (tmp_path / "dit_pickle_ran").exists()


# The published table (Peebles & Xie 2023, Table 1; models.py's DiT_models): depth, width, heads.
PUBLISHED = {"DiT-S": (12, 384, 6), "DiT-B": (12, 768, 12), "DiT-L": (24, 1024, 16), "DiT-XL": (28, 1152, 16)}


def test_configuration_and_heads_from_the_official_shapes():
    """Every state_dict shape of DiT-S/2, B/4, L/8, XL/2 (256²) and XL/2 (512²) as the official code
    builds them (1000 classes, learn_sigma): the configuration and the heads of the table."""
    shapes = json.loads((DATA / "official_shapes.json").read_text())
    assert len(shapes) == 5
    for entry, state in shapes.items():
        name, size = entry.split()
        family, patch = name.split("/")
        depth, width, heads = PUBLISHED[family]
        config = dit_config(state)
        assert config == dict(
            image_size=int(size) // 8,
            patch_size=int(patch),
            in_channels=4,
            hidden_size=width,
            depth=depth,
            num_heads=heads,
            mlp_ratio=4.0,
            num_classes=1000,
            learn_sigma=True,
        ), entry
        assert dit_config(state, num_heads=8)["num_heads"] == 8  # the override wins


def test_num_heads_outside_the_table():
    """The fixture's width 32 is in no official size: load_dit asks for num_heads; a wrong count
    that divides the width loads and computes something else; one that does not is refused."""
    with pytest.raises(ValueError, match="none of the official DiTs.*pass num_heads="):
        load_dit(DATA / "ema.safetensors")
    assert relative_errors(load_dit(DATA / "ema.safetensors", num_heads=4)).max() > 0.1  # measured 0.87
    with pytest.raises(ValueError, match="num_heads=3 does not divide the width 32"):
        load_dit(DATA / "ema.safetensors", num_heads=3)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.pop("pos_embed"), r"not a DiT state_dict .*no \['pos_embed'\]"),
        (lambda s: s.update({"pos_embed": s["pos_embed"] + 0.01}), "pos_embed is not DiT's fixed sin-cos"),
        (
            lambda s: s.update({"t_embedder.mlp.0.weight": s["t_embedder.mlp.0.weight"][:, :128]}),
            r"t_embedder.mlp.0.weight: shape \(32, 128\) .* expects \(256, 32\)",
        ),
        (
            lambda s: s.update({"final_layer.linear.weight": np.zeros((48, 32), np.float32)}),
            "final_layer.linear gives 48 values per 2×2 patch of 4 channels",
        ),
        (
            lambda s: s.update({"blocks.0.attn.qkv.weight": np.zeros((64, 32), np.float32)}),
            r"blocks.0.attn.qkv.weight: shape \(64, 32\)",
        ),
        (
            lambda s: s.update({"blocks.0.attn.q_norm.weight": np.ones(16, np.float32)}),
            r"unexpected keys \(1\): blocks.0.attn.q_norm.weight",
        ),
        (lambda s: s.pop("blocks.1.mlp.fc2.bias"), r"missing keys \(1\): blocks.1.fc2.bias"),
        (
            lambda s: [s.update({k.replace(".1.", ".2.", 1): s.pop(k)}) for k in list(s) if k.startswith("blocks.1.")],
            r"blocks \[0, 2\] are not numbered 0..1",
        ),
    ],
)
def test_a_state_that_is_not_the_official_dit_is_refused(edit, message, tmp_path):
    state = safetensors_state(DATA / "ema.safetensors")
    edit(state)
    save_file(state, tmp_path / "edited.safetensors")
    with pytest.raises(ValueError, match=message):
        load_dit(tmp_path / "edited.safetensors", num_heads=2)


def test_a_torch_file_that_is_no_dit_checkpoint_is_refused():
    with pytest.raises(TorchFileError, match=r"holds a dict with keys .*not DiT's state_dict or a train.py"):
        load_dit(Path(__file__).parents[1] / "data" / "torch_pickle" / "state_dict.pth")
    with pytest.raises(ValueError, match="not a DiT state_dict"):
        load_dit(
            Path(__file__).parents[1] / "data" / "autoencoder_kl" / "sd_like" / "diffusion_pytorch_model.safetensors"
        )


def test_dit_layer_norm_eps_is_the_official_1e6():
    """The LayerNorm DiT's blocks call, of [0, 2δ] halves, δ = 1e-3: ±δ / sqrt(δ² + eps) = ±0.7071 at
    eps 1e-6 (±0.3015 at 1e-5); too small an effect at DiT's activation sizes for the parity test."""
    x = jnp.zeros((1, 1, 32)).at[..., 16:].set(2e-3)
    expected = np.where(np.arange(32) < 16, -1.0, 1.0) / np.sqrt(2)
    np.testing.assert_allclose(np.asarray(dit_layer_norm(x))[0, 0], expected, rtol=1e-4)


def test_learn_sigma_doubles_the_output_channels_only():
    """The option adds c variance channels, zero at init as the rest; the default DiT is unchanged."""
    x, t = jnp.zeros((2, 8, 8, 3)), jnp.zeros(2)
    plain = DiT(8, 2, 3, 32, 1, 4, num_classes=10, key=jax.random.key(0))
    sigma = DiT(8, 2, 3, 32, 1, 4, num_classes=10, learn_sigma=True, key=jax.random.key(0))
    assert plain(x, t, jnp.array([1, 2])).shape == (2, 8, 8, 3)
    out = sigma(x, t, jnp.array([1, 2]))
    assert out.shape == (2, 8, 8, 6) and not np.asarray(out).any()
    assert sigma.final_linear.weight.shape == (32, 2 * 2 * 6) and plain.final_linear.weight.shape == (32, 2 * 2 * 3)
