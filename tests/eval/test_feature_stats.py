"""FID statistics: streaming float64 sums against np.mean / np.cov (pytorch-fid's formulas) in uneven
batches, with a large offset, merged from parts and gathered over processes; pytorch-fid's npz layout
and the errors for bad files; train/fid_stats.py on digits with a stand-in feature network."""

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import fid_stats  # train/fid_stats.py
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from eqxdiff.data import open_source
from eqxdiff.eval import FeatureStats, gather_feature_stats, load_stats, save_stats  # shape-checked (conftest)


def streamed(x, sizes):
    stats = FeatureStats(x.shape[1])
    for part in np.split(x, np.cumsum(sizes)[:-1]):
        stats.update(part)
    return stats


def assert_matches_numpy(stats, x, rtol=1e-12):
    mu, sigma = stats.mean_cov()
    assert mu.dtype == sigma.dtype == np.float64 and stats.count == len(x)
    reference = np.cov(x, rowvar=False)  # pytorch-fid's: ddof=1, in float64
    np.testing.assert_allclose(mu, np.mean(x.astype(np.float64), axis=0), rtol=rtol)
    np.testing.assert_allclose(sigma, reference, rtol=rtol, atol=rtol * np.abs(reference).max())
    np.testing.assert_array_equal(sigma, sigma.T)


def test_streaming_equals_np_cov_over_uneven_batches():
    x = (np.random.default_rng(0).normal(size=(1000, 12)) @ np.diag(np.arange(1.0, 13.0)) + 0.3).astype(np.float32)
    assert_matches_numpy(streamed(x, [1, 7, 300, 0, 692]), x)  # a batch of one, an empty one


def test_a_large_offset_costs_no_precision():
    # Features at 1e6 with unit spread: one-pass sums of x xᵀ minus n μμᵀ lose ε (|μ|/std)² ~ 1e-4 of the
    # covariance; sums about the first batch's mean do not.
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2000, 8)) @ rng.normal(size=(8, 8)) + 1e6
    assert_matches_numpy(streamed(x, [200] * 10), x, rtol=1e-9)
    m = x.mean(axis=0)
    naive = (x.T @ x - len(x) * np.outer(m, m)) / (len(x) - 1)
    assert np.abs(naive - np.cov(x, rowvar=False)).max() > 1e-6  # the failure this guards against


def test_merged_parts_equal_the_whole():
    # Parts from different places (each its own shift), as processes would hold them, one empty.
    rng = np.random.default_rng(2)
    parts = [
        rng.normal(size=(n, 6)) * s + o for n, s, o in [(300, 1.0, 5.0), (57, 3.0, -2.0), (0, 1.0, 0.0), (2, 1.0, 40.0)]
    ]
    merged = FeatureStats(6)
    for part in parts:
        merged.merge(streamed(part, [len(part)]))
    assert_matches_numpy(merged, np.concatenate(parts))


def test_gather_over_one_process_is_the_stats_themselves():
    x = np.random.default_rng(3).normal(size=(40, 5)) + 7.0
    stats = streamed(x, [13, 27])
    gathered = gather_feature_stats(stats)
    assert gathered is not stats and gathered.count == 40
    for a, b in zip(gathered.mean_cov(), stats.mean_cov(), strict=True):
        np.testing.assert_array_equal(a, b)  # float64 through uint32 words, bit for bit
    assert gather_feature_stats(FeatureStats(5)).count == 0  # a process with no examples


def test_bad_features_and_too_few_are_errors():
    stats = FeatureStats(4)
    with pytest.raises(ValueError, match="3 dimensions, these statistics 4"):
        stats.update(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        stats.update(np.full((2, 4), np.nan, np.float32))
    with pytest.raises(TypeCheckError):  # one vector, not a batch of them
        stats.update(np.zeros(4, np.float32))
    stats.update(np.ones((1, 4), np.float32))
    with pytest.raises(ValueError, match="at least 2 feature vectors; these statistics hold 1"):
        stats.mean_cov()
    with pytest.raises(ValueError, match="5-dimensional features into 4"):
        stats.merge(FeatureStats(5))


def test_npz_round_trip_in_pytorch_fids_layout(tmp_path):
    rng = np.random.default_rng(4)
    mu, sigma = rng.normal(size=6), np.cov(rng.normal(size=(20, 6)), rowvar=False)
    save_stats(tmp_path / "stats.npz", mu, sigma)
    with np.load(tmp_path / "stats.npz") as f:  # how pytorch-fid's compute_statistics_of_path reads it
        assert sorted(f.files) == ["mu", "sigma"] and f["mu"].dtype == f["sigma"].dtype == np.float64
        np.testing.assert_array_equal(f["mu"][:], mu)
    loaded = load_stats(tmp_path / "stats.npz", dim=6)
    np.testing.assert_array_equal(loaded[0], mu)
    np.testing.assert_array_equal(loaded[1], sigma)
    # pytorch-fid's --save-stats keeps np.mean of its float32 activations: mu float32.
    np.savez_compressed(tmp_path / "theirs.npz", mu=mu.astype(np.float32), sigma=sigma)
    theirs = load_stats(tmp_path / "theirs.npz")
    assert theirs[0].dtype == np.float64 and np.array_equal(theirs[0], mu.astype(np.float32))


def bad_file(tmp_path, name, **arrays):
    path = tmp_path / name
    if arrays:
        np.savez(path, **arrays)
    else:
        path.write_text("not an npz")
    return path


@pytest.mark.parametrize(
    ("arrays", "dim", "match"),
    [
        ({}, None, "not an .npz"),
        ({"mu": np.zeros(3)}, None, "lacks 'sigma'.*holds \\['mu'\\]"),
        ({"m": np.zeros(3), "s": np.eye(3)}, None, "lacks 'mu' and 'sigma'"),
        ({"mu": np.zeros((1, 3)), "sigma": np.eye(3)}, None, r"mu has shape \(1, 3\) and sigma \(3, 3\)"),
        ({"mu": np.zeros(3), "sigma": np.eye(4)}, None, r"mu has shape \(3,\) and sigma \(4, 4\)"),
        ({"mu": np.zeros(3), "sigma": np.eye(3)}, 2048, "3-dimensional features; 2048 are expected"),
        ({"mu": np.full(3, np.nan), "sigma": np.eye(3)}, None, "mu holds NaN"),
    ],
)
def test_bad_statistics_files_are_named(tmp_path, arrays, dim, match):
    with pytest.raises(ValueError, match=match):
        load_stats(bad_file(tmp_path, "bad.npz", **arrays), dim=dim)


def test_missing_file_and_wrong_suffix(tmp_path):
    with pytest.raises(FileNotFoundError, match="fid_stats.py"):
        load_stats(tmp_path / "none.npz")
    with pytest.raises(ValueError, match=r"\*\.npz"):
        save_stats(tmp_path / "stats.npy", np.zeros(2), np.eye(2))


def random_projection(dim=16):
    """A stand-in feature network: uint8 RGB [b, h, w, 3] -> a fixed random projection [b, dim]."""
    w = np.random.default_rng(5).normal(size=(8 * 8 * 3, dim)).astype(np.float32)
    return lambda images: (images.reshape(len(images), -1).astype(np.float32) / 255) @ w, w


def test_dataset_stats_of_digits_with_a_stand_in_network(tmp_path):
    features_fn, w = random_projection()
    source = open_source("digits")
    images = np.stack([source[i]["image"] for i in range(len(source))])  # 1,797 8×8×1: the last batch is padded
    x = np.repeat(images, 3, axis=-1).reshape(len(images), -1) / 255 @ w.astype(np.float64)
    whole = fid_stats.dataset_stats(source, features_fn, 64, progress=False)
    assert_matches_numpy(whole, x, rtol=1e-5)  # float32 features on the devices
    # Two processes' slices (each 32 images a batch over the 8 devices), merged: the same statistics.
    parts = [
        fid_stats.dataset_stats(source, features_fn, 64, process_index=p, process_count=2, progress=False)
        for p in range(2)
    ]
    assert [s.count for s in parts] == [898, 899]
    merged = parts[0].merge(parts[1])
    for a, b in zip(merged.mean_cov(), whole.mean_cov(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    # The script: flags, the gather, process 0's file.
    out = tmp_path / "digits.npz"
    fid_stats.main(
        fid_stats.parse_config(["--inception", "unused", "--out", str(out), "--batch_size", "64"]), features_fn
    )
    for a, b in zip(load_stats(out, dim=16), whole.mean_cov(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_fid_stats_flags_and_sources_are_checked():
    with pytest.raises(SystemExit):
        fid_stats.parse_config(["--inception", "x.pth", "--out", "stats.npy"])
    features_fn, _ = random_projection()
    with pytest.raises(ValueError, match="multiple of 8 devices"):
        fid_stats.dataset_stats(open_source("digits"), features_fn, 12)
    with pytest.raises(ValueError, match="one feature row per image"):
        fid_stats.dataset_stats(open_source("digits"), lambda images: images.sum(), 64)
