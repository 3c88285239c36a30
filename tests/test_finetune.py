"""train/main.py --init sd:FOLDER (train/finetune.py) on the tiny random SD 1.x pipeline of tests/data/sd_pipeline: the
whole UNet fine-tuned from the folder's weights; --lora_rank trains adapters alone (the base bitwise unchanged, the
optimizer and EMA adapter-sized), resumes bitwise, and writes a diffusers LoRA file that loads back into the base
as the trained model; the flags the folder decides are refused in one line."""

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

import encode as train_encode  # train/encode.py (conftest puts train/ on sys.path)
import main as train_main  # train/main.py
from eqxdiff.nn import SDUNet, TextCond
from eqxdiff.nn.lora_files import load_lora
from runs import assert_bitwise_equal, metric_rows, saved_arrays, train_here
from test_sd_pipeline import assemble

# Few, small steps: batch 8 over the test's 8 devices, 4×4×4 latents of 16×16 images, the 2-level UNet of 8/16 channels.
STEPS = ["--batch_size", 8, "--warmup_steps", 1, "--lr", 1e-3, "--sample_every", 0, "--log_every", 1,
         "--wandb", "disabled", "--ema_decay", 0.5, "--no-ema_warmup"]  # fmt: skip


@pytest.fixture(scope="module")
def sd_run(tmp_path_factory) -> tuple[Path, Path]:
    """(the sd1 pipeline folder, latents of 16 captioned 16×16 images encoded with its VAE)."""
    root = tmp_path_factory.mktemp("finetune")
    folder = assemble("sd1", root / "sd1")
    rng, images = np.random.default_rng(0), root / "images"
    images.mkdir()
    for i in range(16):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(images / f"{i:02d}.png")
        (images / f"{i:02d}.txt").write_text(f"a photo of {['a cat', 'a dog'][i % 2]}")
    latents = root / "latents"
    train_encode.main(train_encode.parse_config(["--dataset", f"folder:{images}", "--image_size", "16", "--vae",
                                                 str(folder / "vae"), "--text_encoder", str(folder / "text_encoder"), "--out",
                                                 str(latents), "--batch_size", "16"]))  # fmt: skip
    return folder, latents


def train(run_dir: Path, folder: Path, latents: Path, *flags) -> None:
    train_here("--run_dir", run_dir, "--init", f"sd:{folder}", "--dataset", f"latents:{latents}", *STEPS, *flags)


def test_lora_trains_adapters_only(sd_run, tmp_path):
    folder, latents = sd_run
    run_dir = tmp_path / "lora"
    train(run_dir, folder, latents, "--lora_rank", 2, "--steps", 3, "--ckpt_every", 3)
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(np.isfinite(r["train/loss"]) for r in rows)
    arrays = saved_arrays(run_dir, 3)
    print(sorted(arrays)[:10], len(arrays))
