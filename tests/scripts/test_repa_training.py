"""train/main.py --repa_weight (REPA, eqxdiff/training/repa.py) as a user meets it: a DiT run that trains its projector,
checkpoints and resumes it bitwise, samples without it; and each wrong combination of flags as one line."""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.nn import DiT
from eqxdiff.run.rebuild import load_run
from eqxdiff.sharding import make_mesh
from runs import assert_bitwise_equal, saved_arrays, train_here
import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts

TOWER = Path(__file__).parents[1] / "data" / "dinov2" / "fd_dinov2" / "tower"  # a random 2-layer ViT/14, width 32
REPA = ["--repa_weight", "0.5", "--repa_encoder", TOWER, "--repa_projector_dim", "16"]
TINY_DIT = ["--model", "dit_tiny", "--batch_size", "16", "--warmup_steps", "1", "--sample_every", "0"]
TINY_DIT += ["--log_every", "1", "--wandb", "disabled", "--ckpt_every", "2"]


@pytest.mark.slow
def test_a_repa_run_trains_its_projector_resumes_bitwise_and_samples_without_it(tmp_path):
    train_here("--run_dir", tmp_path / "whole", *TINY_DIT, *REPA, "--steps", 4)
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")  # as if it had stopped after step 2's checkpoint
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    with pytest.raises(SystemExit, match=r"--repa_weight 0.25 \(saved: 0.5\) cannot change"):  # they define the run
        train_here("--run_dir", tmp_path / "resumed", "--steps", 4, "--repa_weight", 0.25)
    train_here("--run_dir", tmp_path / "resumed", "--steps", 4)  # the REPA flags come from the checkpoint
    whole = saved_arrays(tmp_path / "whole", 4)
    assert_bitwise_equal(saved_arrays(tmp_path / "resumed", 4), whole)
    projector = [k for k in whole if k.startswith("['model']['projector']")]
    moments = [k for k in whole if k.startswith("['opt_state']") and "['mu']['projector']" in k]
    assert len(projector) == len(moments) == 6
    assert all(np.abs(whole[k]).max() > 0 for k in moments)  # REPA's loss reaches it (weight decay alone: mu = 0)
    run = load_run(tmp_path / "whole", mesh=make_mesh(data=1, devices=jax.devices()[:1]))
    assert isinstance(run.ema, DiT) and run.stored["repa"] == {"block": 1, "z_dim": 32, "projector_dim": 16}


def test_wrong_repa_flags_are_one_line_each(tmp_path, capsys):
    import main as train_main

    with pytest.raises(SystemExit):
        train_main.parse_config(["--model", "dit_tiny", "--repa_weight", "0.5"])
    assert "pass --repa_encoder FOLDER, a transformers Dinov2Model folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main.parse_config(["--repa_weight", "-1", "--repa_encoder", str(TOWER)])
    assert "--repa_weight is REPA's λ, >= 0" in capsys.readouterr().err
    run = ["--run_dir", tmp_path / "run", "--batch_size", "16", "--wandb", "disabled"]
    with pytest.raises(SystemExit, match=r"--model unet builds UNet; use a DiT \(e.g. --model dit_s or dit_tiny\)"):
        train_here(*run, *REPA)
    with pytest.raises(SystemExit, match=r"--repa_block 3: --model dit_tiny has 2 blocks; pass one of 1..2"):
        train_here(*run, *REPA, "--model", "dit_tiny", "--repa_block", "3")
    with pytest.raises(SystemExit, match=r"--repa_encoder .*nowhere: no config.json there"):
        train_here(*run, *REPA, "--model", "dit_tiny", "--repa_encoder", tmp_path / "nowhere")
    flow = ["--objective", "meanflow", "--schedule", "flow", "--parameterization", "flow"]
    with pytest.raises(SystemExit, match=r"leave it off with --objective meanflow"):
        train_here(*run, *REPA, "--model", "dit_tiny", *flow)


def encoded(out: Path, *flags) -> Path:
    import encode as train_encode  # train/encode.py

    train_encode.main(
        train_encode.parse_config(["--dataset", "digits", "--vae", "space_to_depth:1", "--out", str(out), *flags])
    )
    return out


@pytest.fixture(scope="module")
def latents_with_features(tmp_path_factory) -> Path:
    """The digits encoded (space_to_depth:1) with the tower's features written ahead: checked against the tower
    below, trained on in the last test (one encode for both)."""
    return encoded(tmp_path_factory.mktemp("repa") / "latents", "--repa_encoder", str(TOWER))


def test_features_written_ahead_are_the_towers_and_a_latent_run_needs_them(tmp_path, latents_with_features):
    from eqxdiff.data import open_source
    from eqxdiff.nn import Dinov2Model
    from eqxdiff.training.repa import dinov2_targets

    latents = latents_with_features
    source = open_source(f"latents:{latents}")
    assert source.fields["repa_features"].shape == (16, 32)  # a 4×4 grid of DiT-patch-2 tokens on 8² latents, width 32
    images = open_source("digits").images[:2].astype(np.float32)
    tower = Dinov2Model.from_transformers(TOWER, interpolate_offset=0.1)
    expected = dinov2_targets(
        tower, jnp.asarray(np.repeat(images, 3, axis=-1)), 56
    )  # 14 · 4: the side of one token per DiT's
    stored = np.stack([source[i]["repa_features"] for i in range(2)]).astype(np.float32)
    np.testing.assert_allclose(stored, expected, rtol=2e-3, atol=2e-3)  # float16
    run = ["--model", "dit_tiny", "--batch_size", "16", "--wandb", "disabled", *REPA]
    with pytest.raises(SystemExit, match=r"--hflip flips the latents but not the DINOv2 features"):
        train_here("--run_dir", tmp_path / "run", "--dataset", f"latents:{latents}", "--hflip", *run)
    without = encoded(tmp_path / "without")
    with pytest.raises(SystemExit, match=r"encode it again with python train/encode.py ... --repa_encoder"):
        train_here("--run_dir", tmp_path / "run", "--dataset", f"latents:{without}", *run)


@pytest.mark.slow
def test_a_latent_run_trains_on_the_features_written_ahead(tmp_path, latents_with_features):
    latents = latents_with_features
    train_here("--run_dir", tmp_path / "run", "--dataset", f"latents:{latents}", *TINY_DIT, *REPA, "--steps", 2)
    arrays = saved_arrays(tmp_path / "run", 2)
    assert all(np.abs(v).max() > 0 for k, v in arrays.items() if "['mu']['projector']" in k)
