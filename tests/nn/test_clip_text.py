"""CLIPTextModel against transformers' PyTorch model: parity on committed fixtures (tools/) for both
pooling conventions, both activations, with and without a padding mask, and earlier hidden states;
config fields that must be honoured; loading by state_dict name (the "text_model." prefix, the
position_ids buffer, missing/unexpected/mis-shaped keys, fp16/bf16 files, mesh shardings);
unsupported options; and the CLIP-L/14 text tower at full size."""

import functools
import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from eqxdiff.nn import CLIPTextModel
from eqxdiff.nn.torch_weights import leaf_layouts
from eqxdiff.sharding import make_mesh, placement, state_shardings

DATA = Path(__file__).parents[1] / "data" / "clip_text"
WEIGHTS = "model.safetensors"
SUFFIX = {False: "", True: "_masked"}


@eqx.filter_jit
def outputs(clip: CLIPTextModel, input_ids, attention_mask) -> dict:
    """last_hidden_state, pooler_output and transformers' hidden_states[-2] and [0], one program."""
    last, pooled = clip(input_ids, attention_mask)
    penultimate, _ = clip(input_ids, attention_mask, hidden_layer=-2)
    embeddings, _ = clip(input_ids, attention_mask, hidden_layer=0)
    return {"last_hidden_state": last, "pooler_output": pooled, "penultimate": penultimate, "embeddings": embeddings}


def errors(clip: CLIPTextModel, ref, masked: bool) -> dict[str, float]:
    """Max abs difference to transformers' outputs (hidden states where the fixture has them).
    Unmasked references are matched with an all-ones mask (a no-op in both), so that both share one
    compiled program; the `attention_mask=None` path is checked in test_a_plain_pytree_of_arrays_passed_to_jit."""
    mask = ref["attention_mask"] if masked else np.ones_like(ref["attention_mask"])
    ours = outputs(clip, ref["input_ids"], mask)
    suffix = SUFFIX[masked]
    expected = {k: ref[k + suffix] for k in ("last_hidden_state", "pooler_output")}
    if f"hidden_states{suffix}" in ref:
        expected |= {"penultimate": ref[f"hidden_states{suffix}"][-2], "embeddings": ref[f"hidden_states{suffix}"][0]}
    return {k: float(np.abs(np.asarray(ours[k]) - v).max()) for k, v in expected.items()}


@functools.cache
def load(name: str) -> CLIPTextModel:
    return CLIPTextModel.from_transformers(DATA / name)


@functools.cache
def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / name / "reference.npz") as ref:
        return dict(ref)


def params(clip: CLIPTextModel) -> dict[str, np.ndarray]:
    """Every parameter by its (unprefixed) state_dict name, in our layout."""
    leaves = [x for x in jax.tree.leaves(clip) if eqx.is_array(x)]
    return {name: np.asarray(x) for name, x in zip(leaf_layouts(clip), leaves, strict=True)}


def stored(name: str) -> dict[str, np.ndarray]:
    """A fixture's safetensors file as numpy (bf16 through safe_open's flax reader)."""
    with safe_open(str(DATA / name / WEIGHTS), framework="flax") as file:
        return {k: np.asarray(file.get_tensor(k)) for k in file.keys()}


def folder_with(tmp_path: Path, state: dict[str, np.ndarray], source: str = "sd_like", **config) -> Path:
    """A transformers folder: `source`'s config.json updated with `config`, `state` as its weights."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(json.loads((DATA / source / "config.json").read_text()) | config))
    save_file(state, str(tmp_path / WEIGHTS))
    return tmp_path


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("name", ["sd_like", "eos_pooling"])
def test_matches_transformers(name, masked):
    ref = reference(name)
    err = errors(load(name), ref, masked)
    print(name, SUFFIX[masked], err)
    assert set(err) == {"last_hidden_state", "pooler_output", "penultimate", "embeddings"}
    assert max(err.values()) < 1e-4, err
    # The reference is not degenerate, and the mask changes the padded rows (only them: attention is causal).
    assert ref["pooler_output"].std() > 0.3
    changed = np.abs(ref["last_hidden_state"] - ref["last_hidden_state_masked"]).max(-1) > 0.1
    np.testing.assert_array_equal(changed, ref["attention_mask"] == 0)


def test_fixtures_tell_the_conventions_apart():
    """Parity on both fixtures proves each convention: sd_like has no id 2 (eos-id pooling would pool
    position 0), eos_pooling's largest id is never its eos (argmax pooling would pool elsewhere);
    sd_like runs quick_gelu and eos_pooling exact gelu (one activation for both fails one of them)."""
    configs = {name: json.loads((DATA / name / "config.json").read_text()) for name in ("sd_like", "eos_pooling")}
    assert [configs[n]["hidden_act"] for n in configs] == ["quick_gelu", "gelu"]
    assert [configs[n]["eos_token_id"] for n in configs] == [2, 3]
    assert not (reference("sd_like")["input_ids"] == 2).any()
    ids = reference("eos_pooling")["input_ids"]
    first_eos = np.argmax(ids == 3, axis=-1)
    assert (np.argmax(ids, axis=-1) != first_eos).all()  # argmax pooling would pick other rows
    assert ((ids == 3).sum(-1) == 2).any()  # a row with two eos: the first one is pooled
    ids = reference("sd_like")["input_ids"]
    assert (ids == 98).sum(-1).min() >= 1 and ((ids == 98).sum(-1) > 1).any()  # SD 1.x: padded with eos


@pytest.mark.parametrize(
    "where, index",
    [("encoder.layers.0.self_attn.q_proj.weight", (3, 5)), ("embeddings.position_embedding.weight", (1, 7))],
)
def test_one_perturbed_weight_fails_parity(where, index):
    clip = load("sd_like")

    def get(module):
        for part in where.split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        return module

    mutated = eqx.tree_at(get, clip, get(clip).at[index].add(0.05))
    err = errors(mutated, reference("sd_like"), masked=False)
    assert err["last_hidden_state"] > 1e-3, err


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_files_load_as_float32(dtype):
    clip = load(f"sd_like_{dtype}")
    state = stored(f"sd_like_{dtype}")
    floating = {str(v.dtype) for k, v in state.items() if not k.endswith("position_ids")}
    assert floating == {"float16" if dtype == "fp16" else "bfloat16"}
    # Exactly the fp32 weights rounded to that dtype, stored as float32 parameters.
    half = np.float16 if dtype == "fp16" else ml_dtypes.bfloat16
    full = params(load("sd_like"))
    for name, value in params(clip).items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, full[name].astype(half).astype(np.float32), err_msg=name)
    # Parity with transformers run in fp32 on the rounded weights, and close to the fp32 model.
    for masked in (False, True):
        err = errors(clip, reference(f"sd_like_{dtype}"), masked)
        assert max(err.values()) < 1e-4, err
    err_fp32 = errors(clip, reference("sd_like"), masked=False)
    assert max(err_fp32.values()) < (1e-2 if dtype == "fp16" else 1e-1), err_fp32


def test_keys_with_or_without_prefix_and_buffer(tmp_path):
    state = stored("sd_like")
    assert "text_model.embeddings.position_ids" in state and all(k.startswith("text_model.") for k in state)
    assert not any(k.startswith("text_model.") or "position_ids" in k for k in stored("eos_pooling"))
    expected = params(load("sd_like"))
    bare = {k.removeprefix("text_model."): v for k, v in state.items()}
    without_buffer = {k: v for k, v in bare.items() if "position_ids" not in k}
    for i, variant in enumerate([bare, without_buffer]):
        clip = CLIPTextModel.from_transformers(folder_with(tmp_path / str(i), variant))
        for name, value in params(clip).items():
            np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_missing_and_unexpected_keys_are_named(tmp_path):
    state = stored("sd_like")
    missing = {k: v for k, v in state.items() if k != "text_model.encoder.layers.1.mlp.fc2.bias"}
    with pytest.raises(ValueError, match=r"missing keys \(1\): encoder\.layers\.1\.mlp\.fc2\.bias"):
        CLIPTextModel.from_transformers(folder_with(tmp_path / "a", missing))
    extra = state | {"text_projection.weight": np.ones((32, 32), np.float32)}  # CLIPTextModelWithProjection's head
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): text_projection\.weight"):
        CLIPTextModel.from_transformers(folder_with(tmp_path / "b", extra))
    both = state | {"final_layer_norm.bias": state["text_model.final_layer_norm.bias"]}
    with pytest.raises(ValueError, match=r"both the parameter 'final_layer_norm\.bias'"):
        CLIPTextModel.from_transformers(folder_with(tmp_path / "c", both))


def test_wrong_shape_and_missing_file_are_named(tmp_path):
    state = stored("sd_like")
    state["text_model.encoder.layers.0.mlp.fc1.weight"] = state["text_model.encoder.layers.0.mlp.fc1.weight"][:36]
    with pytest.raises(ValueError, match=r"encoder\.layers\.0\.mlp\.fc1\.weight: shape \(36, 32\)"):
        CLIPTextModel.from_transformers(folder_with(tmp_path / "a", state))
    shutil.copy(DATA / "sd_like" / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").touch()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors does not exist.*pytorch_model\.bin"):
        CLIPTextModel.from_transformers(tmp_path)


SD_LIKE = json.loads((DATA / "sd_like" / "config.json").read_text())


@pytest.mark.parametrize(
    "option, value",
    [
        ("hidden_act", "relu"),
        ("eos_token_id", [2, 3]),
        ("model_type", "clip"),
        ("text_config", {"hidden_size": 32}),
        ("pruned_heads", {"0": [1]}),
        ("rope_theta", 10000.0),
        ("num_attention_heads", 5),
    ],
)
def test_unsupported_option_is_named(option, value):
    with pytest.raises(ValueError, match=option):
        eqx.filter_eval_shape(CLIPTextModel.from_config, SD_LIKE | {option: value}, key=jax.random.key(0))


def test_config_defaults_are_transformers():
    """An empty config is transformers' CLIPTextConfig() (the ViT-B/32 text tower, eos pooling)."""
    clip = eqx.filter_eval_shape(CLIPTextModel.from_config, {}, key=jax.random.key(0))
    assert clip.embeddings.token_embedding.weight.shape == (49408, 512)
    assert clip.embeddings.position_embedding.weight.shape == (77, 512)
    assert clip.num_layers == 12 and clip.encoder.layers[0].self_attn.num_heads == 8
    mlp = clip.encoder.layers[0].mlp
    assert mlp.fc1.weight.shape == (512, 2048) and mlp.hidden_act == "quick_gelu"
    assert clip.eos_token_id == 49407 and clip.final_layer_norm.eps == 1e-5


def test_too_many_tokens_and_bad_hidden_layer_raise():
    clip, ids = load("sd_like"), np.zeros((1, 17), np.int32)  # 16 positions
    with pytest.raises(ValueError, match="17 tokens, more than max_position_embeddings 16"):
        clip(ids)
    with pytest.raises(ValueError, match="hidden_layer 3 is not an index of 3 hidden states"):
        clip(ids[:, :4], hidden_layer=3)


def test_causal_false_lets_the_first_token_read_the_last():
    """CLIP is causal: a later token never changes an earlier state. A scratch tower built with
    causal=False reads both ways (its first digit must see "then" or "after")."""
    ids = np.array([[5, 7, 9, 3], [5, 7, 9, 4]], np.int32)  # differ in the last token only
    for causal in (True, False):
        clip = CLIPTextModel.from_config(dict(SD_LIKE, eos_token_id=3), key=jax.random.key(0), causal=causal)
        hidden, _ = clip(ids)
        first_changed = np.abs(np.asarray(hidden[0, :3] - hidden[1, :3])).max(axis=-1)
        if causal:  # equal up to summation order
            assert first_changed.max() < 1e-5, first_changed
        else:
            assert first_changed.min() > 1e-3, first_changed


def test_a_plain_pytree_of_arrays_passed_to_jit():
    """The frozen tower is an argument of a jitted step: every leaf an f32 array, nothing baked in."""
    clip, ref = load("sd_like"), reference("sd_like")
    assert all(isinstance(x, jax.Array) and x.dtype == np.float32 for x in jax.tree.leaves(clip))
    encode = jax.jit(lambda clip, ids: clip(ids))  # attention_mask=None
    hidden, pooled = encode(clip, ref["input_ids"])
    np.testing.assert_allclose(hidden, ref["last_hidden_state"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(pooled, ref["pooler_output"], rtol=0, atol=1e-4)
    doubled = jax.tree.map(lambda x: 2 * x, clip)
    assert np.abs(np.asarray(encode(doubled, ref["input_ids"])[1]) - pooled).max() > 0.1
    assert encode._cache_size() == 1  # new weights, same program


def test_weights_load_into_the_mesh_shardings():
    mesh, min_size = make_mesh(-1, 4), 256
    clip = CLIPTextModel.from_transformers(DATA / "sd_like", place=placement(mesh, min_size))
    abstract = eqx.filter_eval_shape(CLIPTextModel.from_config, SD_LIKE, key=jax.random.key(0))
    expected = jax.tree.leaves(state_shardings(abstract, mesh, min_size))
    assert [x.sharding for x in jax.tree.leaves(clip)] == expected
    assert sum(any(s.spec) for s in expected) >= 5  # the rule shards the larger matrices
    single = params(load("sd_like"))
    for name, value in params(clip).items():
        np.testing.assert_array_equal(value, single[name], err_msg=name)


FULL = json.loads((DATA / "full_size_shapes.json").read_text())["clip_l14"]


def test_full_size_architecture_has_transformers_keys_and_shapes():
    abstract = eqx.filter_eval_shape(CLIPTextModel.from_config, FULL["config"], key=jax.random.key(0))
    perms, torch_shapes = leaf_layouts(abstract), FULL["shapes"]
    assert set(perms) == set(torch_shapes) and len(perms) == 196
    leaves = jax.tree.leaves(abstract)
    ours = {n: tuple(x.shape) for n, x in zip(perms, leaves, strict=True)}
    assert ours == {n: tuple(torch_shapes[n][p] for p in perm) for n, perm in perms.items()}
    assert sum(np.prod(s) for s in ours.values()) == FULL["num_parameters"] == 123_060_480


@pytest.mark.slow  # 123M weights made and run; the quick tier keeps the full size's keys and shapes (above) and parity
def test_full_size_clip_l_runs():
    """CLIP-L/14's text tower from SD 1.x's config with random weights, one 77-token prompt. The
    weights tile one 2^20-value uniform draw: drawing 123M values (jax.random's threefry or numpy)
    would take most of the test's time. Each leaf starts at its own place in the draw: one start
    for all would make q, k and v equal and every layer the same: attention scores of q·q, unlike a tower's."""
    abstract = eqx.filter_eval_shape(CLIPTextModel.from_config, FULL["config"], key=jax.random.key(0))
    draw = np.random.default_rng(0).uniform(-0.05, 0.05, 2**20 + 7).astype(np.float32)
    shapes, treedef = jax.tree.flatten(abstract)
    tiled = [np.resize(np.roll(draw, -104_729 * i), s.shape) for i, s in enumerate(shapes)]  # a prime stride
    clip = jax.tree.unflatten(treedef, [jax.numpy.asarray(a) for a in tiled])
    attn = clip.encoder.layers[0].self_attn
    assert not np.array_equal(attn.q_proj.weight, attn.k_proj.weight)
    assert not np.array_equal(attn.k_proj.weight, attn.v_proj.weight)
    ids = np.full((1, 77), 49407, np.int32)
    ids[0, :6] = [49406, 320, 1125, 539, 320, 2368]  # bos, "a photo of a cat"
    hidden, pooled = eqx.filter_jit(lambda clip, ids: clip(ids))(clip, ids)
    assert hidden.shape == (1, 77, 768) and pooled.shape == (1, 768)
    assert np.isfinite(np.asarray(hidden)).all()
    np.testing.assert_array_equal(pooled[0], hidden[0, 6])  # legacy pooling: the first largest id


def test_variant_and_sharded_folders_load_the_weights_asked_for(tmp_path):
    """transformers' `variant=` (model.fp16.safetensors) and sharded weights (model.safetensors.index.json):
    the plain weights unless a variant is asked for, every file found by its index, parity kept."""
    from weight_folders import save_sharded  # tests/weight_folders.py

    folder = tmp_path / "text_encoder"
    folder.mkdir()
    shutil.copy(DATA / "sd_like" / "config.json", folder / "config.json")
    save_sharded(folder, stored("sd_like"), WEIGHTS, 3)
    shutil.copy(DATA / "sd_like_fp16" / WEIGHTS, folder / "model.fp16.safetensors")
    for variant, fixture in ((None, "sd_like"), ("fp16", "sd_like_fp16")):
        clip = CLIPTextModel.from_transformers(folder, variant=variant)
        expected = params(load(fixture))
        for name, value in params(clip).items():
            np.testing.assert_array_equal(value, expected[name], err_msg=name)
        err = errors(clip, reference(fixture), masked=True)
        assert max(err.values()) < 1e-4, err
    (folder / "model.safetensors.index.json").unlink()
    with pytest.warns(UserWarning, match=r"holds only its 'fp16' weights \(model\.fp16\.safetensors\): reading those"):
        only = CLIPTextModel.from_transformers(folder)  # the only weights left there
    expected = params(load("sd_like_fp16"))
    assert all(np.array_equal(value, expected[name]) for name, value in params(only).items())
