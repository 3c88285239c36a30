"""A full transformers `CLIPModel` folder (text and vision towers, both projections, logit_scale; written
by tools/make_clip_model_fixture.py) loads its text tower as transformers' `CLIPTextModel` and
`CLIPTextModelWithProjection` load it from that folder: same outputs, vision keys left unread, a
plain text tower's folder still refusing keys it has no place for."""

import json
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from eqxdiff.nn import CLIPTextModel, CLIPTextModelWithProjection

FOLDER = Path(__file__).parents[1] / "data" / "clip_text" / "clip_model"
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(FOLDER / "reference.npz") as f:
        return dict(f)


def stored() -> dict[str, np.ndarray]:
    with safe_open(str(FOLDER / WEIGHTS), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def copy_with(tmp_path: Path, state: dict[str, np.ndarray], config: dict | None = None) -> Path:
    """The fixture's folder with other weights (and config)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = config or json.loads((FOLDER / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(state, str(tmp_path / WEIGHTS))
    return tmp_path


@eqx.filter_jit
def run(model, input_ids, attention_mask):
    return model(input_ids, attention_mask)


def test_the_fixture_is_a_full_clip_model():
    config, keys = json.loads((FOLDER / "config.json").read_text()), set(stored())
    assert config["model_type"] == "clip" and {"text_config", "vision_config"} <= set(config)
    assert {"logit_scale", "text_projection.weight", "visual_projection.weight"} <= keys
    assert any(k.startswith("vision_model.") for k in keys) and any(k.startswith("text_model.") for k in keys)


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
def test_text_tower_matches_transformers_from_the_clip_folder(ref, masked):
    suffix = "_masked" if masked else ""
    mask = ref["attention_mask"] if masked else np.ones_like(ref["attention_mask"])
    hidden, pooled = run(CLIPTextModel.from_transformers(FOLDER), ref["input_ids"], mask)
    np.testing.assert_allclose(hidden, ref[f"last_hidden_state{suffix}"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(pooled, ref[f"pooler_output{suffix}"], rtol=0, atol=1e-5)
    hidden_p, embeds = run(CLIPTextModelWithProjection.from_transformers(FOLDER), ref["input_ids"], mask)
    np.testing.assert_array_equal(hidden_p, hidden)
    assert embeds.shape == (3, 12)
    np.testing.assert_allclose(embeds, ref[f"text_embeds{suffix}"], rtol=0, atol=1e-5)
    assert np.abs(ref[f"text_embeds{suffix}"]).max() > 0.3  # not degenerate


def test_text_embeds_are_clip_models_text_features(ref):
    """CLIPModel.get_text_features (the fixture's own model) = CLIPTextModelWithProjection's text_embeds."""
    np.testing.assert_array_equal(ref["get_text_features"], ref["text_embeds"])


def test_only_the_text_tower_is_read(tmp_path):
    """Every vision tensor replaced by NaN changes nothing; a text tensor so replaced does."""
    state = stored()
    poisoned = {
        k: np.full_like(v, np.nan) if k.startswith(("vision_model.", "visual_projection", "logit_scale")) else v
        for k, v in state.items()
    }
    clip = CLIPTextModel.from_transformers(copy_with(tmp_path / "a", poisoned))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(clip))
    poisoned["text_model.final_layer_norm.bias"] = np.full_like(state["text_model.final_layer_norm.bias"], np.nan)
    clip = CLIPTextModel.from_transformers(copy_with(tmp_path / "b", poisoned))
    assert np.isnan(np.asarray(clip.final_layer_norm.bias)).all()


def test_missing_text_keys_and_foreign_keys_are_named(tmp_path):
    state = stored()
    missing = {k: v for k, v in state.items() if k != "text_model.encoder.layers.1.mlp.fc2.bias"}
    with pytest.raises(ValueError, match=r"missing keys \(1\): encoder\.layers\.1\.mlp\.fc2\.bias"):
        CLIPTextModel.from_transformers(copy_with(tmp_path / "a", missing))
    with pytest.raises(ValueError, match=r"missing keys \(1\): text_projection\.weight"):
        CLIPTextModelWithProjection.from_transformers(
            copy_with(tmp_path / "b", {k: v for k, v in state.items() if k != "text_projection.weight"})
        )
    foreign = state | {"audio_model.proj.weight": np.ones((2, 2), np.float32)}  # no tower of a CLIPModel
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): audio_model\.proj\.weight"):
        CLIPTextModel.from_transformers(copy_with(tmp_path / "c", foreign))


def test_a_text_tower_folder_still_refuses_vision_keys(tmp_path):
    """Only a full CLIPModel's config says the vision keys belong to another tower: a CLIPTextModel
    folder holding them is a wrong file, named."""
    state = stored()
    text_only = {k: v for k, v in state.items() if k.startswith("text_model.")}
    config = json.loads((FOLDER / "config.json").read_text())["text_config"]
    clip = CLIPTextModel.from_transformers(copy_with(tmp_path / "a", text_only, config))
    full = CLIPTextModel.from_transformers(FOLDER)
    for a, b in zip(jax.tree.leaves(clip), jax.tree.leaves(full), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): vision_model\.post_layernorm\.bias"):
        CLIPTextModel.from_transformers(
            copy_with(
                tmp_path / "b",
                text_only | {"vision_model.post_layernorm.bias": state["vision_model.post_layernorm.bias"]},
                config,
            )
        )


def test_with_projection_reads_a_text_encoder_2_folder(tmp_path, ref):
    """SDXL's text_encoder_2/ layout: the text tower's config (projection_dim in it), `text_model.*` and
    `text_projection.weight`, no vision keys; the same text_embeds."""
    state = {k: v for k, v in stored().items() if k.startswith(("text_model.", "text_projection."))}
    config = json.loads((FOLDER / "config.json").read_text())["text_config"]
    model = CLIPTextModelWithProjection.from_transformers(copy_with(tmp_path, state, config))
    _, embeds = run(model, ref["input_ids"], np.ones_like(ref["input_ids"]))
    np.testing.assert_allclose(embeds, ref["text_embeds"], rtol=0, atol=1e-5)
