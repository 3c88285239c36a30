"""`save_pipeline` against the pipeline folders diffusers saved (tests/sd/test_sd_pipeline.py's fixtures): a loaded
pipeline written back is the same folder (the same files, model_index.json and scheduler config), loads again with
bitwise-equal weights, and samples diffusers' latents; bad parts are refused before anything is written.
diffusers' StableDiffusionPipeline loading such a folder: tools/check_sd_export.py."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import safe_open
from tests.sd.test_sd_pipeline import CFG, NEGATIVE, PROMPTS, STEPS, TOLERANCE, assemble, nhwc, reference, relative

from eqxdiff.sd import load_sd, save_pipeline

UNET = "diffusion_pytorch_model.safetensors"


def shapes(path: Path) -> dict[str, tuple]:
    with safe_open(str(path), "numpy") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # not dtypes: the fixtures mix fp16, fp32


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def index(folder: Path) -> dict:
    return {k: v for k, v in json.loads((folder / "model_index.json").read_text()).items() if k != "_diffusers_version"}


def weights(pipe) -> list:
    towers = (pipe.prompts.encoder,) if pipe.family == "sd" else (pipe.prompts.encoders,)
    return jax.tree.leaves((pipe.unet, pipe.vae, towers))


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_a_loaded_pipeline_saves_as_the_folder_diffusers_wrote(family, tmp_path):
    source = assemble(family, tmp_path / "source")
    pipe = load_sd(source)
    out = save_pipeline(pipe, tmp_path / "out", tokenizers=source)
    assert files(out) == files(source) and index(out) == index(source)
    for model in ("unet", "vae"):  # diffusers' names and PyTorch's shapes (the towers': tests/sd/test_sd_export.py)
        assert shapes(out / model / UNET) == shapes(source / model / UNET)
    config = "scheduler/scheduler_config.json"
    assert json.loads((out / config).read_text()) == json.loads((source / config).read_text())
    again = load_sd(out)  # SDXL: tokenizer_2/ and text_encoder_2/ (text_model.*, text_projection) read back too
    assert all(np.array_equal(a, b) for a, b in zip(weights(again), weights(pipe), strict=True))
    if family == "sd1":  # the saved folder samples diffusers' latents, as the source does (the same arrays)
        ref = reference("sd1")
        sample = lambda p: np.asarray(
            p.latents(
                PROMPTS,
                NEGATIVE,
                steps=STEPS,
                guidance=CFG,  # noqa: E731
                initial_latents=nhwc(ref["latents"]),
            )
        )
        ours = sample(again)
        assert relative(ours, nhwc(ref["ddim_latents"])) < TOLERANCE and np.array_equal(ours, sample(pipe))


def test_bad_parts_are_refused_before_writing(tmp_path):
    source = assemble("sd1", tmp_path / "source")
    pipe = load_sd(source)
    parts = {
        "unet": pipe.unet,
        "vae": pipe.vae,
        "text_encoder": pipe.prompts.encoder,
        "scheduler": pipe.scheduler_config,
        "tokenizer": source / "tokenizer",
    }
    out = tmp_path / "out"
    for change, phrase in [
        ({"tokenizer": None}, "tokenizer must be a folder"),
        ({"vae": pipe.unet}, "vae must be an eqxdiff AutoencoderKL, got SDUNet"),
        ({"scheduler": {"beta_schedule": "linear"}}, "diffusers scheduler config with its _class_name"),
        ({"text_encoder_2": pipe.prompts.encoder}, r"missing \['tokenizer_2'\]"),
    ]:
        with pytest.raises(ValueError, match=phrase):
            save_pipeline(parts | change, out)
    with pytest.raises(ValueError, match="tokenizers=<the pipeline folder"):
        save_pipeline(pipe, out)
    assert not out.exists()
    save_pipeline(parts, out)  # the same parts as a dict: the SD 1.x folder
    assert files(out) == files(source)
