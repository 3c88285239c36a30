"""FID of streamed samples (eqxdiff/eval/fid.py) against the whole feature set at once, the kept
random subset behind precision/recall, reference files that keep features, train/fid_stats.py
--keep_features, the flag checks of train/sample.py --fid and train/main.py --eval_every, and one
run of train/sample.py --fid on a checkpoint with a stand-in feature network."""

import json

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import fid_stats  # train/fid_stats.py
import numpy as np
import pytest

from eqxdiff.data import open_source
from eqxdiff.eval import (  # shape-checked (conftest)
    FIDReference,
    KeptFeatures,
    fid_from_stats,
    fid_of_samples,
    frechet_distance,
    frechet_distance_of_few,
    load_reference,
    load_stats,
    open_fid,
    precision_recall,
    save_reference,
    save_stats,
)
from eqxdiff.eval.fid import warn_if_other_data

DIM = 16
W = np.random.default_rng(5).normal(size=(8 * 8 * 3, DIM)).astype(np.float32)


def projection(images):
    """A stand-in feature network: uint8 RGB [b, 8, 8, 3] -> a fixed random projection [b, 16]."""
    return (images.reshape(len(images), -1).astype(np.float32) / 255) @ W


def host_features(images: np.ndarray) -> np.ndarray:
    """`projection` of grayscale images repeated to RGB, in float64 on the host (the reference)."""
    return np.repeat(images, 3, axis=-1).reshape(len(images), -1) / 255 @ W.astype(np.float64)


def random_images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 8, 8, 1), dtype=np.uint8)


def stand_in_reference(path, **about) -> str:
    """A reference file for `projection`: statistics (covariance made well-conditioned) and kept
    features of 8 random images (`about`: the dataset and image shape it claims to be of). Returns
    the path as a flag value."""
    x = host_features(random_images(8, 7))
    save_reference(path, x.mean(axis=0), np.cov(x, rowvar=False) + np.eye(DIM), x, **about)
    return str(path)


def test_streamed_fid_equals_fid_of_all_features_at_once():
    images = random_images(100, 0)  # grayscale: repeated to RGB on device
    x, ref_x = host_features(images), host_features(random_images(60, 1))
    reference = FIDReference(ref_x.mean(axis=0), np.cov(ref_x, rowvar=False), ref_x.astype(np.float32), "ref")
    calls = []

    def sample_chunk(start, size):
        calls.append((start, size))
        return images[start : start + size]

    result = fid_of_samples(sample_chunk, 100, projection, reference, chunk_size=24, seed=3)
    assert calls == [(0, 24), (24, 24), (48, 24), (72, 24), (96, 4)]
    expected = fid_from_stats(x.mean(axis=0), np.cov(x, rowvar=False), reference.mu, reference.sigma)
    assert result["num"] == 100 and result["fid"] == pytest.approx(expected, rel=1e-5)
    # Precision/recall: 60 reference rows against the 60 sample rows KeptFeatures(seed) chooses.
    chosen = KeptFeatures(100, 60, DIM, seed=3).indices
    assert (result["precision"], result["recall"]) == precision_recall(ref_x, x[chosen])
    # Fewer samples than dimensions: the exact distance from n × n matrices; no reference features, no P/R.
    few = fid_of_samples(
        sample_chunk, 12, projection, FIDReference(reference.mu, reference.sigma, None, "r"), chunk_size=24
    )
    expected = frechet_distance(x[:12].mean(axis=0), np.cov(x[:12], rowvar=False), reference.mu, reference.sigma)
    assert few.keys() == {"num", "fid"} and few["fid"] == pytest.approx(expected, rel=1e-5)


def test_several_networks_measure_one_pass_of_samples():
    """fids_of_samples (--eval_every's FID and FD-DINOv2): each chunk made once, each network's distance against the
    host's float64 statistics of its own features."""
    from eqxdiff.eval import fids_of_samples

    images = random_images(40, 0)
    w2 = np.random.default_rng(9).normal(size=(8 * 8 * 3, 4)).astype(np.float32)
    other = lambda x: (x.reshape(len(x), -1).astype(np.float32) / 255) @ w2  # noqa: E731 — a second stand-in
    x, y = host_features(images), np.repeat(images, 3, axis=-1).reshape(40, -1) / 255 @ w2.astype(np.float64)
    refs = [FIDReference(np.zeros(d), np.eye(d), None, name) for d, name in ((DIM, "a"), (4, "b"))]
    calls = []

    def sample_chunk(start, size):
        calls.append(start)
        return images[start : start + size]

    first, second = fids_of_samples(sample_chunk, 40, [(projection, refs[0]), (other, refs[1])], chunk_size=16)
    assert calls == [0, 16, 32]  # one pass for both
    for result, f, ref in ((first, x, refs[0]), (second, y, refs[1])):
        expected = fid_from_stats(f.mean(axis=0), np.cov(f, rowvar=False), ref.mu, ref.sigma)
        assert result == {"num": 40, "fid": pytest.approx(expected, rel=1e-5)}


def test_distance_of_few_features_equals_the_full_eigenvalue_form():
    # n < d samples against a full-rank and a rank-deficient reference: the d × d computation.
    rng = np.random.default_rng(6)
    x = rng.normal(size=(9, 30)) * rng.uniform(0.1, 3, size=30) + 2
    for ref_rows in (100, 12):
        r = rng.normal(size=(ref_rows, 30)) + 1
        mu, sigma = r.mean(axis=0), np.cov(r, rowvar=False)
        expected = frechet_distance(x.mean(axis=0), np.cov(x, rowvar=False), mu, sigma)
        assert frechet_distance_of_few(x, mu, sigma) == pytest.approx(expected, rel=1e-10)
    assert frechet_distance_of_few(x, x.mean(axis=0), np.cov(x, rowvar=False)) == pytest.approx(0, abs=1e-9)


def test_kept_features_are_the_chosen_rows_whatever_the_chunks():
    x = np.random.default_rng(2).normal(size=(50, 3)).astype(np.float32)
    kept = KeptFeatures(50, 10, 3, seed=4)
    for start, stop in [(0, 7), (7, 8), (8, 31), (31, 50)]:
        kept.update(x[start:stop], start)
    rows = kept.gather()
    assert len(np.unique(kept.indices)) == 10 and rows.shape == (10, 3)
    np.testing.assert_array_equal(np.sort(rows[:, 0]), np.sort(x[kept.indices, 0]))  # those rows, in some order
    # Every index is as likely: over 2,000 seeds each of 50 is kept 2000 * 10/50 = 400 ± 18 times.
    counts = np.bincount(np.concatenate([KeptFeatures(50, 10, 1, seed=s).indices for s in range(2000)]), minlength=50)
    assert np.abs(counts - 400).max() < 5 * 18
    kept.update(x, 0)  # a stream that passed its rows twice
    with pytest.raises(RuntimeError, match="seen \\[2\\] times"):
        kept.gather()
    with pytest.raises(ValueError, match="keep between 1 and 50"):
        KeptFeatures(50, 51, 3)


def test_reference_files_keep_features_that_pytorch_fid_ignores(tmp_path):
    x = host_features(random_images(30, 3))
    mu, sigma = x.mean(axis=0), np.cov(x, rowvar=False)
    save_reference(tmp_path / "ref.npz", mu, sigma, x[:20])
    with np.load(tmp_path / "ref.npz") as f:
        assert sorted(f.files) == ["features", "mu", "sigma"] and f["features"].dtype == np.float32
    np.testing.assert_array_equal(load_stats(tmp_path / "ref.npz")[0], mu)  # what pytorch-fid reads
    reference = load_reference(tmp_path / "ref.npz", dim=DIM)
    np.testing.assert_array_equal(reference.features, x[:20].astype(np.float32))
    save_stats(tmp_path / "plain.npz", mu, sigma)
    assert load_reference(tmp_path / "plain.npz").features is None
    with pytest.raises(ValueError, match="16-dimensional features; 2048 are expected"):
        load_reference(tmp_path / "ref.npz", dim=2048)
    np.savez(tmp_path / "bad.npz", mu=mu, sigma=sigma, features=np.zeros((5, 3)))
    with pytest.raises(ValueError, match=r"'features' has shape \(5, 3\).*--keep_features"):
        load_reference(tmp_path / "bad.npz")


def test_statistics_that_cannot_mean_anything_warn(tmp_path):
    """(Near) zero covariance (one image repeated), another image size or another dataset: a warning each,
    none for statistics of the same data written another way."""
    x = host_features(random_images(30, 3))
    mu, sigma = x.mean(axis=0), np.cov(x, rowvar=False)
    save_stats(tmp_path / "one_image.npz", mu, sigma * 1e-9)  # round-off around one image's features
    with pytest.warns(UserWarning, match=r"one_image.npz: the features' covariance is \(near\) zero"):
        load_reference(tmp_path / "one_image.npz")
    save_reference(tmp_path / "pets.npz", mu, sigma * 1e-5, dataset="folder:~/data/pets/", image_shape=(8, 8, 1))
    load_reference(tmp_path / "pets.npz")  # 1e-5 of the squared mean's scale is a (small) spread: no warning
    for shape, dataset, match in [
        (
            (16, 16, 1),
            "folder:/mnt/pets",
            r"statistics of 8×8×1 images, the samples are "
            r"16×16×1",
        ),
        (
            (8, 8, 1),
            "folder:~/data/cars",
            r"statistics of folder:~/data/pets/, "
            r"the model trained on folder:~/data/cars",
        ),
    ]:
        with pytest.warns(UserWarning, match=match) as warned:
            warn_if_other_data(load_reference(tmp_path / "pets.npz"), shape, dataset)
        assert len(warned) == 1
    warn_if_other_data(load_reference(tmp_path / "pets.npz"), (8, 8, 1), "folder:/mnt/pets")  # the same data


def test_open_fid_checks_the_network_against_the_statistics(tmp_path):
    save_stats(tmp_path / "five.npz", np.zeros(5), np.eye(5))
    with pytest.raises(ValueError, match="5-dimensional features; 16 are expected"):
        open_fid("", tmp_path / "five.npz", (8, 8, 1), projection)
    with pytest.raises(ValueError, match="--inception"):
        open_fid("", tmp_path / "five.npz", (8, 8, 1))
    with pytest.raises(ValueError, match="train/fid_stats.py"):
        open_fid("", "", (8, 8, 1), projection)


def test_fid_stats_keeps_a_random_subset_of_the_dataset_features(tmp_path):
    out = tmp_path / "digits.npz"
    argv = ["--inception", "unused", "--out", str(out), "--batch_size", "64", "--keep_features", "100"]
    fid_stats.main(fid_stats.parse_config(argv), projection)
    reference = load_reference(out, dim=DIM)
    assert (reference.dataset, reference.image_shape) == ("digits", (8, 8, 1))  # keys pytorch-fid ignores
    with np.load(out) as f:  # what pytorch-fid's calculate_fid_given_paths reads of a statistics file
        assert f["mu"].shape == (DIM,) and f["sigma"].shape == (DIM, DIM)
    source = open_source("digits")
    x = host_features(np.stack([source[i]["image"] for i in range(len(source))]))
    np.testing.assert_allclose(reference.mu, x.mean(axis=0), rtol=1e-5, atol=1e-6)
    # The rows KeptFeatures(seed 0) chooses, spread over the dataset (float32 features on the devices).
    chosen = KeptFeatures(len(source), 100, DIM, seed=0).indices
    assert chosen.max() > 1000 and len(np.unique(chosen)) == 100
    kept, expected = reference.features, x[chosen]
    np.testing.assert_allclose(kept[np.argsort(kept[:, 0])], expected[np.argsort(expected[:, 0])], atol=1e-5)


def test_fid_stats_of_one_image_repeated_warn(tmp_path):
    np.savez(tmp_path / "same.npz", images=np.repeat(random_images(1, 0), 16, axis=0))
    argv = [
        "--dataset",
        f"npz:{tmp_path / 'same.npz'}",
        "--inception",
        "unused",
        "--out",
        str(tmp_path / "s.npz"),
        "--batch_size",
        "8",
    ]
    with pytest.warns(UserWarning, match=r"npz:.*same.npz \(16 images\): the features' covariance is \(near\) zero"):
        fid_stats.main(fid_stats.parse_config(argv), projection)
    assert (tmp_path / "s.npz").is_file()  # written all the same: the warning says what it is worth


def test_flags_for_fid_are_checked_before_anything_loads(capsys, tmp_path):
    import main as train_main
    import sample
    from checks import check_eval  # train/checks.py

    with pytest.raises(SystemExit):
        sample.parse_args(["--run_dir", "r", "--fid", "stats.npz"])
    assert "--fid needs --inception" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sample.parse_args(["--run_dir", "r", "--json"])
    assert "--json prints --eval's scores: pass --eval too" in capsys.readouterr().err

    def check(*argv):
        check_eval(train_main.parse_config(["--eval_every", "100", *argv]))

    with pytest.raises(SystemExit, match="pass --fid_ref and --inception"):
        check()
    files = ["--fid_ref", "ref.npz", "--inception", "w.safetensors"]
    with pytest.raises(SystemExit, match="--eval_num must be >= 2"):
        check(*files, "--eval_num", "1")
    check(*files, "--eval_num", "100")  # not a multiple of --batch_size 64: the last batch is cut
    # A text run is refused once its condition is known, before the FID network loads (w.safetensors
    # does not exist) or anything compiles.
    with pytest.raises(SystemExit, match="train/sample.py --fid --prompts"):
        train_main.main(
            train_main.parse_config(
                ["--eval_every", "100", *files, "--dataset", "captioned_digits", "--run_dir", str(tmp_path / "run")]
            )
        )


@pytest.mark.slow
def test_sample_fid_end_to_end(eight_device_run, tmp_path, capsys):
    """train/sample.py --fid on a checkpoint, in-process with the stand-in network (InceptionV3's compile
    is the slow part on a CPU; its loading is open_fid's, its parity test_inception's)."""
    import sample

    stand_in_reference(tmp_path / "ref.npz", dataset="folder:~/pets", image_shape=(8, 8, 1))
    out = tmp_path / "fid.jsonl"
    # 12 samples in chunks of 8 (one per device): the second chunk padded to 8 and cut to 4.
    argv = [
        "--run_dir",
        str(eight_device_run),
        "--num",
        "12",
        "--batch_size",
        "8",
        "--steps",
        "2",
        "--fid",
        str(tmp_path / "ref.npz"),
        "--inception",
        "unused",
        "--fid_out",
        str(out),
    ]
    with pytest.warns(UserWarning, match="ref.npz holds statistics of folder:~/pets, the model trained on digits"):
        sample.main(sample.parse_args(argv), features_fn=projection)
    (line,) = [json.loads(s) for s in out.read_text().splitlines()]
    assert line["step"] == 24 and line["num"] == 12 and line["ref"] == str(tmp_path / "ref.npz")
    assert line["method"] == "heun" and line["fid"] > 0 and 0 <= line["precision"] <= 1 and 0 <= line["recall"] <= 1
    assert f"FID {line['fid']:.4f}  precision {line['precision']:.4f}" in capsys.readouterr().out

    # The same on 2 processes × 4 devices (train/launch_local.py): every process samples its rows of
    # each chunk, the features are gathered across processes, process 0 writes the one line.
    from runs import launch_local

    out2 = tmp_path / "fid_two_processes.jsonl"
    argv2 = [*argv[:-1], str(out2), "--cpu_devices", "4"]
    result = launch_local("--num_processes", 2, "--script", "tests/sample_stand_in.py", "--", *argv2)
    assert "[p0] FID" in result.stdout and "[p1] FID" not in result.stdout
    (line2,) = [json.loads(s) for s in out2.read_text().splitlines()]
    assert line2["num"] == 12 and line2["step"] == 24
    for key in ("fid", "precision", "recall"):  # the same samples and features as on one process
        np.testing.assert_allclose(line2[key], line[key], rtol=1e-5, err_msg=key)


def test_adm_batches_serve_as_references(tmp_path):
    """open_fid (train/sample.py --fid, training's --fid_ref) reads ADM's reference batch by its stored
    mu/sigma (its images and sFID statistics unread; a warning that they are the TF graph's), and a
    batch of images alone (ADM's sample-batch layout) by statistics and features computed from them."""
    images = np.repeat(random_images(12, 9), 3, axis=-1)
    x = host_features(images[..., :1])
    mu, sigma = x.mean(axis=0), np.cov(x, rowvar=False)
    np.savez(tmp_path / "adm_ref.npz", arr_0=images, mu=mu + 1, sigma=sigma, mu_s=np.zeros(3), sigma_s=np.eye(3))
    with pytest.warns(UserWarning, match="ADM's reference batch: its mu/sigma come from the TF graph"):
        _, stored = open_fid("", tmp_path / "adm_ref.npz", (8, 8, 3), projection)
    np.testing.assert_array_equal(stored.mu, mu + 1)
    assert stored.features is None
    np.savez(tmp_path / "images.npz", arr_0=images, arr_1=np.arange(12))
    _, computed = open_fid("", tmp_path / "images.npz", (8, 8, 3), projection)
    np.testing.assert_allclose(computed.mu, mu, rtol=1e-5, atol=1e-6)  # float32 features
    np.testing.assert_allclose(computed.sigma, sigma, rtol=0, atol=1e-5 * np.abs(sigma).max())
    np.testing.assert_allclose(computed.features, x, rtol=1e-5, atol=1e-6)
    assert computed.image_shape == (8, 8, 3)
    np.savez(tmp_path / "floats.npz", arr_0=images.astype(np.float32))
    with pytest.raises(ValueError, match=r"'arr_0' is float32 \[12, 8, 8, 3\]; ADM's batches hold uint8"):
        open_fid("", tmp_path / "floats.npz", (8, 8, 3), projection)
