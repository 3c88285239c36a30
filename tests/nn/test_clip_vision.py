"""CLIP's vision tower (`CLIPVisionModel`, `CLIPVisionModelWithProjection`) and the full `CLIPModel` against
transformers' PyTorch models on random weights (tools/make_clip_vision_fixtures.py): from a full CLIPModel folder
and from a projection tower's own folder, at the config's image size and resized position embeddings at another;
image and text embeddings in one space (CLIPModel's logits); loading by the saved keys; refusals."""

import functools
import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from eqxdiff.nn import CLIPModel, CLIPVisionModel, CLIPVisionModelWithProjection

DATA = Path(__file__).parents[1] / "data" / "clip_vision"
FULL = DATA / "clip_model"


@functools.cache
def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / name / "reference.npz") as f:
        return dict(f)


def relative(ours, theirs) -> float:
    assert ours.shape == theirs.shape
    return float(np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max())


@eqx.filter_jit
def tower_outputs(tower: CLIPVisionModel, pixels, other):
    return tower(pixels), tower(other, interpolate_pos_encoding=True)


def test_vision_tower_matches_transformers_from_a_clip_folder():
    ref = reference("clip_model")
    (hidden, pooled), (hidden_o, pooled_o) = tower_outputs(
        CLIPVisionModel.from_transformers(FULL), ref["pixels"], ref["pixels_other"]
    )
    assert relative(hidden, ref["last_hidden_state"]) <= 1e-4 and relative(pooled, ref["pooler_output"]) <= 1e-4
    assert hidden_o.shape == (2, 1 + 6 * 5, 32)  # 24×20 images, patch 4: the 4×4 grid resized to 6×5
    assert relative(hidden_o, ref["last_hidden_state_other"]) <= 1e-4
    assert relative(pooled_o, ref["pooler_output_other"]) <= 1e-4


def test_projection_towers_match_transformers():
    ref = reference("clip_model")
    _, embeds = CLIPVisionModelWithProjection.from_transformers(FULL)(ref["pixels"])
    assert relative(embeds, ref["image_embeds"]) <= 1e-4
    alone = reference("with_projection")  # its own save_pretrained folder: gelu, eps 1e-6, projection 10
    hidden, embeds = CLIPVisionModelWithProjection.from_transformers(DATA / "with_projection")(alone["pixels"])
    assert relative(hidden, alone["last_hidden_state"]) <= 1e-4 and relative(embeds, alone["image_embeds"]) <= 1e-4


def test_clip_model_embeds_images_and_texts_in_one_space():
    """CLIPModel's get_image_features, get_text_features (masked) and logits_per_image = e^s·cos(image, text)."""
    ref = reference("clip_model")
    model = CLIPModel.from_transformers(FULL)
    images = model.get_image_features(ref["pixels"])
    texts = model.get_text_features(ref["input_ids"], ref["attention_mask"])
    assert relative(images, ref["get_image_features"]) <= 1e-4 and relative(texts, ref["get_text_features"]) <= 1e-4
    unit = lambda v: v / jnp.linalg.norm(v, axis=-1, keepdims=True)  # noqa: E731
    logits = jnp.exp(model.logit_scale) * unit(images) @ unit(texts).T
    assert relative(logits, ref["logits_per_image"]) <= 1e-4
    assert float(model.logit_scale) == 1.5


def test_other_sizes_need_interpolate_pos_encoding():
    tower = CLIPVisionModel.from_transformers(FULL)
    with pytest.raises(ValueError, match=r"a 6×5 patch grid, the model's is 4×4.*interpolate_pos_encoding=True"):
        tower(reference("clip_model")["pixels_other"])


def test_only_the_vision_tower_is_read_and_foreign_keys_are_named(tmp_path):
    state = load_file(str(FULL / "model.safetensors"))
    config = json.loads((FULL / "config.json").read_text())

    def folder(name: str, state: dict, config: dict = config) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        save_file(state, str(tmp_path / name / "model.safetensors"))
        return tmp_path / name

    poisoned = {
        k: np.full_like(v, np.nan) if k.startswith(("text_model.", "text_projection", "logit_scale")) else v
        for k, v in state.items()
    }
    tower = CLIPVisionModelWithProjection.from_transformers(folder("a", poisoned))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tower))
    missing = {k: v for k, v in state.items() if k != "vision_model.pre_layrnorm.bias"}
    with pytest.raises(ValueError, match=r"missing keys \(1\): vision_model\.pre_layrnorm\.bias"):
        CLIPModel.from_transformers(folder("b", missing))
    with pytest.raises(ValueError, match=r"missing keys \(1\): pre_layrnorm\.bias"):
        CLIPVisionModel.from_transformers(tmp_path / "b")
    tower_only = {k: v for k, v in state.items() if k.startswith("vision_model.")}
    extra = tower_only | {"text_projection.weight": state["text_projection.weight"]}
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): text_projection\.weight"):
        CLIPVisionModel.from_transformers(folder("c", extra, config["vision_config"]))  # a tower's folder: refused


@pytest.mark.parametrize(
    "option, value",
    [
        ("hidden_act", "relu"),
        ("patch_size", [4, 2]),
        ("model_type", "siglip"),
        ("num_attention_heads", 5),
        ("use_rope", True),
    ],
)
def test_unsupported_option_is_named(option, value):
    config = json.loads((DATA / "with_projection" / "config.json").read_text())
    with pytest.raises(ValueError, match=option):
        eqx.filter_eval_shape(CLIPVisionModel.from_config, config | {option: value}, key=jax.random.key(0))


def test_a_legacy_vision_config_loads():
    """transformers 4 wrote PretrainedConfig's generic fields into openai's vision_config (null token ids,
    generation settings): read as the shaping fields alone."""
    config = json.loads((DATA / "with_projection" / "config.json").read_text())
    legacy = config | {
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "num_beams": 1,
        "torch_dtype": None,
        "output_attentions": False,
        "tie_word_embeddings": True,
    }
    tower = eqx.filter_eval_shape(CLIPVisionModel.from_config, legacy, key=jax.random.key(0))
    assert tower.embeddings.position_embedding.weight.shape == (4 * 4 + 1, 24)
