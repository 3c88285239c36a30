"""Write tests/data/frechet/reference.json: pytorch-fid's `calculate_frechet_distance` on seeded
statistics pairs, for tests/eval/test_frechet.py's parity check of eqxdiff.eval.fid_from_stats.

The statistics are not stored (a 2048-d covariance is 32 MB): each case is a recipe, `case_stats`
below (numpy only), which the test imports from this file and runs identically; the JSON keeps the
recipes, pytorch-fid's distance, whether its eps-offset branch ran, and checksums of the statistics
(so a recipe that no longer gives the same numbers fails loudly instead of comparing other data).

pytorch-fid's fid_score.py imports torchvision at module level, which this venv does not have, so
`calculate_frechet_distance` is taken from the installed package's own source text (its
function definition only, run with numpy and scipy.linalg as fid_score imports them).

    tools/.venv/bin/pip install --no-deps pytorch-fid==0.3.0
    tools/.venv/bin/pip install scipy==1.17.1
    tools/.venv/bin/python tools/make_frechet_fixtures.py
"""

import argparse
import ast
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import warnings
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "frechet" / "reference.json"


def features(seed: int, n: int, d: int, rank: int = 0, offset: float = 0.3, scale: float = 1.0) -> np.ndarray:
    """n seeded d-dimensional feature vectors, float64. Like Inception's pool3 features (averages
    of ReLUs): ReLU(scale · z M + offset), z ~ N(0, I_d), M ~ N(0, 1/d) mixing. rank > 0: scale · z M
    + offset without the ReLU, z of rank dimensions, so the covariance has rank ≤ rank."""
    rng = np.random.default_rng(seed)
    k = rank or d
    x = scale * (rng.standard_normal((n, k)) @ (rng.standard_normal((k, d)) / np.sqrt(k))) + offset
    return x if rank else np.maximum(x, 0.0)


def side_stats(recipe: dict) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) of one recipe's features, as pytorch-fid forms them: np.mean, np.cov(rowvar=False)."""
    x = features(**recipe)
    return x.mean(axis=0), np.cov(x, rowvar=False)


def case_stats(case: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(mu1, sigma1, mu2, sigma2) of a case; "second": "same" repeats the first statistics."""
    first = side_stats(case["first"])
    second = first if case["second"] == "same" else side_stats(case["second"])
    return (*first, *second)


def checksums(mu: np.ndarray, sigma: np.ndarray) -> list[float]:
    """A few numbers that change if the statistics do: Σmu, tr sigma, Σ sigma, sigma[0, -1]."""
    return [
        float(mu.sum()),
        float(np.trace(sigma)),
        float(sigma.sum()),
        float(sigma[0, -1]),
    ]


OTHER = {"offset": 0.4, "scale": 1.1}  # the second set's shift and spread in most cases
CASES = [
    # Well-conditioned: more samples than dimensions, full-rank covariances.
    {"name": "well_d64", "first": {"seed": 1, "n": 512, "d": 64}, "second": {"seed": 2, "n": 512, "d": 64, **OTHER}},
    {
        "name": "well_d256",
        "first": {"seed": 3, "n": 1024, "d": 256},
        "second": {"seed": 4, "n": 1024, "d": 256, **OTHER},
    },
    # Near-singular: fewer samples than dimensions (rank n - 1), a low-rank set, a near point mass.
    {
        "name": "few_samples_d256",
        "first": {"seed": 5, "n": 50, "d": 256},
        "second": {"seed": 6, "n": 80, "d": 256, **OTHER},
    },
    {
        "name": "few_vs_many_d256",
        "first": {"seed": 5, "n": 50, "d": 256},
        "second": {"seed": 4, "n": 1024, "d": 256, **OTHER},
    },
    {
        "name": "rank8_vs_full_d64",
        "first": {"seed": 7, "n": 512, "d": 64, "rank": 8},
        "second": {"seed": 2, "n": 512, "d": 64, **OTHER},
    },
    {
        "name": "point_mass_d64",
        "first": {"seed": 8, "n": 16, "d": 64, "scale": 0.0},
        "second": {"seed": 2, "n": 512, "d": 64, **OTHER},
    },
    # Identical statistics: FID 0, where pytorch-fid's sqrtm leaves its round-off.
    {"name": "identical_d64", "first": {"seed": 1, "n": 512, "d": 64}, "second": "same"},
    {"name": "identical_few_d256", "first": {"seed": 5, "n": 50, "d": 256}, "second": "same"},
    # The case pytorch-fid's code guards: sqrtm(sigma1 sigma2) not finite, so eps = 1e-6 is added to both
    # diagonals. Two or three samples per set (found by search; the offset runs under scipy 1.15.3 too).
    {"name": "guard_2_vs_2_d32", "first": {"seed": 2, "n": 2, "d": 32}, "second": {"seed": 102, "n": 2, "d": 32}},
    {"name": "guard_2_vs_5_d64", "first": {"seed": 2, "n": 2, "d": 64}, "second": {"seed": 102, "n": 5, "d": 64}},
    {"name": "guard_3_vs_5_d64", "first": {"seed": 2, "n": 3, "d": 64}, "second": {"seed": 102, "n": 5, "d": 64}},
    # Inception's size (a slow test: d × d eigendecompositions). 100 samples in 2048-d, too, agree within
    # 7e-8 but are left out: scipy's sqrtm deciding on pytorch-fid's offset makes them slower still.
    {
        "name": "well_d2048",
        "first": {"seed": 9, "n": 4096, "d": 2048},
        "second": {"seed": 10, "n": 4096, "d": 2048, **OTHER},
    },
]


def pytorch_fid_distance():
    """pytorch-fid's calculate_frechet_distance, from the installed package's fid_score.py, and
    that file's sha256."""
    spec = importlib.util.find_spec("pytorch_fid")
    if spec is None:
        raise SystemExit("pytorch-fid is not installed here: pip install --no-deps pytorch-fid==0.3.0")
    path = Path(spec.submodule_search_locations[0]) / "fid_score.py"
    source = path.read_text()
    (fn,) = [
        n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "calculate_frechet_distance"
    ]
    from scipy import linalg  # fid_score: `from scipy import linalg`

    namespace = {"np": np, "linalg": linalg}
    exec(compile(ast.Module([fn], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102 — the installed package's own code
    return namespace["calculate_frechet_distance"], hashlib.sha256(source.encode()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    import scipy

    distance, source_sha256 = pytorch_fid_distance()
    cases = []
    for case in CASES:
        mu1, sigma1, mu2, sigma2 = case_stats(case)
        printed, error, fid = io.StringIO(), None, None
        with contextlib.redirect_stdout(printed), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scipy 1.16+: sqrtm's disp= deprecation and singular-matrix warnings
            try:
                fid = float(distance(mu1, sigma1, mu2, sigma2))
            except ValueError as e:  # "Imaginary component ...": with scipy <= 1.15 on a point mass
                error = str(e)
        offset = "singular product" in printed.getvalue()  # its message when the eps offset runs
        cases.append(
            {
                **case,
                "fid": fid,
                "eps_offset": offset,
                **({"error": error} if error else {}),
                "checksums": [checksums(mu1, sigma1), checksums(mu2, sigma2)],
            }
        )
        print(f"{case['name']:22s} fid {fid!r:24} eps offset: {offset} {error or ''}", flush=True)
    reference = {
        "reference": "pytorch_fid.fid_score.calculate_frechet_distance",
        "pytorch_fid": importlib.metadata.version("pytorch-fid"),
        "fid_score_sha256": source_sha256,
        "scipy": scipy.__version__,
        "numpy": np.__version__,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
