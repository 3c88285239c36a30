"""Latent diffusion end to end: train/encode.py -> train/main.py --dataset latents:DIR ->
train/sample.py, with an exact autoencoder (the pixel-space numbers must come back) and with a
tiny random AutoencoderKL (the diffusers fixture of tests/nn/test_autoencoder_kl.py)."""

import json
from pathlib import Path
from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import encode as train_encode  # train/encode.py
import main as train_main  # train/main.py
import sample as train_sample  # train/sample.py
from eqxdiff.run.codecs import Latents, Pixels
from eqxdiff.run.conditions import Labels
from eqxdiff.data import open_source
from eqxdiff.diffusion import EDMSchedule
from eqxdiff.images import to_uint8
from eqxdiff.nn import AutoencoderKL, SpaceToDepth
from runs import REFERENCE, ROOT, assert_finite_training, metric_rows, train_here

FLUX_LIKE = ROOT / "tests" / "data" / "autoencoder_kl" / "flux_like"  # 16 channels, f = 2, a shift


def test_sigma_data_follows_the_data_unless_given():
    default, given = train_main.parse_config([]), train_main.parse_config(["--sigma_data", "0.7"])
    latents = Latents(SpaceToDepth(2), "space_to_depth:2")
    assert train_main.sigma_data(default, Pixels()) == 0.5  # images in [-1, 1]
    assert train_main.sigma_data(default, latents) == 1.0  # latents scaled to std ≈ 1
    assert train_main.sigma_data(given, latents) == 0.7


def test_prepare_draws_latents_from_the_posterior_and_scales_them_per_channel():
    """x0 = (mean + exp(logvar / 2)·ε - shift)·scale (the posterior's reparameterised draw, then
    SDXL-style per-channel statistics), in float64 with prepare's own ε: the posterior key is
    fold_in(key, 1), so σ, ε and dropout draw as for images."""
    rng = np.random.default_rng(0)
    shape = (3, 4, 4, 4)
    mean, logvar = rng.normal(size=shape), rng.uniform(-3.0, 1.0, size=shape)  # posterior std 0.2 .. 1.6
    scale, shift = np.array([0.5, 1.7, 0.9, 2.3]), np.array([0.3, -0.4, 0.1, 0.6])
    records = {"mean": mean.astype(np.float32), "logvar": logvar.astype(np.float32), "label": np.zeros(3, np.int32)}
    autoencoder = SimpleNamespace(scaling_factor=scale.astype(np.float32), shift_factor=shift.astype(np.float32))

    def x0(key):
        out = train_main.prepare(
            records,
            key,
            schedule=EDMSchedule(),
            cond_dropout=0.0,
            condition=Labels(10),
            codec=Latents(autoencoder, "per-channel"),
        )
        return np.asarray(out["x0"], np.float64)

    key = jax.random.key(7)
    eps = np.asarray(jax.random.normal(jax.random.fold_in(key, 1), shape), np.float64)
    m, lv = records["mean"].astype(np.float64), records["logvar"].astype(np.float64)
    np.testing.assert_allclose(x0(key), (m + np.exp(lv / 2) * eps - shift) * scale, rtol=1e-5, atol=1e-5)
    assert np.abs(x0(key) - x0(jax.random.key(8))).min() > 0  # every element is drawn anew


def losses(run_dir: Path) -> list[float]:
    return [r["train/loss"] for r in metric_rows(run_dir)]


def sample(run_dir: Path, *args) -> None:
    """train/sample.py in this process (its script runs: tests/scripts/test_multihost.py)."""
    train_sample.main(train_sample.parse_args(["--run_dir", str(run_dir), *map(str, args)]))


def encode(out: Path, dataset: str, vae: str, *flags) -> Path:
    train_encode.main(train_encode.parse_config(["--dataset", dataset, "--vae", vae, "--out", str(out), *flags]))
    return out


# The reference job's first six steps: their learning rates do not depend on the job's length (warm-up over 4 steps,
# then the cosine from its peak), so their losses are the 24-step eight_device_run's first six.
STEPS = 6


@pytest.mark.slow
def test_latents_of_an_exact_autoencoder_train_like_the_images(tmp_path, capsys, eight_device_run):
    """space_to_depth:1 stores the images themselves (as float16): the reference job on those latents
    must give the losses of the same job on the images (conftest's eight_device_run), since the
    latent draw has a key of its own and σ, ε and the label dropout draw as for images."""
    latents = encode(tmp_path / "latents", "digits", "space_to_depth:1")
    run_dir = tmp_path / "run"
    train_here(
        "--run_dir",
        run_dir,
        *REFERENCE,
        "--dataset",
        f"latents:{latents}",
        "--sigma_data",
        0.5,
        "--steps",
        STEPS,
        "--ckpt_every",
        STEPS,
    )  # no grid (REFERENCE's --sample_every 0): a latent run's grids, decoded, are the AutoencoderKL test's below
    # float16 storage of [-1, 1] pixels rounds them by < 2^-11 relative
    np.testing.assert_allclose(losses(run_dir), losses(eight_device_run)[:STEPS], rtol=1e-4)

    out = tmp_path / "s.npz"
    capsys.readouterr()
    sample(run_dir, "--num", 20, "--steps", 2, "--out", out, "--eval", "--json")
    scores = json.loads(capsys.readouterr().out.splitlines()[-1])  # scored as digits: the images these latents encode
    assert scores["step"] == STEPS and scores["num"] == 20 and 0 <= scores["class_accuracy"] <= 1
    assert scores["guidance"] == train_main.Config().guidance  # no --guidance: the guidance of the run's grids
    with np.load(out) as saved:
        assert saved["images"].shape == (20, 8, 8, 1) and saved["latents"].shape == (20, 8, 8, 1)
        np.testing.assert_array_equal(saved["images"], to_uint8(saved["latents"]))  # decode is the identity


@pytest.mark.slow
def test_a_diffusers_vae_encodes_trains_and_decodes_samples(tmp_path):
    """Also the class names of a folder through the latents (meta.json) to the grids of main.py and sample.py."""
    from tests.scripts.test_train_main import row_label_margin

    rng = np.random.default_rng(0)
    names = ["ant", "bee", "cat", "dog"]
    for name in names:
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(16):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                tmp_path / "images" / name / f"{i}.png"
            )
    latents = encode(tmp_path / "latents", f"folder:{tmp_path / 'images'}", str(FLUX_LIKE), "--image_size", "8")
    assert open_source(f"latents:{latents}").image_shape == (4, 4, 16)

    run_dir = tmp_path / "run"
    # main.py in this process (runs.train_here): nothing checked needs a process of its own (the test alone, cold,
    # on a loaded box: 36.9 s and 26.6 s of CPU with main.py as a 1-device process, 30.4 s and 20.9 s here).
    train_here(
        "--run_dir",
        run_dir,
        "--dataset",
        f"latents:{latents}",
        "--model",
        "unet_tiny",
        "--batch_size",
        16,
        "--steps",
        3,
        "--log_every",
        1,
        "--sample_every",
        3,
        "--sample_steps",
        1,
        "--wandb",
        "disabled",
        "--schedule",
        "vp_cosine",
        "--parameterization",
        "v",
    )  # main.py's run of these: see test_train_main.py
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_finite_training(rows)
    with Image.open(run_dir / "samples" / "step_000003.png") as grid:  # a row of 10 decoded 8×8×3 images per class
        want = row_label_margin(names, 8, "RGB", grid.height)
        assert grid.size == (want.shape[1] + (10 * 9 + 1) * 4, (4 * 9 + 1) * 4) and grid.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(grid)[:, : want.shape[1]], want)

    # As many samples as the run's grid (4 classes × 10), whose sampler and decode programs sample.py's then reuse
    out = tmp_path / "s.npz"
    sample(run_dir, "--num", 40, "--steps", 1, "--out", out)
    with np.load(out) as saved:
        sampled, images = saved["latents"], saved["images"]
    assert sampled.shape == (40, 4, 4, 16) and images.shape == (40, 8, 8, 3)
    sample(run_dir, "--num", 40, "--steps", 1, "--classes", "dog,0", "--out", tmp_path / "grid.png")  # the same program
    with Image.open(tmp_path / "grid.png") as grid:
        want = row_label_margin(["dog", "ant"], 8, "RGB", grid.height)
        assert grid.size == (want.shape[1] + (20 * 9 + 1) * 4, (2 * 9 + 1) * 4)
        np.testing.assert_array_equal(np.asarray(grid)[:, : want.shape[1]], want)
    # The images are the VAE's decode of the unscaled latents, z / scaling_factor + shift_factor.
    vae = AutoencoderKL.from_diffusers(FLUX_LIKE)
    decoded = eqx.filter_jit(vae.decode)(sampled / vae.scaling_factor + vae.shift_factor)
    assert np.abs(to_uint8(np.asarray(decoded)).astype(int) - images).max() <= 1  # rounding at a level's edge
