"""train/evaluate.py end to end on ADM-format batches, against ADM's table computed by its own math on
torch-fidelity's features of the same random-weight network (tools/make_adm_eval_fixtures.py), once
against a reference batch's stored statistics and once against recomputed ones; and its refusals of
bad input: one line naming the fix (on its command line, status 2: tests/scripts/test_script_errors.py)."""

import contextlib
import io
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file
from tests.eval.test_inception import fid_weights

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import evaluate  # train/evaluate.py
from eqxdiff.eval import adm_eval, frechet
from eqxdiff.eval.adm_inception import ADMInception

DATA = Path(__file__).parents[1] / "data" / "adm_eval"


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(DATA / "reference.npz") as file:
        return dict(file)


@pytest.fixture(scope="module")
def net(tmp_path_factory) -> ADMInception:
    path = tmp_path_factory.mktemp("inception") / "fid_inception.safetensors"
    save_file(fid_weights(), str(path))
    return ADMInception.from_pytorch_fid(path)


@pytest.fixture(scope="module")
def batches(ref, tmp_path_factory) -> tuple[Path, Path]:
    """ADM's layout: the reference batch with its images and "stored" statistics (np.mean / np.cov of
    the torch features of its images flipped: other statistics than its images give), the sample
    batch with labels."""
    folder = tmp_path_factory.mktemp("batches")
    pool3, spatial = ref["e2e_stored_pool3"], ref["e2e_stored_spatial"]
    np.savez(
        folder / "ref.npz",
        arr_0=ref["e2e_ref"],
        mu=pool3.mean(0),
        sigma=np.cov(pool3, rowvar=False),
        mu_s=spatial.mean(0),
        sigma_s=np.cov(spatial, rowvar=False),
    )
    np.savez(folder / "samples.npz", arr_0=ref["e2e_samples"], arr_1=np.arange(10) % 3)
    return folder / "ref.npz", folder / "samples.npz"


def eigenvalues_of_low_rank(cov1: np.ndarray, cov2: np.ndarray, rank: int = 16) -> np.ndarray:
    """frechet.product_eigenvalues' values (those of cov1^½ cov2 cov1^½, ascending, d of them) for a cov1 of rank
    below `rank`, from `rank` × `rank` matrices: Q spans cov1's range (cov1 times `rank` random vectors), so cov1 =
    Q B Qᵀ with B = Qᵀ cov1 Q = U w Uᵀ, cov1^½ = Q U √w Uᵀ Qᵀ, and the nonzero eigenvalues of cov1^½ cov2 cov1^½
    are those of √w Uᵀ Qᵀ cov2 Q U √w (AB and BA share them); the other d - `rank` are 0."""
    q, _ = np.linalg.qr(cov1 @ np.random.default_rng(0).normal(size=(len(cov1), rank)))
    w, u = np.linalg.eigh(q.T @ cov1 @ q)
    assert np.allclose(q @ (u * w) @ u.T @ q.T, cov1, rtol=0, atol=1e-9 * w.max()), "cov1 is not of low rank"
    half = q @ u * np.sqrt(np.clip(w, 0.0, None))
    return np.concatenate([np.zeros(len(cov1) - rank), np.linalg.eigvalsh(half.T @ cov2 @ half)])


@pytest.fixture(scope="module")
def json_line(net, batches) -> tuple[dict, dict]:
    """(the metrics main returns, its one JSON line): batches of 3 over conftest's 8 devices, padded
    (the padding cut off). One run serves the tests below.

    Each FID of fewer samples than dimensions asks whether pytorch-fid would offset the covariances, which
    takes scipy's sqrtm of a 2048² product (30 of the run's 40 s on an idle 2-core box). The reference's
    answer for these statistics is no, four times: an offset moves a FID by ~1e-3 relative, and the values
    below match the reference to 1e-4. So the stand-in gives that answer and counts the questions; the
    decision itself is tests/eval/test_frechet.py's, against pytorch-fid's own code. The eigenvalues of
    each FID (two d × d eigendecompositions, 4-18 s per FID on a 2-core box) come from the samples'
    covariance of rank 9 (eigenvalues_of_low_rank), the d × d form being test_frechet.py's against pytorch-fid."""
    asked = []
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(frechet, "_pytorch_fid_offsets", lambda s1, s2, lam: asked.append(len(lam)) or False)
        patch.setattr(frechet, "product_eigenvalues", eigenvalues_of_low_rank)
        patch.setattr(evaluate, "batch_features", kept(evaluate.batch_features))
        unoptimised = jax.config.values["jax_disable_most_optimizations"]
        jax.config.update("jax_disable_most_optimizations", False)  # conftest's optimised_compile: the net at 299²
        try:
            args = evaluate.parse_args([*map(str, batches), "--batch_size", "3", "--json"])
            metrics = evaluate.main(args, network=net)
        finally:
            jax.config.update("jax_disable_most_optimizations", unoptimised)
    assert sorted(asked) == [2023, 2023, 2048, 2048]  # FID and sFID, against stored and recomputed statistics
    assert sorted(FEATURES) == sorted(map(str, batches))
    return metrics, json.loads(out.getvalue().strip())


FEATURES = {}  # json_line's run: each batch file's features, by path


def kept(batch_features):
    def keep(network, path, *args, **kwargs):
        FEATURES[str(path)] = batch_features(network, path, *args, **kwargs)
        return FEATURES[str(path)]

    return keep


@pytest.mark.slow
def test_the_table_is_adms(ref, json_line):
    """Every number of ADM's table, FID and sFID against the stored and the recomputed statistics."""
    metrics, line = json_line
    assert line["num_samples"] == 10 and line["num_reference"] == 8 and line["preprocess"] == "adm"
    for key in ("fid_stored", "fid_recomputed", "sfid_stored", "sfid_recomputed"):
        assert abs(line[key] - ref[f"e2e_{key}"]) < 1e-4 * ref[f"e2e_{key}"], key
    assert abs(line["inception_score"] - ref["e2e_is"]) < 1e-5 * ref["e2e_is"]
    assert (line["precision"], line["recall"]) == (ref["e2e_precision"], ref["e2e_recall"])
    assert metrics == {k: v for k, v in line.items() if k in metrics}


@pytest.mark.slow
def test_the_table_says_what_each_fid_is_against(json_line, batches):
    table = evaluate.format_table(
        json_line[0], evaluate.parse_args(list(map(str, batches))), {"samples": 10, "reference": 8}
    )
    rows = table.splitlines()[2:]
    assert [r.split()[0] for r in rows] == ["Inception", "FID", "FID", "sFID", "sFID", "Precision", "Recall"]
    assert "stored in the reference batch" in rows[1] and "recomputed from the reference images" in rows[2]
    assert f"{json_line[0]['fid_stored']:.4f}" in rows[1] and f"{json_line[0]['fid_recomputed']:.4f}" in rows[2]


@pytest.mark.slow  # train/evaluate.py end to end
def test_a_reference_of_statistics_only_gives_the_stored_lines(
    ref, net, batches, json_line, tmp_path, capsys, monkeypatch
):
    # The values are test_the_table_is_adms's; here which statistics each Fréchet distance is taken
    # against (a d × d one of fewer samples than dimensions takes seconds, so a stand-in records them),
    # from the sample batch's features of json_line's run (the same network on the same file: the same work).
    against = []
    monkeypatch.setattr(adm_eval, "fid_from_stats", lambda mu1, s1, mu2, s2: against.append(mu2) or float(len(against)))
    monkeypatch.setattr(evaluate, "batch_features", lambda network, path, *args: FEATURES[str(path)])
    with np.load(batches[0]) as f:
        stats = {k: f[k] for k in ("mu", "sigma", "mu_s", "sigma_s")}
    np.savez(tmp_path / "stats.npz", **stats)
    evaluate.main(
        evaluate.parse_args([str(tmp_path / "stats.npz"), str(batches[1]), "--batch_size", "3", "--json"]), network=net
    )
    line = json.loads(capsys.readouterr().out.strip())
    assert set(line) == {"inception_score", "fid_stored", "sfid_stored", "num_samples", "num_reference", "preprocess"}
    assert len(against) == 2 and np.array_equal(against[int(line["fid_stored"]) - 1], stats["mu"])
    assert np.array_equal(against[int(line["sfid_stored"]) - 1], stats["mu_s"])
    assert abs(line["inception_score"] - ref["e2e_is"]) < 1e-5 * ref["e2e_is"]


def refusal(*args) -> str:
    with pytest.raises(SystemExit) as refused:
        evaluate.main(evaluate.parse_args([*map(str, args)]), network=None)
    assert isinstance(refused.value.code, str)
    return refused.value.code


@pytest.mark.parametrize(
    "arrays, phrase",
    [
        ({"images": np.zeros((2, 8, 8, 3), np.uint8)}, "has no 'arr_0'"),
        ({"arr_0": np.zeros((2, 8, 8, 3), np.float32)}, "uint8 images [n, h, w, 3]"),
        ({"arr_0": np.zeros((2, 8, 8), np.uint8)}, "uint8 [2, 8, 8]"),
        ({"arr_0": np.zeros((2, 8, 8, 4), np.uint8)}, "[2, 8, 8, 4]"),
    ],
)
def test_a_bad_sample_batch_is_named(batches, tmp_path, arrays, phrase):
    np.savez(tmp_path / "bad.npz", **arrays)
    line = refusal(batches[0], tmp_path / "bad.npz", "--inception", tmp_path / "none.pth")
    assert str(tmp_path / "bad.npz") in line and phrase in line


def test_bad_reference_batches_are_named(batches, tmp_path):
    assert "No batch file" in refusal(tmp_path / "none.npz", batches[1])
    (tmp_path / "text.npz").write_text("mu, sigma")
    assert "is not an .npz file" in refusal(tmp_path / "text.npz", batches[1])
    np.savez(tmp_path / "half.npz", arr_0=np.zeros((4, 8, 8, 3), np.uint8), mu=np.zeros(2048))
    assert "'mu' without its pair" in refusal(tmp_path / "half.npz", batches[1])
    np.savez(tmp_path / "small.npz", mu=np.zeros(64), sigma=np.eye(64))
    assert "[64], 'sigma' [64, 64]; ADM's pool3 statistics are [2048]" in refusal(tmp_path / "small.npz", batches[1])
    np.savez(tmp_path / "other.npz", features=np.zeros((4, 2048)))
    assert "holds neither images 'arr_0' nor ADM's statistics" in refusal(tmp_path / "other.npz", batches[1])


def test_missing_weights_are_named_after_the_batches_are_checked(batches, tmp_path):
    assert refusal(*batches).startswith("--inception: pass pytorch-fid's")
    assert "does not exist" in refusal(*batches, "--inception", tmp_path / "none.pth")
