"""train/sample.py's guidance flags: --guidance_interval, and autoguidance by another run (--guide_run, at
--guide_step) whose EMA samples in the same program as the run's, whatever its layout; runs of other tasks refused
by name."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import main as train_main  # train/main.py
import sample  # train/sample.py
from eqxdiff.run.rebuild import load_run
from runs import TINY, train_here

from eqxdiff.diffusion import AutoGuidance, ClassifierFreeGuidance, Denoiser, karras_sigmas
from eqxdiff.diffusion import sample as run_sampler
from eqxdiff.run.sampling import parse_interval
from eqxdiff.sharding import make_mesh


def config_only_run(run_dir: Path, **config) -> Path:
    """A run directory as sample.py first reads it: a checkpoint's saved config alone, as plain JSON."""
    folder = run_dir / "checkpoints" / "6" / "config"
    folder.mkdir(parents=True)
    saved = {"dataset": "digits", "model": "unet_tiny", "num_classes": 10, "image_shape": [8, 8, 1], **config}
    (folder / "metadata").write_text(json.dumps(saved))
    return run_dir


def usage_error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exited:
        sample.parse_args([*map(str, args)])
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_guidance_flags_are_refused_in_one_line(capsys, tmp_path):
    assert parse_interval("0.28,2.9") == (0.28, 2.9) and parse_interval("") is None
    assert "needs 0 <= LO < HI" in usage_error(capsys, "--run_dir", "r", "--guidance_interval", "3,1")
    assert "must be LO,HI" in usage_error(capsys, "--run_dir", "r", "--guidance_interval", "0.3")
    assert "go with --guide_run" in usage_error(capsys, "--run_dir", "r", "--guide_scale", "2")
    assert "replaces classifier-free guidance" in usage_error(
        capsys, "--run_dir", "r", "--guide_run", "w", "--guide_scale", "2", "--guidance", "3"
    )
    assert "needs --guide_scale S" in usage_error(capsys, "--run_dir", "r", "--guide_run", "w")
    with pytest.raises(SystemExit) as exited:  # train/main.py's flag alike
        train_main.parse_config(["--run_dir", str(tmp_path / "r"), "--guidance_interval", "1,0.5"])
    assert exited.value.code == 2 and "needs 0 <= LO < HI" in capsys.readouterr().err


@pytest.mark.parametrize(
    "other, what",
    [
        (dict(image_shape=[16, 16, 1]), "sample shape"),
        (dict(num_classes=0), "condition"),
        (dict(codec={"kind": "latents", "autoencoder": "vae/"}), "codec"),
    ],
)
def test_a_guide_run_of_another_task_is_refused_naming_both_runs(tmp_path, other, what):
    run = config_only_run(tmp_path / "run")
    weak = config_only_run(tmp_path / "weak", **other)
    with pytest.raises(SystemExit) as refused:  # from the configs alone: nothing restored
        sample.main(
            sample.parse_args(
                [
                    "--run_dir",
                    str(run),
                    "--guide_run",
                    str(weak),
                    "--guide_scale",
                    "2",
                    "--out",
                    str(tmp_path / "s.npz"),
                ]
            )
        )
    message = refused.value.code
    assert f"--guide_run {weak} has {what}" in message and f"--run_dir {run} has" in message, message
    assert not (tmp_path / "s.npz").exists()


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    """A tiny digits run whose grids were guided in an interval (drawn with one sampler step: the grid is only
    checked to exist; the sampling itself is checked below, on fresh draws)."""
    run_dir = tmp_path_factory.mktemp("guide") / "main"
    train_here(
        "--run_dir",
        run_dir,
        *TINY,
        "--steps",
        4,
        "--sample_every",
        4,
        "--sample_steps",
        1,
        "--guidance_interval",
        "0.5,10",
    )
    assert (run_dir / "samples" / "step_000004.png").exists()
    return run_dir


# The guide: another run of the same task laid out otherwise (conftest's eight_device_run, FSDP over 2 devices where
# the main run has none) at one of its older checkpoints, --guide_step's (its newest is step 24).
GUIDE_STEP = 12


def drawn(tmp_path, *flags) -> np.ndarray:
    out = tmp_path / "s.npz"
    sample.main(
        sample.parse_args(["--num", "10", "--steps", "4", "--method", "euler", "--out", str(out), *map(str, flags)])
    )
    return np.load(out)["images"].astype(np.float32) / 127.5 - 1


def reference(run, denoise, num: int = 10, steps: int = 4) -> np.ndarray:
    """What sample.py's images should be: euler on the run's Karras grid from seed 0's noise, as uint8 does."""
    sigmas = karras_sigmas(steps, run.schedule.sigma_min, run.schedule.sigma_max)
    noise = np.random.default_rng(0).standard_normal((num, *run.image_shape), np.float32)
    out = run_sampler(denoise, jnp.float32(sigmas[0]) * noise, sigmas, "euler")
    return np.clip(np.round((np.asarray(out) + 1) * 127.5), 0, 255) / 127.5 - 1


@pytest.mark.slow  # a run trained (and the session's reference run), then sampled
def test_guide_run_samples_autoguidance_of_both_runs(tmp_path, main_run, eight_device_run):
    mesh = make_mesh(data=-1, fsdp=1)
    run, weak = load_run(main_run, mesh=mesh), load_run(eight_device_run, GUIDE_STEP, mesh=mesh)
    labels = jnp.asarray(sample.balanced_labels(10, list(range(10))))
    good, bad = (
        Denoiser(run.ema, run.schedule, run.parameterization),
        Denoiser(weak.ema, weak.schedule, weak.parameterization),
    )
    guide = ["--guide_run", eight_device_run, "--guide_step", GUIDE_STEP, "--guide_scale", "3"]
    images = drawn(tmp_path, "--run_dir", main_run, *guide)
    # Each scale an array, not a Python number: both references are one sampler program (and scale 1 is then
    # D_w + 1·(D - D_w), the main model alone up to rounding).
    expected = reference(run, AutoGuidance(good, bad, jnp.float32(3.0), labels))
    np.testing.assert_allclose(images, expected, atol=2.5 / 127.5)
    # The weak model is seen: the conditional model alone draws other images.
    assert np.abs(images - reference(run, AutoGuidance(good, bad, jnp.float32(1.0), labels))).max() > 0.1


@pytest.mark.slow  # a run trained, then sampled
def test_guidance_interval_samples_guidance_in_that_interval(tmp_path, main_run):
    run = load_run(main_run, mesh=make_mesh(data=-1, fsdp=1))
    labels = jnp.asarray(sample.balanced_labels(10, list(range(10))))
    good = Denoiser(run.ema, run.schedule, run.parameterization)
    null = run.ema.null_cond(10)
    images = drawn(tmp_path, "--run_dir", main_run, "--guidance", "30", "--guidance_interval", "0.5,10")
    expected = ClassifierFreeGuidance(good, labels, 30.0, null, interval=(0.5, 10.0))
    np.testing.assert_allclose(images, reference(run, expected), atol=2.5 / 127.5)
    everywhere = reference(run, ClassifierFreeGuidance(good, labels, 30.0, null))
    assert np.abs(images - everywhere).max() > 0.1  # the interval is seen
    # Without --guidance_interval: the run's own, as its grids used.
    np.testing.assert_array_equal(drawn(tmp_path, "--run_dir", main_run, "--guidance", "30"), images)
