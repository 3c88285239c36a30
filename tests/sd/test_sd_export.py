"""`save_diffusers` / `save_transformers` against the folders diffusers and transformers wrote (tests/data): an
SDUNet, AutoencoderKL or CLIP tower saved and read back has bitwise-equal parameters (equal outputs: the pipeline's,
tests/sd/test_sd_pipeline_export.py), and the folder has the fixture's config and the same keys and shapes (diffusers'
names, PyTorch's layouts); fp16 is the file diffusers itself wrote; LoRA is merged; a non-empty folder is kept.
diffusers and transformers loading these folders: tools/check_sd_export.py."""

import json
from pathlib import Path

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from eqxdiff.nn import AutoencoderKL, CLIPTextModel
from eqxdiff.sd import SDUNet
from eqxdiff.nn.clip_text_projection import CLIPTextModelWithProjection
from eqxdiff.nn.lora import LoRALinear, add_lora, map_layers, merge_lora
from eqxdiff.weights.weight_files import weight_files
from eqxdiff.sd import save_diffusers, save_transformers

DATA = Path(__file__).parents[1] / "data"
UNET = "diffusion_pytorch_model.safetensors"


def shapes(files) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, dtype)} over a state_dict's files."""
    out = {}
    for path in files:
        with safe_open(str(path), "numpy") as f:
            out |= {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    return out


def same_leaves(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def sd1() -> SDUNet:
    return SDUNet.from_diffusers(DATA / "sd_unet" / "sd1_like")


def config(folder: Path) -> dict:
    return {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if k != "_diffusers_version"}


def test_unet_round_trip_is_the_folder_diffusers_wrote(sd1, tmp_path):
    """SD 1.x: proj_in/proj_out back to 1x1 convolutions (SDXL's Linear ones: tests/sd/test_sd_pipeline_export.py)."""
    source, unet = DATA / "sd_unet" / "sd1_like", sd1
    save_diffusers(unet, tmp_path / "unet")
    assert (tmp_path / "unet" / "config.json").read_bytes() == (source / "config.json").read_bytes()
    assert shapes([tmp_path / "unet" / UNET]) == shapes(weight_files(source, UNET))
    assert same_leaves(SDUNet.from_diffusers(tmp_path / "unet"), unet)


def test_fp16_is_diffusers_own_fp16_file_and_bf16_round_trips(sd1, tmp_path):
    source = DATA / "sd_unet" / "sd1_like"
    save_diffusers(sd1, tmp_path / "fp16", dtype="float16", variant="fp16")
    ours, theirs = (
        load_file(str(tmp_path / "fp16" / f"{UNET[:-12]}.fp16.safetensors")),
        load_file(str(source / f"{UNET[:-12]}.fp16.safetensors")),
    )
    assert ours.keys() == theirs.keys() and all(ours[k].tobytes() == theirs[k].tobytes() for k in ours)
    unet = SDUNet.from_diffusers(source, dtype=ml_dtypes.bfloat16)
    save_diffusers(unet, tmp_path / "bf16", dtype="bf16")
    assert {dtype for _, dtype in shapes([tmp_path / "bf16" / UNET]).values()} == {"BF16"}
    assert same_leaves(SDUNet.from_diffusers(tmp_path / "bf16", dtype=ml_dtypes.bfloat16), unet)


def test_lora_is_merged_into_the_saved_weights(sd1, tmp_path):
    adapted = add_lora(sd1, 2, key=jax.random.key(0))
    nonzero = lambda _, node: (
        eqx.tree_at(lambda m: m.lora_B, node, node.lora_B + 0.1) if isinstance(node, LoRALinear) else node
    )  # noqa: E731  (B != 0: the adapters change the model)
    adapted = map_layers(adapted, nonzero)
    save_diffusers(adapted, tmp_path)
    saved = SDUNet.from_diffusers(tmp_path)
    assert same_leaves(saved, merge_lora(adapted)) and not same_leaves(saved, sd1)


def test_a_folder_with_files_is_kept_unless_overwrite(sd1, tmp_path):
    unet = sd1
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty.*overwrite=True"):
        save_diffusers(unet, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    save_diffusers(unet, tmp_path, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine" and same_leaves(SDUNet.from_diffusers(tmp_path), unet)
    with pytest.raises(ValueError, match="SDUNet or AutoencoderKL"):
        save_diffusers(CLIPTextModel.from_transformers(DATA / "sdxl_text" / "text_encoder"), tmp_path / "x")


@pytest.mark.parametrize("name", ["sd_like", "flux_like"])  # scaling_factor; + shift_factor, no quant convs
def test_vae_round_trip_is_the_folder_diffusers_wrote(name, tmp_path):
    source = DATA / "autoencoder_kl" / name
    vae = AutoencoderKL.from_diffusers(source)
    save_diffusers(vae, tmp_path)
    assert config(tmp_path) == config(source)
    assert shapes([tmp_path / UNET]) == shapes([source / UNET])
    assert same_leaves(AutoencoderKL.from_diffusers(tmp_path), vae)


@pytest.mark.parametrize(
    "name, kind", [("text_encoder", CLIPTextModel), ("text_encoder_2", CLIPTextModelWithProjection)]
)
def test_clip_tower_round_trip_has_transformers_names(name, kind, tmp_path):
    source = DATA / "sdxl_text" / name
    tower = kind.from_transformers(source)
    save_transformers(tower, tmp_path, dtype="float16")
    ours, theirs = shapes([tmp_path / "model.safetensors"]), shapes([source / "model.safetensors"])
    assert ours == {
        k if k.startswith(("text_model.", "text_projection")) else f"text_model.{k}": v for k, v in theirs.items()
    }  # the hub's names
    architecture = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
        "hidden_act",
        "layer_norm_eps",
        "eos_token_id",
        "model_type",
        "architectures",
        "dtype",
    ] + ["projection_dim"] * (kind is CLIPTextModelWithProjection)
    written = json.loads((tmp_path / "config.json").read_text())
    assert {k: written.get(k) for k in architecture} == {k: config(source).get(k) for k in architecture}
    assert same_leaves(kind.from_transformers(tmp_path), tower)
    scratch = CLIPTextModel.from_config(config(source), key=jax.random.key(0), causal=False)
    with pytest.raises(ValueError, match="causal=False"):
        save_transformers(scratch, tmp_path / "scratch")
