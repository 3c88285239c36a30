"""FD-DINOv2 against NVlabs/edm2's calculate_metrics.py run on a random-weight DINOv2 (tools/make_dinov2_fixtures.py:
EDM2's own `DINOv2Detector` with facebookresearch/dinov2's hub model class, its statistics and distance): the
antialiased bicubic resize to 224, the detector's features, the statistics and the distance, and the scripts'
paths to it (train/fid_stats.py --dinov2, train/sample.py's --fid machinery with --dinov2, train/evaluate.py
--dinov2)."""

import argparse
import contextlib
import io
import json
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import evaluate  # train/evaluate.py
import fid_stats  # train/fid_stats.py
import sample  # train/sample.py
from eqxdiff.eval import DINOv2Features, FeatureStats, fid_from_stats, fid_of_samples, load_reference, save_stats
from eqxdiff.nn.bicubic import resize_bicubic
from sample_many import open_fid_flags  # train/sample_many.py

DATA = Path(__file__).parents[1] / "data" / "dinov2" / "fd_dinov2"
TOWER = DATA / "tower"


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(DATA / "reference.npz") as f:
        return dict(f)


@pytest.fixture(scope="module")
def detector() -> DINOv2Features:
    return DINOv2Features.from_transformers(TOWER)


@eqx.filter_jit
def features(detector, images):
    return detector(images)


@pytest.fixture(scope="module")
def detected(ref, detector) -> dict[str, np.ndarray]:
    """The detector's features of the two image sets, computed once for the tests that compare them (each a run of
    the tower on 48 images at 224²: compiled optimised, as the tests running the tower here, optimised_compile in
    tests/conftest.py: at the tests' -O0 each such run took longer than the program's optimised compile)."""
    from jax._src.compiler import _DISABLE_MOST_OPTIMIZATIONS

    before = _DISABLE_MOST_OPTIMIZATIONS.value
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        return {key: np.asarray(features(detector, ref[key])) for key in "ab"}
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


def relative(ours, theirs) -> float:
    return float(np.abs(np.asarray(ours, np.float64) - theirs).max() / np.abs(theirs).max())


@pytest.mark.parametrize("i", [0, 1], ids=["300x200_down", "7x9_up"])
def test_resize_is_torchs_antialiased_bicubic(ref, i):
    ours = resize_bicubic(ref[f"resize_in_{i}"], (224, 224), antialias=True)
    assert relative(ours, ref[f"resized_{i}"]) <= 1e-4
    plain = resize_bicubic(ref[f"resize_in_{i}"], (224, 224))  # without antialias: another image
    assert relative(plain, ref[f"resized_{i}"]) > 1e-3


@pytest.mark.parametrize("key", ["a", "b"])
def test_features_are_edm2s_detector(ref, detected, key):
    """32×32 and 40×24 uint8 images resized to 224², normalised, through the tower with the hub's position
    resize (16×16 patches from its 37×37 grid): EDM2's features."""
    assert relative(detected[key], ref[f"features_{key}"]) <= 1e-4


def test_the_hub_position_resize_matters(ref, detector, optimised_compile):
    """transformers 5's resize (interpolate_offset 0) at 224² gives other features than the hub model EDM2 runs."""
    transformers_resize = eqx.tree_at(lambda d: d.model, detector, type(detector.model).from_transformers(TOWER))
    assert relative(features(transformers_resize, ref["a"]), ref["features_a"]) > 1e-3


def test_statistics_and_distance_are_edm2s(ref, detected):
    """EDM2 sums features and outer products in float64 and takes scipy's sqrtm; eqxdiff's FeatureStats and
    fid_from_stats give its statistics and its fd_dinov2 from its features, and within 1e-4 from ours."""
    stats = {}
    for key in "ab":
        mu, sigma = FeatureStats(32).update(ref[f"features_{key}"]).mean_cov()
        np.testing.assert_allclose(mu, ref[f"mu_{key}"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(sigma, ref[f"sigma_{key}"], rtol=0, atol=1e-12)
        stats[key] = FeatureStats(32).update(detected[key]).mean_cov()
    assert ref["fd"] > 1  # the two sets differ
    np.testing.assert_allclose(
        fid_from_stats(ref["mu_a"], ref["sigma_a"], ref["mu_b"], ref["sigma_b"]), ref["fd"], rtol=1e-9
    )
    np.testing.assert_allclose(fid_from_stats(*stats["a"], *stats["b"]), ref["fd"], rtol=1e-4)


def test_fid_stats_writes_edm2s_statistics(ref, tmp_path, optimised_compile):
    np.savez(tmp_path / "b.npz", images=ref["b"])
    out = tmp_path / "b_dinov2.npz"
    fid_stats.main(
        fid_stats.parse_config(
            ["--dataset", f"npz:{tmp_path / 'b.npz'}", "--dinov2", str(TOWER), "--out", str(out), "--batch_size", "16"]
        )
    )
    reference = load_reference(out, dim=32)
    assert reference.image_shape == (40, 24, 3)
    assert relative(reference.mu, ref["mu_b"]) <= 1e-4 and relative(reference.sigma, ref["sigma_b"]) <= 1e-4


def test_sample_fid_flags_measure_fd_dinov2(ref, tmp_path, optimised_compile):
    """train/sample.py --fid STATS --dinov2 FOLDER: its network and reference (sample_many.open_fid_flags) and the
    streamed distance of the samples (fid_of_samples, as measure_fid calls it) are EDM2's fd_dinov2."""
    save_stats(tmp_path / "b.npz", ref["mu_b"], ref["sigma_b"])
    args = argparse.Namespace(inception="", dinov2=str(TOWER), fid=str(tmp_path / "b.npz"))
    net, reference = open_fid_flags(args, (32, 32, 3))
    result = fid_of_samples(lambda start, size: ref["a"][start : start + size], 48, net, reference, chunk_size=16)
    np.testing.assert_allclose(result["fid"], ref["fd"], rtol=1e-4)
    with pytest.raises(SystemExit, match="--dinov2: .*no config.json"):
        open_fid_flags(argparse.Namespace(inception="", dinov2=str(tmp_path), fid=str(tmp_path / "b.npz")), (32, 32, 3))


def test_adms_reference_batch_serves_fd_dinov2(ref, tmp_path, optimised_compile):
    """ADM's reference batch stores Inception's statistics beside its images: for FD-DINOv2 the images' statistics
    are computed (and match EDM2's); an image batch without statistics serves alike."""
    np.savez(tmp_path / "adm.npz", arr_0=ref["b"], mu=np.zeros(2048), sigma=np.eye(2048))
    np.savez(tmp_path / "images.npz", arr_0=ref["b"])
    for name in ("adm.npz", "images.npz"):
        args = argparse.Namespace(inception="", dinov2=str(TOWER), fid=str(tmp_path / name))
        with pytest.warns(UserWarning, match="holds statistics of 40×24×3 images, the samples are 32×32×3"):
            net, reference = open_fid_flags(args, (32, 32, 3))
        assert relative(reference.mu, ref["mu_b"]) <= 1e-4 and relative(reference.sigma, ref["sigma_b"]) <= 1e-4
        if name == "adm.npz":  # the distance from the reference: the same for the second file's (equal above)
            result = fid_of_samples(
                lambda start, size: ref["a"][start : start + size], 48, net, reference, chunk_size=16
            )
            np.testing.assert_allclose(result["fid"], ref["fd"], rtol=1e-4)


def test_flags_name_one_feature_network(capsys):
    sample.parse_args(["--run_dir", "r", "--fid", "s.npz", "--dinov2", "d"])  # accepted
    for extra in ([], ["--inception", "w.pth", "--dinov2", "d"]):
        with pytest.raises(SystemExit):
            sample.parse_args(["--run_dir", "r", "--fid", "s.npz", *extra])
        assert "--fid needs --inception FILE" in capsys.readouterr().err
    for extra in ([], ["--inception", "w.pth", "--dinov2", "d"]):
        with pytest.raises(SystemExit):
            fid_stats.parse_config(["--out", "s.npz", *extra])
        assert "or --dinov2 FOLDER" in capsys.readouterr().err


def test_evaluate_reports_fd_dinov2_alone(ref, tmp_path, optimised_compile):
    np.savez(tmp_path / "ref.npz", arr_0=ref["b"])
    np.savez(tmp_path / "samples.npz", arr_0=ref["a"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv = [str(tmp_path / "ref.npz"), str(tmp_path / "samples.npz"), "--dinov2", str(TOWER), "--batch_size", "16"]
        metrics = evaluate.main(evaluate.parse_args([*argv, "--json"]))
    line = json.loads(out.getvalue().strip())
    assert set(metrics) == {"fd_dinov2"} and line["fd_dinov2"] == metrics["fd_dinov2"]
    np.testing.assert_allclose(metrics["fd_dinov2"], ref["fd"], rtol=1e-4)
    np.savez(tmp_path / "stats_only.npz", mu=np.zeros(2048), sigma=np.eye(2048))
    with pytest.raises(SystemExit, match="--dinov2: FD-DINOv2 compares images"):
        evaluate.main(
            evaluate.parse_args(
                [str(tmp_path / "stats_only.npz"), str(tmp_path / "samples.npz"), "--dinov2", str(TOWER)]
            )
        )


@pytest.mark.slow
def test_eval_every_measures_fd_dinov2_of_the_samples_fid_sees(tmp_path):
    """train/main.py --eval_every with --dinov2: eval/fd_dinov2 beside eval/fid, of the same samples (one pass), and
    equal to what train/sample.py --fid --dinov2 measures of the final checkpoint with the run's count and seed."""
    from eqxdiff.data import open_source
    from runs import train_here
    from tests.eval.test_fid import projection, stand_in_reference

    np.savez(tmp_path / "digits.npz", images=open_source("digits").images[:64])
    dino_ref = tmp_path / "digits_dinov2.npz"
    fid_stats.main(fid_stats.parse_config(["--dataset", f"npz:{tmp_path / 'digits.npz'}", "--dinov2", str(TOWER),
                                           "--out", str(dino_ref), "--batch_size", "16"]))  # fmt: skip
    stand_in_reference(tmp_path / "ref.npz", image_shape=(8, 8, 1))
    evaluation = ["--eval_every", 2, "--eval_num", 20, "--fid_ref", tmp_path / "ref.npz", "--inception", "unused"]
    train_here("--run_dir", tmp_path / "run", "--dataset", f"npz:{tmp_path / 'digits.npz'}", "--model", "unet_tiny",
               "--batch_size", 16, "--steps", 2, "--sample_every", 0, "--sample_steps", 1, "--wandb", "disabled",
               *evaluation, "--dinov2", TOWER, "--fd_dinov2_ref", dino_ref, features_fn=projection)  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (logged,) = [r for r in rows if "eval/fd_dinov2" in r]
    assert logged["step"] == 2 and logged["eval/fd_dinov2"] > 0 and logged["eval/fid"] > 0
    out = tmp_path / "fd.jsonl"
    flags = ["--run_dir", tmp_path / "run", "--num", 20, "--steps", 1, "--batch_size", 16, "--seed", 0]
    sample.main(
        sample.parse_args([*map(str, flags), "--fid", str(dino_ref), "--dinov2", str(TOWER), "--fid_out", str(out)])
    )
    (line,) = [json.loads(s) for s in out.read_text().splitlines()]
    assert line["metric"] == "fd_dinov2" and line["fid"] == pytest.approx(logged["eval/fd_dinov2"], rel=1e-6)


def test_eval_every_dinov2_flags_come_in_pairs(tmp_path):
    from runs import train_here

    run = ["--run_dir", tmp_path / "run", "--batch_size", 16, "--wandb", "disabled"]
    with pytest.raises(SystemExit, match=r"--dinov2 measures FD-DINOv2 during training: pass --fd_dinov2_ref too"):
        train_here(*run, "--eval_every", 2, "--dinov2", TOWER)
    with pytest.raises(
        SystemExit, match=r"--dinov2 measures FD-DINOv2 in --eval_every's evaluation: pass --eval_every"
    ):
        train_here(*run, "--dinov2", TOWER, "--fd_dinov2_ref", tmp_path / "s.npz")
