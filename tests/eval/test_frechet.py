"""FID from statistics against pytorch-fid's `calculate_frechet_distance` (tests/data/frechet/
reference.json, written by tools/make_frechet_fixtures.py, which also holds the recipes that build
the statistics here): within 1e-6 relative on well-conditioned, near-singular and identical
statistics and where pytorch-fid adds eps to the diagonals; `frechet_distance` (the digits
scorecard's) agrees with it wherever pytorch-fid does not offset."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import threadpoolctl

from runs import script_module

from eqxdiff.eval.frechet import fid_from_stats, frechet_distance

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = json.loads((ROOT / "tests" / "data" / "frechet" / "reference.json").read_text())
SLOW_D = 2048  # Inception's size: d × d eigendecompositions, a slow test


def _recipes():
    """tools/make_frechet_fixtures.py's numpy-only recipes (the module imports no torch)."""
    return script_module("tools/make_frechet_fixtures.py")


RECIPES = _recipes()
CASES = {case["name"]: case for case in REFERENCE["cases"]}


@pytest.fixture(autouse=True)
def one_blas_thread():
    """On a 2-core box shared with other jobs, OpenBLAS's threads spin against each other: one
    thread is many times faster there (BENCHMARKS.md, timings)."""
    with threadpoolctl.threadpool_limits(1):
        yield


def stats_of(case):
    stats = RECIPES.case_stats(case)
    for side, (mu, sigma) in enumerate((stats[:2], stats[2:])):  # the same numbers pytorch-fid saw
        np.testing.assert_allclose(RECIPES.checksums(mu, sigma), case["checksums"][side], rtol=1e-12, atol=1e-15)
    return stats


def pytorch_fid_here(mu1, sigma1, mu2, sigma2, eps=1e-6):
    """(FID, offset) as pytorch-fid 0.3.0's calculate_frechet_distance computes them on this machine:
    its numpy and scipy calls as written (fid_score.py), its print a returned flag."""
    with warnings.catch_warnings():  # scipy's "singular matrix" warning and disp's deprecation
        warnings.simplefilter("ignore")
        covmean = scipy.linalg.sqrtm(sigma1.dot(sigma2))
        offset = not np.isfinite(covmean).all()
        if offset:
            eye = np.eye(sigma1.shape[0]) * eps
            covmean = scipy.linalg.sqrtm((sigma1 + eye).dot(sigma2 + eye))
    if np.iscomplexobj(covmean):
        assert np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3)  # pytorch-fid raises here
        covmean = covmean.real
    diff = mu1 - mu2
    return diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean), offset


def check_parity(case):
    stats = stats_of(case)
    reference, offset = case["fid"], case["eps_offset"]
    if case["first"]["d"] < SLOW_D:
        # Whether sqrtm of a product with several zero eigenvalues comes out finite is decided by
        # round-off in its Schur form, so by the BLAS kernels: guard_2_vs_5_d64 offsets on the machine
        # that wrote the fixtures and not on a SkylakeX one. pytorch-fid's code, run here, decides.
        here, offset_here = pytorch_fid_here(*stats)
        if offset_here == offset:  # the code above is pytorch-fid's, up to this machine's round-off
            assert abs(here - reference) <= 1e-9 * (np.trace(stats[1]) + np.trace(stats[3]))
        reference, offset = here, offset_here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fid = fid_from_stats(*stats)
    assert [str(w.message).startswith("fid calculation produces singular product") for w in caught] == [offset] * offset
    if case["second"] == "same":
        # FID 0: pytorch-fid's sqrtm leaves round-off (-8.8e-6 at 50 samples in 256-d), so relative
        # to the cancelled terms, tr sigma1 + tr sigma2; the eigenvalue form is exact to ~1e-12 of them.
        scale = np.trace(stats[1]) + np.trace(stats[3])
        assert abs(fid - reference) <= 1e-6 * scale
        assert abs(fid) <= 1e-12 * scale
    else:
        assert fid == pytest.approx(reference, rel=1e-6)
    return stats, fid


QUICK = [name for name, case in CASES.items() if case["first"]["d"] < SLOW_D]


def test_the_reference_is_pytorch_fid_and_covers_each_kind_of_case():
    assert REFERENCE["reference"] == "pytorch_fid.fid_score.calculate_frechet_distance"
    assert REFERENCE["pytorch_fid"] == "0.3.0"
    assert [c["eps_offset"] for c in CASES.values()].count(True) == 3  # the guarded case, three times
    assert {c["first"]["d"] for c in CASES.values()} >= {64, 256, 2048}


@pytest.mark.parametrize("name", QUICK)
def test_fid_from_stats_equals_pytorch_fid(name):
    check_parity(CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in CASES if name not in QUICK])
def test_fid_from_stats_equals_pytorch_fid_at_inception_size(name):
    check_parity(CASES[name])


@pytest.mark.parametrize("name", ["well_d64", "few_vs_many_d256", "rank8_vs_full_d64", "guard_3_vs_5_d64"])
def test_frechet_distance_is_the_exact_value_pytorch_fid_offsets_away_from(name):
    # Without the offset the two agree; with it (eps = 1e-6 on both diagonals) pytorch-fid's value
    # moves away from the exact distance by ~1e-3 relative, which frechet_distance does not copy.
    stats = stats_of(CASES[name])
    exact = frechet_distance(*stats)
    reference, offset = pytorch_fid_here(*stats)
    assert offset == CASES[name]["eps_offset"]  # as on the machine that wrote the fixtures
    if offset:
        assert 1e-5 < abs(exact - reference) / exact < 1e-2
        with pytest.warns(RuntimeWarning, match="singular product"):
            assert fid_from_stats(*stats, eps=0.0) == pytest.approx(exact, rel=1e-10)
    else:
        assert exact == pytest.approx(reference, rel=1e-6)


def test_fid_from_stats_closed_forms():
    # Diagonal covariances commute: tr((Σ1Σ2)^½) = Σ √(a b); a point mass against N(mu2, Σ2): |Δμ|² + tr Σ2.
    rng = np.random.default_rng(0)
    mu1, mu2, a, b = rng.normal(size=5), rng.normal(size=5), rng.uniform(0.1, 3, 5), rng.uniform(0.1, 3, 5)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert fid_from_stats(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-12)
    assert fid_from_stats(mu1, np.zeros((5, 5)), mu2, np.diag(b)) == pytest.approx(
        np.sum((mu1 - mu2) ** 2) + b.sum(), rel=1e-12
    )
    # pytorch-fid's own statistics files hold mu as float32.
    assert fid_from_stats(mu1.astype(np.float32), np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("bad", ["mu1", "sigma2"])
def test_fid_from_stats_names_non_finite_statistics(bad):
    stats = {"mu1": np.zeros(3), "sigma1": np.eye(3), "mu2": np.zeros(3), "sigma2": np.eye(3)}
    stats[bad] = np.full_like(stats[bad], np.nan)
    with pytest.raises(ValueError, match=f"{bad} holds NaN"):
        fid_from_stats(**stats)
