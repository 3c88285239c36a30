"""SDUNet against diffusers' UNet2DConditionModel: parity on the committed SD 1.x / 2.x / XL / x4 upscaler /
unCLIP-like fixtures
(tools/make_sd_unet_fixtures.py) from fp32, fp16 and bf16 files, variant and sharded folders; loading by
state_dict name (missing and unexpected keys named) straight into FSDP shardings; unsupported options
and wrong conditions refused by name; the released UNets' full-size architectures, key for key."""

import gzip
import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from safetensors.numpy import load_file, save_file

from eqxdiff.nn import ClassLabelCond, TextCond
from eqxdiff.sd import SDUNet, SDXLCond, sdxl_time_ids
from eqxdiff.nn.torch_weights import leaf_layouts
from eqxdiff.weights.weight_files import weight_files
from eqxdiff.sharding import make_mesh, placement, state_shardings

DATA = Path(__file__).parents[1] / "data" / "sd_unet"
FAMILIES = ["sd1_like", "sd2_like", "sdxl_like", "upscaler_like", "unclip_like"]
WEIGHTS = "diffusion_pytorch_model.safetensors"
# Max error relative to the output's max. The port is within 1e-6 of diffusers on every fixture and dtype
# (the issue asks 1e-4); a GroupNorm eps of 1e-5 for the transformers' 1e-6 moves the outputs by 7e-6 to
# 2e-5, SD 1/2's LayerNorm eps of 1e-6 for 1e-5 by 9e-6 to 3e-5: the bound sits between.
TOL = 4e-6
forward = eqx.filter_jit(lambda unet, x, t, cond: unet(x, t, cond))


def cond_of(ref) -> TextCond | SDXLCond | ClassLabelCond:
    """The fixture's condition; its mask has padding zeros that diffusers never saw (SD ignores the mask)."""
    text = TextCond(ref["context"], ref["mask"], ref.get("pooled"))
    if "class_labels" in ref:
        return ClassLabelCond(text, ref["class_labels"])
    return SDXLCond(text, ref["time_ids"]) if "time_ids" in ref else text


def rel_error(unet: SDUNet, ref, x: str = "x", out: str = "out") -> float:
    got = np.asarray(forward(unet, ref[x], ref["t"], cond_of(ref)))
    assert got.shape == ref[out].shape
    return float(np.abs(got - ref[out]).max() / np.abs(ref[out]).max())


def params(unet: SDUNet) -> dict[str, np.ndarray]:
    """Every parameter by its state_dict name, in our layout."""
    leaves = [x for x in jax.tree.leaves(unet) if eqx.is_array(x)]
    return {name: np.asarray(x) for name, x in zip(leaf_layouts(unet), leaves, strict=True)}


def state_of(name: str) -> dict[str, np.ndarray]:
    """A fixture's state_dict (its plain weights, one file or shards)."""
    return {k: v for path in weight_files(DATA / name, WEIGHTS) for k, v in load_file(str(path)).items()}


def folder_with(folder: Path, state: dict[str, np.ndarray], source: str, config: dict | None = None) -> Path:
    """A diffusers folder: `source`'s config.json (or `config`) with `state` as its weights."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or json.loads((DATA / source / "config.json").read_text())))
    save_file(state, str(folder / WEIGHTS))
    return folder


@pytest.mark.parametrize("name", FAMILIES)
def test_matches_diffusers(name):
    ref = np.load(DATA / name / "reference.npz")
    unet = SDUNet.from_diffusers(DATA / name)
    assert rel_error(unet, ref) < TOL
    assert np.abs(ref["out"]).max() > 0.5 and ref["out"].std() > 0.1  # the reference is not degenerate
    if name == "sd2_like":  # a 7x9 latent: diffusers upsamples to the skips' sizes (4x5 -> 7x9, 2x3 -> 4x5)
        assert ref["x_odd"].shape[1:3] == (7, 9) and rel_error(unet, ref, "x_odd", "out_odd") < TOL
    if name == "sdxl_like":  # the committed folder is diffusers' sharded save: an index and its shards
        assert len(weight_files(DATA / name, WEIGHTS)) > 1


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_files(dtype, tmp_path):
    """fp16/bf16 files load as float32 parameters equal to the fp32 weights rounded to that dtype, and give
    diffusers' output on those rounded weights. sd1_like's fp16 is diffusers' own variant file. One family: the
    cast on load is the same code for every architecture (test_matches_diffusers holds each family)."""
    name = "sd1_like"
    half = np.float16 if dtype == "fp16" else ml_dtypes.bfloat16
    if name == "sd1_like" and dtype == "fp16":
        unet = SDUNet.from_diffusers(DATA / name, variant="fp16")
        stored = load_file(str(DATA / name / "diffusion_pytorch_model.fp16.safetensors"))
        assert {str(v.dtype) for v in stored.values()} == {"float16"}
    else:
        rounded = {k: v.astype(half) for k, v in state_of(name).items()}
        unet = SDUNet.from_diffusers(folder_with(tmp_path, rounded, name))
    full = params(SDUNet.from_diffusers(DATA / name))
    for key, value in params(unet).items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, full[key].astype(half).astype(np.float32), err_msg=key)
    ref = np.load(DATA / name / "reference.npz")
    assert rel_error(unet, ref, out=f"out_{dtype}") < TOL
    assert rel_error(unet, ref) > 1e-5  # the rounding shows: the reference is of the rounded weights


def test_missing_and_unexpected_keys_are_named(tmp_path):
    state = state_of("sd1_like")
    key = "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight"
    missing = {k: v for k, v in state.items() if k != key}
    with pytest.raises(ValueError, match=rf"missing keys \(1\): {key}"):
        SDUNet.from_diffusers(folder_with(tmp_path / "a", missing, "sd1_like"))
    extra = state | {"mid_block.attentions.0.transformer_blocks.1.norm1.weight": np.ones(16, np.float32)}
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): mid_block\.attentions\.0\.transformer_blocks\.1\."):
        SDUNet.from_diffusers(folder_with(tmp_path / "b", extra, "sd1_like"))


def test_weights_load_into_fsdp_shardings():
    """Over 8 simulated devices in one FSDP group, every leaf is read into the training state's sharding
    (sdxl_like's shards), with the values of a single-device load, bitwise: the output is then
    test_matches_diffusers[sdxl_like]'s. (A sharded SD UNet computes as the unsharded one: tests/nn/test_lora.py's
    FSDP step. The sharded forward compiled here again cost ~11 s for nothing the loader does.)"""
    mesh, min_size = make_mesh(1, 8), 1024
    unet = SDUNet.from_diffusers(DATA / "sdxl_like", place=placement(mesh, min_size))
    config = json.loads((DATA / "sdxl_like" / "config.json").read_text())
    abstract = eqx.filter_eval_shape(SDUNet.from_config, config, key=jax.random.key(0))
    expected = jax.tree.leaves(state_shardings(abstract, mesh, min_size))
    leaves = [x for x in jax.tree.leaves(unet) if eqx.is_array(x)]
    assert [x.sharding for x in leaves] == expected
    big = unet.up_blocks[0].resnets[0].conv1.weight  # [3, 3, 32, 16] HWIO
    assert big.sharding.spec == PartitionSpec(None, None, "fsdp") and len(big.sharding.device_set) == 8
    assert {tuple(s.data.shape) for s in big.addressable_shards} == {(3, 3, 4, 16)}  # an eighth per device
    single = params(SDUNet.from_diffusers(DATA / "sdxl_like"))
    for name, value in params(unet).items():
        np.testing.assert_array_equal(value, single[name], err_msg=name)


SD2 = json.loads((DATA / "sd2_like" / "config.json").read_text())


@pytest.mark.parametrize(
    "option, value",
    [
        ("class_embed_type", "timestep"),  # no released SD model
        ("num_class_embeds", 0.5),
        ("resnet_time_scale_shift", "scale_shift"),
        ("addition_embed_type", "image"),
        ("dual_cross_attention", True),
        ("time_cond_proj_dim", 256),  # LCM's guidance embedding
        ("mid_block_type", "UNetMidBlock2DSimpleCrossAttn"),
        ("down_block_types", ["AttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"]),
        ("transformer_layers_per_block", [[1, 1], [1, 1], [1, 1]]),
        ("num_attention_heads", 4),
        ("act_fn", "gelu"),
        ("cross_attention_dim", [16, 32, 16]),
    ],
)
def test_unsupported_option_is_named(option, value):
    with pytest.raises(ValueError, match=rf"option {option}="):
        eqx.filter_eval_shape(SDUNet.from_config, SD2 | {option: value}, key=jax.random.key(0))


def test_options_without_effect_and_unknown_keys():
    config = SD2 | {"sample_size": [64, 96], "mid_block_only_cross_attention": True, "a_future_option": 1}
    with pytest.warns(UserWarning, match=r"\['a_future_option'\] are not options"):
        eqx.filter_eval_shape(SDUNet.from_config, config, key=jax.random.key(0))


def test_wrong_condition_is_named():
    sd1, sdxl = (SDUNet.from_diffusers(DATA / n) for n in ("sd1_like", "sdxl_like"))
    ref = {k: jax.numpy.asarray(v) for k, v in np.load(DATA / "sdxl_like" / "reference.npz").items()}
    text = TextCond(ref["context"], ref["mask"], ref["pooled"])
    with pytest.raises(ValueError, match=r"SDXL, text_time\) takes cond = an SDXLCond"):
        sdxl(ref["x"], ref["t"], text)
    with pytest.raises(ValueError, match=r"takes cond = a TextCond.*got dict"):
        sd1(ref["x"], ref["t"], {"context": ref["context"]})
    with pytest.raises(ValueError, match=r"p \+ k \* addition_time_embed_dim \(4\) = projection_class_embeddings_"):
        sdxl(ref["x"], ref["t"], SDXLCond(text, ref["time_ids"][:, :5]))  # a refiner's 5 ids for a base model
    with pytest.raises(ValueError, match=r"context must be \[2, n, 16\]"):
        sd1(ref["x"], ref["t"], TextCond(ref["context"][..., :8], ref["mask"]))
    upscaler, unclip = (SDUNet.from_diffusers(DATA / n) for n in ("upscaler_like", "unclip_like"))
    x7 = jax.numpy.zeros((2, 8, 8, 7))
    with pytest.raises(ValueError, match=r"with a class embedding\) takes cond = a ClassLabelCond"):
        upscaler(x7, ref["t"], text)
    with pytest.raises(ValueError, match=r"class_labels must be int \[2\] row indices < 10"):
        upscaler(x7, ref["t"], ClassLabelCond(text, jax.numpy.ones(3, jax.numpy.int32)))  # 3 labels for 2 rows
    with pytest.raises(ValueError, match=r"class_labels must be float \[2, 12\]"):
        unclip(ref["x"], ref["t"], ClassLabelCond(text, jax.numpy.ones((2, 8))))


def test_sd_ignores_the_mask_and_pooled_as_diffusers_does():
    """SD 1.x/2.x pipelines pass neither the mask nor a pooled vector to the UNet: the output does not move."""
    ref = np.load(DATA / "sd1_like" / "reference.npz")
    unet = SDUNet.from_diffusers(DATA / "sd1_like")
    base = np.asarray(forward(unet, ref["x"], ref["t"], TextCond(ref["context"], ref["mask"])))
    other = TextCond(ref["context"], np.ones_like(ref["mask"]), np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(np.asarray(forward(unet, ref["x"], ref["t"], other)), base)


def test_sdxl_time_ids_are_the_pipelines():
    ids = sdxl_time_ids((1024, 768), (0, 16), (1024, 1024), 3)
    assert ids.dtype == np.float32 and ids.shape == (3, 6)
    np.testing.assert_array_equal(ids[2], [1024, 768, 0, 16, 1024, 1024])
    with pytest.raises(ValueError, match="pairs"):
        sdxl_time_ids((1024,), (0, 0), (1024, 1024), 1)


with gzip.open(DATA / "full_size_shapes.json.gz") as f:
    FULL = json.loads(f.read())


@pytest.mark.parametrize("name", ["sd15", "sd21", "sdxl_base"])
def test_full_size_architecture_has_diffusers_keys_and_shapes(name):
    abstract = eqx.filter_eval_shape(SDUNet.from_config, FULL[name]["config"], key=jax.random.key(0))
    perms, torch_shapes = leaf_layouts(abstract), FULL[name]["shapes"]
    assert set(perms) == set(torch_shapes)
    leaves = [x for x in jax.tree.leaves(abstract) if isinstance(x, jax.ShapeDtypeStruct)]
    ours = {n: tuple(x.shape) for n, x in zip(perms, leaves, strict=True)}
    # SD 1.x's proj_in/proj_out are 1x1 convs [out, in, 1, 1] in the file, per-pixel Dense [in, out] here.
    squeeze = lambda s, perm: s[:2] if len(perm) == 2 and len(s) == 4 else s  # noqa: E731
    expected = {n: tuple(squeeze(torch_shapes[n], perm)[p] for p in perm) for n, perm in perms.items()}
    assert ours == expected
    assert sum(np.prod(s) for s in ours.values()) == FULL[name]["num_parameters"]
    assert FULL["sd15"]["num_parameters"] == 859_520_964 and FULL["sdxl_base"]["num_parameters"] == 2_567_463_684


def test_variant_and_sharded_names_are_diffusers(tmp_path):
    """A folder holding only the fp16 variant reads it, saying so (no flag reaches variant=); with a second variant
    beside it the choice is named; the sharded fixture's index lists every key."""
    folder = tmp_path / "variant_only"
    folder.mkdir()
    for file in ("config.json", "diffusion_pytorch_model.fp16.safetensors"):
        shutil.copy(DATA / "sd1_like" / file, folder / file)
    says = r"holds only its 'fp16' weights \(diffusion_pytorch_model\.fp16\.safetensors\): reading those"
    with pytest.warns(UserWarning, match=says):
        only = SDUNet.from_diffusers(folder)
    asked = SDUNet.from_diffusers(DATA / "sd1_like", variant="fp16")
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(only), jax.tree.leaves(asked), strict=True))
    fp16 = folder / "diffusion_pytorch_model.fp16.safetensors"
    shutil.copy(fp16, fp16.with_name("diffusion_pytorch_model.bf16.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"pass variant= one of \['bf16', 'fp16'\]"):
        SDUNet.from_diffusers(folder)
    index = json.loads((DATA / "sdxl_like" / f"{WEIGHTS}.index.json").read_text())
    assert set(index["weight_map"]) == set(leaf_layouts(SDUNet.from_diffusers(DATA / "sdxl_like")))


def test_bfloat16_parameters_run_in_bfloat16():
    """`dtype=bfloat16` keeps every parameter in bf16 as it is read; the forward runs in bf16 (norm statistics
    and the attention softmax in float32) and stays near diffusers' float32 output."""
    ref = np.load(DATA / "sdxl_like" / "reference.npz")
    unet = SDUNet.from_diffusers(DATA / "sdxl_like", dtype=jax.numpy.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(unet) if eqx.is_array(x)} == {np.dtype(ml_dtypes.bfloat16)}
    out = forward(unet, ref["x"], ref["t"], cond_of(ref))
    assert out.dtype == jax.numpy.bfloat16
    assert 1e-4 < rel_error(unet, ref) < 5e-2


def test_attention_in_query_blocks_is_the_same(monkeypatch):
    """Self- and cross-attention in query blocks (the CPU's form where a head's logits leave the cache, SD's 32x32
    and larger latents): the same output as the plain form. The plain form is what the CPU chooses at this size:
    test_matches_diffusers[sd2_like]'s program, not compiled again."""
    from eqxdiff.nn import attention

    ref = np.load(DATA / "sd2_like" / "reference.npz")  # only_cross_attention too: both attentions read the text
    unet = SDUNet.from_diffusers(DATA / "sd2_like")
    assert attention.chosen_form(64, 64, False) == attention.chosen_form(64, 5, False) == "plain"  # 8x8 latents
    whole = np.asarray(forward(unet, ref["x"], ref["t"], cond_of(ref)))
    monkeypatch.setattr(attention, "QUERY_BLOCK", 24)  # 64 pixels: blocks of 24, 24 and 16
    with attention.attention_form("query_blocks"):  # a fresh trace: the form is chosen when the attention is traced
        blocked = np.asarray(eqx.filter_jit(lambda m, x, t, c: m(x, t, c))(unet, ref["x"], ref["t"], cond_of(ref)))
    np.testing.assert_allclose(blocked, whole, rtol=0, atol=1e-6)
    assert np.abs(blocked - ref["out"]).max() / np.abs(ref["out"]).max() < TOL
