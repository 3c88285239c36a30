"""AutoencoderKL against diffusers' PyTorch model: parity on committed fixtures (tools/), loading
by state_dict name (missing, unexpected, renamed, mis-shaped keys; fp16/bf16 files; mesh
shardings), unsupported options, and the real SD VAE architecture at full size."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import main as train_main  # train/main.py
from eqxdiff import generate
from eqxdiff.autoencoders import describe_autoencoder, open_autoencoder
from eqxdiff.run.codecs import Latents
from eqxdiff.run.conditions import Labels
from eqxdiff.diffusion import EDMSchedule
from eqxdiff.nn import AutoencoderKL
from eqxdiff.nn.torch_weights import leaf_layouts
from eqxdiff.sharding import make_mesh, placement, state_shardings
from weight_folders import save_sharded  # tests/weight_folders.py

DATA = Path(__file__).parents[1] / "data" / "autoencoder_kl"
WEIGHTS = "diffusion_pytorch_model.safetensors"
encode = eqx.filter_jit(lambda vae, x: vae.encode(x))
decode = eqx.filter_jit(lambda vae, z: vae.decode(z))


def errors(vae: AutoencoderKL, ref) -> dict[str, float]:
    """Max abs difference to diffusers' outputs for mean, logvar and decode(z)."""
    mean, logvar = encode(vae, ref["x"])
    ours = {"mean": mean, "logvar": logvar, "decoded": decode(vae, ref["z"])}
    return {k: float(np.abs(np.asarray(v) - ref[k]).max()) for k, v in ours.items()}


def params(vae: AutoencoderKL) -> dict[str, np.ndarray]:
    """Every parameter by its state_dict name, in our layout."""
    leaves = [x for x in jax.tree.leaves(vae) if eqx.is_array(x)]
    return {name: np.asarray(x) for name, x in zip(leaf_layouts(vae), leaves, strict=True)}


def folder_with(tmp_path: Path, state: dict[str, np.ndarray], source: str = "sd_like") -> Path:
    """A diffusers folder: `source`'s config.json with `state` as its weights."""
    tmp_path.mkdir(exist_ok=True)
    shutil.copy(DATA / source / "config.json", tmp_path / "config.json")
    save_file(state, str(tmp_path / WEIGHTS))
    return tmp_path


# The port is within 4e-6 of diffusers on every fixture; GroupNorm's eps at torch's 1e-5 instead of
# diffusers' 1e-6 (the classic port bug) moves every output by 6.5e-5 to 4.5e-4: the bound sits between.
TOL = 2e-5


@pytest.mark.parametrize("name", ["sd_like", "flux_like", "no_attention", "non_square"])
def test_matches_diffusers(name):
    config = json.loads((DATA / name / "config.json").read_text())
    ref = np.load(DATA / name / "reference.npz")
    vae = AutoencoderKL.from_diffusers(DATA / name)
    assert vae.scaling_factor == config["scaling_factor"]
    assert vae.shift_factor == (config["shift_factor"] or 0.0)
    err = errors(vae, ref)
    assert max(err.values()) < TOL, err
    assert np.abs(ref["decoded"]).max() > 0.5 and ref["logvar"].std() > 0.1  # the reference is not degenerate
    if name == "non_square":
        assert ref["x"].shape[1:3] == (16, 24) and ref["z"].shape[1:3] == (8, 12)


@pytest.mark.parametrize(
    "where, output",
    [("encoder.down_blocks.1.resnets.0.conv2", "mean"), ("decoder.up_blocks.0.resnets.1.conv1", "decoded")],
)
def test_one_zeroed_conv_fails_parity(where, output):
    vae = AutoencoderKL.from_diffusers(DATA / "sd_like")

    def get(module):
        for part in f"{where}.weight".split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        return module

    mutated = eqx.tree_at(get, vae, get(vae) * 0)
    assert errors(mutated, np.load(DATA / "sd_like" / "reference.npz"))[output] > 1e-3


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_files_load_as_float32(dtype):
    vae = AutoencoderKL.from_diffusers(DATA / f"sd_like_{dtype}")
    stored = load_file(str(DATA / f"sd_like_{dtype}" / WEIGHTS))
    assert {str(v.dtype) for v in stored.values()} == {"float16" if dtype == "fp16" else "bfloat16"}
    # Exactly the fp32 weights rounded to that dtype, stored as float32 parameters.
    half = np.float16 if dtype == "fp16" else ml_dtypes.bfloat16
    full = params(AutoencoderKL.from_diffusers(DATA / "sd_like"))
    for name, value in params(vae).items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, full[name].astype(half).astype(np.float32), err_msg=name)
    # Parity with diffusers run in fp32 on the rounded weights, and close to the fp32 model.
    err = errors(vae, np.load(DATA / f"sd_like_{dtype}" / "reference.npz"))
    assert max(err.values()) < TOL, err
    err_fp32 = errors(vae, np.load(DATA / "sd_like" / "reference.npz"))
    assert max(err_fp32.values()) < (1e-2 if dtype == "fp16" else 1e-1), err_fp32


def test_missing_and_unexpected_keys_are_named(tmp_path):
    state = load_file(str(DATA / "sd_like" / WEIGHTS))
    missing = {k: v for k, v in state.items() if k != "decoder.mid_block.attentions.0.to_k.bias"}
    with pytest.raises(ValueError, match=r"missing keys \(1\): decoder\.mid_block\.attentions\.0\.to_k\.bias"):
        AutoencoderKL.from_diffusers(folder_with(tmp_path / "a", missing))
    extra = state | {"encoder.extra_norm.weight": np.ones(4, np.float32)}
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): encoder\.extra_norm\.weight"):
        AutoencoderKL.from_diffusers(folder_with(tmp_path / "b", extra))


def test_missing_weights_file_is_named(tmp_path):
    shutil.copy(DATA / "sd_like" / "config.json", tmp_path / "config.json")
    for variant in ("bf16", "fp16"):  # two variants, no plain weights: the choice is named (one alone is read)
        (tmp_path / f"diffusion_pytorch_model.{variant}.safetensors").touch()
    with pytest.raises(FileNotFoundError, match=r"diffusion_pytorch_model\.safetensors does not exist.*fp16"):
        AutoencoderKL.from_diffusers(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    state = load_file(str(DATA / "sd_like" / WEIGHTS))
    state["encoder.conv_in.weight"] = state["encoder.conv_in.weight"][:, :2]  # 2 input channels, not 3
    with pytest.raises(ValueError, match=r"encoder\.conv_in\.weight: shape \(4, 2, 3, 3\)"):
        AutoencoderKL.from_diffusers(folder_with(tmp_path, state))


def test_old_attention_names_load_the_same_weights(tmp_path):
    old = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    state = load_file(str(DATA / "sd_like" / WEIGHTS))
    renamed = {}
    for k, v in state.items():
        for new, was in old.items():
            k = k.replace(f"attentions.0.{new}.", f"attentions.0.{was}.")
        renamed[k] = v
    assert sum(".query." in k or ".proj_attn." in k for k in renamed) == 8  # 2 blocks x (weight, bias) x 2
    vae = AutoencoderKL.from_diffusers(folder_with(tmp_path / "old", renamed))
    expected = params(AutoencoderKL.from_diffusers(DATA / "sd_like"))
    for name, value in params(vae).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    both = state | {"encoder.mid_block.attentions.0.query.weight": state["encoder.mid_block.attentions.0.to_q.weight"]}
    with pytest.raises(ValueError, match=r"both the parameter 'encoder\.mid_block\.attentions\.0\.to_q\.weight'"):
        AutoencoderKL.from_diffusers(folder_with(tmp_path / "both", both))


SD_LIKE = json.loads((DATA / "sd_like" / "config.json").read_text())


@pytest.mark.parametrize(
    "option, value",
    [
        ("down_block_types", ["DownEncoderBlock2D", "DownEncoderBlock2D", "AttnDownEncoderBlock2D"]),
        ("up_block_types", ["UpDecoderBlock2D"]),
        ("act_fn", "gelu"),
        ("_class_name", "AutoencoderTiny"),
    ],
)
def test_unsupported_option_is_named(option, value):
    with pytest.raises(ValueError, match=option):
        eqx.filter_eval_shape(AutoencoderKL.from_config, SD_LIKE | {option: value}, key=jax.random.key(0))


def test_benign_fields_and_defaults():
    config = {k: v for k, v in SD_LIKE.items() if k != "shift_factor"}
    config |= {"force_upcast": False, "sample_size": [64, 64], "_name_or_path": "x", "_use_default_values": ["a"]}
    vae = eqx.filter_eval_shape(AutoencoderKL.from_config, config, key=jax.random.key(0))
    assert vae.shift_factor == 0.0 and vae.downsample_factor == 4
    with pytest.raises(ValueError, match="divisible by 4"):
        vae.encode(jax.numpy.zeros((1, 10, 12, 3)))


def test_weights_load_into_the_mesh_shardings():
    mesh, min_size = make_mesh(-1, 4), 256
    vae = AutoencoderKL.from_diffusers(DATA / "sd_like", place=placement(mesh, min_size))
    abstract = eqx.filter_eval_shape(AutoencoderKL.from_config, SD_LIKE, key=jax.random.key(0))
    expected = jax.tree.leaves(state_shardings(abstract, mesh, min_size))
    leaves = [x for x in jax.tree.leaves(vae) if eqx.is_array(x)]
    assert [x.sharding for x in leaves] == expected
    assert sum(any(s.spec) for s in expected) >= 10  # the rule shards the larger convs
    single = params(AutoencoderKL.from_diffusers(DATA / "sd_like"))
    for name, value in params(vae).items():
        np.testing.assert_array_equal(value, single[name], err_msg=name)


def test_without_mesh_weights_are_on_one_device():
    vae = AutoencoderKL.from_diffusers(DATA / "no_attention")
    assert all(x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(vae) if eqx.is_array(x))


FULL = json.loads((DATA / "full_size_shapes.json").read_text())


@pytest.mark.parametrize("name", ["sd", "flux"])
def test_full_size_architecture_has_diffusers_keys_and_shapes(name):
    abstract = eqx.filter_eval_shape(AutoencoderKL.from_config, FULL[name]["config"], key=jax.random.key(0))
    perms, torch_shapes = leaf_layouts(abstract), FULL[name]["shapes"]
    assert set(perms) == set(torch_shapes)
    leaves = [x for x in jax.tree.leaves(abstract) if isinstance(x, jax.ShapeDtypeStruct)]
    ours = {n: tuple(x.shape) for n, x in zip(perms, leaves, strict=True)}
    assert ours == {n: tuple(torch_shapes[n][p] for p in perm) for n, perm in perms.items()}
    assert sum(np.prod(s) for s in ours.values()) == FULL[name]["num_parameters"]
    assert FULL["sd"]["num_parameters"] == 83_653_863  # diffusers' num_parameters() of the SD VAE


@pytest.mark.slow
def test_full_size_sd_vae_loads_every_key_and_runs(tmp_path):
    """A random fp16 checkpoint with diffusers' SD VAE keys and shapes: every key is consumed (the
    load is strict), and encode/decode at 64x64 give the right shapes and finite values. The weights tile
    one 2^20-value normal draw, each key from its own place in it (tests/nn/test_clip_text.py's full-size
    CLIP-L): drawing 83.7M values took a quarter of the test's time."""
    draw = np.random.default_rng(0).standard_normal(2**20 + 7, np.float32)
    state = {}
    for i, (key, shape) in enumerate(FULL["sd"]["shapes"].items()):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 0
        scale = 1 / np.sqrt(fan_in) if fan_in else 0.1
        base = 1.0 if key.endswith("weight") and len(shape) == 1 else 0.0  # GroupNorm scales around 1
        state[key] = (base + scale * np.resize(np.roll(draw, -104_729 * i), shape)).astype(np.float16)  # a prime stride
    (tmp_path / "config.json").write_text(json.dumps(FULL["sd"]["config"]))
    save_file(state, str(tmp_path / WEIGHTS))
    vae = AutoencoderKL.from_diffusers(tmp_path)
    assert sum(x.size for x in jax.tree.leaves(vae) if eqx.is_array(x)) == 83_653_863
    x = np.random.default_rng(1).uniform(-1, 1, (1, 64, 64, 3)).astype(np.float32)
    mean, logvar = encode(vae, x)
    assert mean.shape == logvar.shape == (1, 8, 8, 4)
    y = decode(vae, mean)
    assert y.shape == (1, 64, 64, 3)
    assert all(np.isfinite(np.asarray(a)).all() for a in (mean, logvar, y))
    assert -30 <= float(logvar.min()) and float(logvar.max()) <= 20


# --- the files people have: variants, shards, single LDM files; config keys -----------------------

VARIANT = "diffusion_pytorch_model.fp16.safetensors"


def assert_same_params(vae: AutoencoderKL, expected: dict[str, np.ndarray]) -> None:
    got = params(vae)
    assert set(got) == set(expected)
    for name, value in got.items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_variant_and_sharded_folders_load_the_weights_asked_for(tmp_path):
    plain, half = load_file(str(DATA / "sd_like" / WEIGHTS)), load_file(str(DATA / "sd_like_fp16" / WEIGHTS))
    expected = {
        None: params(AutoencoderKL.from_diffusers(DATA / "sd_like")),
        "fp16": params(AutoencoderKL.from_diffusers(DATA / "sd_like_fp16")),
    }
    both = folder_with(tmp_path / "both", plain)
    save_file(half, str(both / VARIANT))
    for variant in (None, "fp16"):  # diffusers' variant=: None is the plain file, whatever else is there
        assert_same_params(AutoencoderKL.from_diffusers(both, variant=variant), expected[variant])
    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(DATA / "sd_like" / "config.json", shards / "config.json")
    plain_shards = save_sharded(shards, plain, WEIGHTS, 3)
    save_sharded(shards, half, WEIGHTS, 2, variant="fp16")
    assert len(list(shards.glob("*.safetensors"))) == 5
    for variant, fixture in ((None, "sd_like"), ("fp16", "sd_like_fp16")):
        vae = AutoencoderKL.from_diffusers(shards, variant=variant)
        assert_same_params(vae, expected[variant])
        err = errors(vae, np.load(DATA / fixture / "reference.npz"))
        assert max(err.values()) < TOL, err
    # --vae's record of the weights: the plain shards' bytes, in order.
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in plain_shards)).hexdigest()
    assert describe_autoencoder(str(shards))["weights_sha256"] == digest


def test_variant_choice_is_named(tmp_path):
    half = load_file(str(DATA / "sd_like_fp16" / WEIGHTS))
    folder = tmp_path / "variants_only"
    folder.mkdir()
    shutil.copy(DATA / "sd_like" / "config.json", folder / "config.json")
    save_file(half, str(folder / VARIANT))
    save_file(half, str(folder / "diffusion_pytorch_model.bf16.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"pass variant= one of \['bf16', 'fp16'\]"):
        AutoencoderKL.from_diffusers(folder)
    with pytest.raises(FileNotFoundError, match=r"fp32\.safetensors does not exist.*one of \['bf16', 'fp16'\]"):
        AutoencoderKL.from_diffusers(folder, variant="fp32")
    with pytest.raises(FileNotFoundError, match=r"not a diffusers VAE folder.*variant= one of \['bf16', 'fp16'\]"):
        open_autoencoder(str(folder))  # the --vae spec
    save_sharded(folder, half, WEIGHTS, 2, variant="fp16")  # the fp16 weights twice: a whole file and shards
    with pytest.raises(ValueError, match=r"both diffusion_pytorch_model\.fp16\.safetensors and the shards of .*\.fp16"):
        AutoencoderKL.from_diffusers(folder, variant="fp16")


def test_bad_shards_are_named(tmp_path):
    state = load_file(str(DATA / "sd_like" / WEIGHTS))
    shutil.copy(DATA / "sd_like" / "config.json", tmp_path / "config.json")
    first, second = save_sharded(tmp_path, state, WEIGHTS, 2)
    moved = sorted(load_file(str(second)))[0]  # a key the index lists in the second shard, now in the first
    save_file(load_file(str(first)) | {moved: state[moved]}, str(first))
    with pytest.raises(ValueError, match=rf"{first.name} does not hold the keys the index lists.*{re.escape(moved)}"):
        AutoencoderKL.from_diffusers(tmp_path)
    second.unlink()
    with pytest.raises(FileNotFoundError, match=rf"shard files missing: \['{second.name}'\]"):
        AutoencoderKL.from_diffusers(tmp_path)


LDM = Path(__file__).parents[1] / "data" / "ldm_vae"
SINGLE_FILES = {"sd_checkpoint": "sd_checkpoint.safetensors", "flux_ae": "ae.safetensors"}


@pytest.mark.parametrize("name", SINGLE_FILES)
def test_single_ldm_file_matches_diffusers_converter(name):
    """The fixtures' references are diffusers' AutoencoderKL holding what its own
    convert_ldm_vae_checkpoint made of the file (tools/make_ldm_vae_fixtures.py)."""
    config = json.loads((LDM / name / "config.json").read_text())
    ref = np.load(LDM / name / "reference.npz")
    vae = AutoencoderKL.from_single_file(LDM / name / SINGLE_FILES[name], config=LDM / name)
    assert (vae.scaling_factor, vae.shift_factor) == (config["scaling_factor"], config.get("shift_factor", 0.0))
    assert (vae.quant_conv is None) == (name == "flux_ae")
    err = errors(vae, ref)
    assert max(err.values()) < TOL, err
    assert np.abs(ref["decoded"]).max() > 0.5 and ref["logvar"].std() > 0.1


def test_single_file_forms_and_mistakes(tmp_path):
    state = load_file(str(LDM / "flux_ae" / "ae.safetensors"))
    config = json.loads((LDM / "flux_ae" / "config.json").read_text())
    expected = params(AutoencoderKL.from_single_file(LDM / "flux_ae" / "ae.safetensors", config=config))
    # Attention projections stored as linear weights [c, c] (not LDM's 1x1 convs) are the same map.
    linear = {k: v[:, :, 0, 0] if ".attn_1." in k and v.ndim == 4 else v for k, v in state.items()}
    assert sum(v.ndim == 2 for v in linear.values()) == 8  # q, k, v, proj_out in two mid blocks
    save_file(linear, str(tmp_path / "linear.safetensors"))
    assert_same_params(AutoencoderKL.from_single_file(tmp_path / "linear.safetensors", config=config), expected)
    # The shapes give the architecture: a config with only what they cannot tell is enough.
    minimal = {k: config[k] for k in ("scaling_factor", "shift_factor", "norm_num_groups")}
    minimal |= {"block_out_channels": (4, 8)}  # agreeing with the shapes, as a tuple
    assert_same_params(AutoencoderKL.from_single_file(LDM / "flux_ae" / "ae.safetensors", config=minimal), expected)
    with pytest.raises(ValueError, match=r"shapes contradict.*'latent_channels': \(4, 16\)"):
        AutoencoderKL.from_single_file(LDM / "flux_ae" / "ae.safetensors", config=config | {"latent_channels": 4})
    extra = state | {"encoder.mid.attn_2.q.weight": state["encoder.mid.attn_1.q.weight"]}
    save_file(extra, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): encoder\.mid\.attn_2\.q\.weight"):
        AutoencoderKL.from_single_file(tmp_path / "x.safetensors", config=config)


def test_latents_mean_and_std_are_used_as_sdxl_pipelines_use_them(tmp_path):
    """diffusers' SDXL pipelines: the model sees (z - latents_mean) * scaling_factor / latents_std
    (img2img's prepare_latents) and decodes latents * latents_std / scaling_factor + latents_mean."""
    mean, std, scale = np.array([0.3, -0.2, 0.5, 0.1]), np.array([0.9, 1.1, 0.8, 1.3]), 0.5
    config = SD_LIKE | {"latents_mean": mean.tolist(), "latents_std": std.tolist(), "scaling_factor": scale}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(DATA / "sd_like" / WEIGHTS, tmp_path / WEIGHTS)
    vae = AutoencoderKL.from_diffusers(tmp_path)
    z = np.random.default_rng(0).normal(size=(2, 4, 4, 4))
    # train/main.py's prepare: a latent record with a negligible posterior std (exp(-15)) gives x0.
    latent = {"mean": z.astype(np.float32), "logvar": np.full(z.shape, -30.0, np.float32)}
    out = train_main.prepare(
        latent | {"label": np.zeros(2, np.int32)},
        jax.random.key(0),
        schedule=EDMSchedule(),
        cond_dropout=0.0,
        condition=Labels(10),
        codec=Latents(vae, str(tmp_path)),
    )
    np.testing.assert_allclose(np.asarray(out["x0"]), (z - mean) * scale / std, rtol=1e-5, atol=1e-5)
    # eqxdiff.generate's decode of sampled latents.
    x = np.random.default_rng(1).normal(size=(2, 4, 4, 4)).astype(np.float32)
    decoded = np.asarray(generate._decode(vae, x))
    plain = AutoencoderKL.from_diffusers(DATA / "sd_like")  # the same network; its decode is compiled already
    unscaled = (x * std / scale + mean).astype(np.float32)
    np.testing.assert_allclose(decoded, np.asarray(decode(plain, unscaled)), atol=1e-5)
    assert not np.allclose(decoded, np.asarray(decode(plain, x / scale)), atol=1e-3)  # the statistics matter


@pytest.mark.parametrize(
    "change, message",
    [
        ({"latents_mean": [0.0] * 3, "latents_std": [1.0] * 3}, r"latents_mean \[0\.0, 0\.0, 0\.0\] must be 4"),
        ({"latents_mean": [0.0] * 4, "latents_std": [1.0, 0.0, 1.0, 1.0]}, r"latents_std .* must be positive"),
        ({"latents_mean": [0.0] * 4, "latents_std": [1.0] * 4, "shift_factor": 0.1}, r"with shift_factor 0\.1"),
    ],
)
def test_latent_statistics_that_change_the_computation_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        eqx.filter_eval_shape(AutoencoderKL.from_config, SD_LIKE | change, key=jax.random.key(0))


def test_keys_diffusers_ignores_are_ignored_with_a_warning(tmp_path):
    """diffusers' ConfigMixin drops (with a warning) config keys AutoencoderKL does not take, and its
    SDXL pipelines use latents_mean only with latents_std: neither changes the network or the scaling."""
    config = SD_LIKE | {"norm_type": "spatial", "some_future_option": 3, "latents_mean": [0.5] * 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(DATA / "sd_like" / WEIGHTS, tmp_path / WEIGHTS)
    with pytest.warns(UserWarning) as caught:
        vae = AutoencoderKL.from_diffusers(tmp_path)
    text = " | ".join(str(w.message) for w in caught)
    assert "['norm_type', 'some_future_option']" in text and "latents_mean without latents_std" in text
    assert (vae.scaling_factor, vae.shift_factor) == (SD_LIKE["scaling_factor"], 0.0)
    err = errors(vae, np.load(DATA / "sd_like" / "reference.npz"))
    assert max(err.values()) < TOL, err
