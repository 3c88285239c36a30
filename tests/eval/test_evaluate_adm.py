"""ADM's evaluation suite against its references (tools/make_adm_eval_fixtures.py, on the random
weights of tests/data/inception): the spatial features of TF's mixed_6/conv (Mixed_6d.branch1x1),
pool3 and the unbiased 1008-way logits under both preprocessings (torch-fidelity's TF-exact one and
pytorch-fid's), TF1's bilinear resize, the Inception Score (ADM's and torch-fidelity's), FID (ADM's
FIDStatistics.frechet_distance) and precision/recall (ADM's ManifoldEstimator)."""

from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file
from tests.eval.test_inception import fid_weights  # the random state_dict pytorch-fid's network ran with

from eqxdiff.eval import BatchFeatures, adm_metrics, fid_from_stats, gaussian_stats, precision_recall
from eqxdiff.eval.adm_inception import ADMInception
from eqxdiff.eval.inception_score import inception_score
from eqxdiff.eval.resize import resize_bilinear_tf1

DATA = Path(__file__).parents[1] / "data" / "adm_eval"
TOLERANCE = 1e-4  # max abs difference / max abs reference: float32 networks, as tests/eval/test_inception.py


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(DATA / "reference.npz") as file:
        return dict(file)


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("inception") / "fid_inception.safetensors"
    save_file(fid_weights(), str(path))
    return path


@pytest.fixture(scope="module", params=["adm", "pytorch_fid"])
def net(request, weights_file) -> ADMInception:
    return ADMInception.from_pytorch_fid(weights_file, request.param)


@eqx.filter_jit
def features(net: ADMInception, images):
    return net(images)


def relative_error(ours, expected: np.ndarray) -> float:
    return float(np.abs(np.asarray(ours) - expected).max() / np.abs(expected).max())


def test_features_match_the_torch_networks(net, ref):
    """pool3, the spatial features of Mixed_6d.branch1x1 (a hook on the torch network: the layer ADM's
    mixed_6/conv is) and the unbiased logits, 40×56 images: torch-fidelity's network for "adm",
    pytorch-fid's for "pytorch_fid"."""
    prefix = {"adm": "adm", "pytorch_fid": "pfid"}[net.preprocess]
    pool3, spatial, logits = features(net, ref["images"])
    assert spatial.shape == (3, 2023) and logits.shape == (3, 1008)
    for name, ours in (("pool3", pool3), ("spatial", spatial), ("logits", logits)):
        assert relative_error(ours, ref[f"{prefix}_{name}"]) < TOLERANCE, name


def test_the_two_preprocessings_differ(ref):
    """The TF graph's resize and scaling are not pytorch-fid's: their features differ well beyond
    round-off, so the test above tells them apart."""
    assert relative_error(ref["adm_pool3"], ref["pfid_pool3"]) > 100 * TOLERANCE


def test_tf1_resize_matches_torch_fidelity(ref):
    """torch-fidelity's interpolate_bilinear_2d_like_tensorflow1x (TF1's kernel, no half-pixel centres)."""
    x = jnp.asarray(ref["images"][:1], jnp.float32)
    np.testing.assert_allclose(resize_bilinear_tf1(x, (23, 71)), ref["tf1_23x71"], rtol=0, atol=1e-4)
    full = np.asarray(resize_bilinear_tf1(x, (299, 299)))
    index = ref["resize_index"]
    np.testing.assert_allclose(full[:, index][:, :, index], ref["tf1_299"], rtol=0, atol=1e-4)


def test_inception_score_is_adms_and_torch_fidelitys(ref):
    """ADM's compute_inception_score (float32) in splits of 2 (10 splits of 20) and of 5000 (one), and
    torch-fidelity's isc_features_to_metric(splits=10, shuffle=False) (float64)."""
    logits = ref["is_logits"]
    assert abs(inception_score(logits, 2) - ref["is_adm_split2"]) < 1e-6 * ref["is_adm_split2"]  # float32's
    assert abs(inception_score(logits, 2) - ref["is_fidelity_10"]) < 1e-12 * ref["is_fidelity_10"]
    assert abs(inception_score(logits) - ref["is_adm_5000"]) < 1e-6 * ref["is_adm_5000"]


def test_fid_is_adms_frechet_distance(ref):
    """FIDStatistics.frechet_distance of np.mean/np.cov statistics: full rank, and 10 samples in 24
    dimensions (a singular covariance, where ADM's sqrtm and the eigenvalues here agree to ~1e-7).
    ADM's np.mean of float32 features is float32 (eqxdiff's statistics are float64): 2e-8 apart here."""
    y = gaussian_stats(ref["fid_y"].astype(np.float64))
    for x, expected in ((ref["fid_x"], ref["fid_adm"]), (ref["fid_x"][:10], ref["fid_adm_few"])):
        ours = fid_from_stats(*gaussian_stats(x.astype(np.float64)), *y)
        assert abs(ours - expected) < 1e-6 * expected


def test_precision_recall_is_adms_manifold_estimator(ref):
    """ADM's ManifoldEstimator (k = 3, blocks of 50 rows) with float32 distances; ADM's own float16
    distances differ here by one sample (precision 145 vs 144 of 150): a point within float16 round-off
    of a radius."""
    ours = precision_recall(ref["pr_real"], ref["pr_fake"], k=3)
    assert ours == tuple(ref["pr_adm32"])
    assert tuple(ref["pr_adm16"]) != tuple(ref["pr_adm32"])


def adm_inception_score(logits: np.ndarray) -> float:
    """ADM's evaluator.py compute_inception_score(activations, split_size=5000), written out for this test: softmax,
    then per split of 5000 rows exp(mean of sum p·(log p - log mean p)), averaged over the splits."""
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    softmax_out = e / e.sum(axis=1, keepdims=True)
    scores = []
    for i in range(0, len(softmax_out), 5000):
        part = softmax_out[i : i + 5000]
        kl = part * (np.log(part) - np.log(np.expand_dims(np.mean(part, 0), 0)))
        scores.append(np.exp(np.mean(np.sum(kl, 1))))
    return float(np.mean(scores))


def table(samples_pool3, samples_logits, reference_pool3=None) -> dict[str, float]:
    """adm_metrics' table (what evaluate.py prints) of features given directly, without stored statistics."""
    stats = lambda x: {w: gaussian_stats(np.asarray(x, np.float64)) for w in ("pool3", "spatial")}  # noqa: E731
    samples = BatchFeatures(samples_pool3, samples_logits, stats(samples_pool3))
    reference = (
        None if reference_pool3 is None else BatchFeatures(reference_pool3, samples_logits, stats(reference_pool3))
    )
    return adm_metrics(samples, reference, {})


def test_the_tables_inception_score_is_over_splits_of_5000():
    """12,000 images: ADM's splits of 5000, 5000 and 2000; a split of any other size scores otherwise here (the
    logits' classes drift along the rows, so each split's p(y) differs)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(12_000, 16)) * 3 + np.linspace(0, 6, 12_000)[:, None] * np.arange(16) / 16
    expected = adm_inception_score(logits)
    for other in (500, 1000, 12_000):
        assert abs(inception_score(logits, other) - expected) > 1e-3 * expected, other
    ours = table(rng.normal(size=(12_000, 2)), logits)["inception_score"]
    assert abs(ours - expected) < 1e-9 * expected


def manifold_estimate(real: np.ndarray, fake: np.ndarray, k: int) -> tuple[float, float]:
    """ADM's ManifoldEstimator.evaluate_pr by brute force: each set's radii its k-th nearest other point's distance
    (the full sorted distance matrix, column 0 the point itself), a point inside if within some radius."""

    def radii(x):
        return np.sort(np.linalg.norm(x[:, None] - x[None], axis=-1), axis=1)[:, k]

    def inside(query, support):
        return (np.linalg.norm(query[:, None] - support[None], axis=-1) <= radii(support)[None]).any(axis=1).mean()

    return float(inside(fake, real)), float(inside(real, fake))


def test_the_tables_precision_recall_take_3_neighbours():
    """A fixture where the neighbourhood size matters: k = 2, 3 and 4 give three different (precision, recall);
    the table's are k = 3's (ADM's nhood_sizes=(3,))."""
    rng = np.random.default_rng(3)
    real, fake = rng.normal(size=(60, 4)), rng.normal(size=(50, 4)) * 1.3 + 0.4
    by_k = {k: manifold_estimate(real, fake, k) for k in (2, 3, 4)}
    assert len(set(by_k.values())) == 3, by_k
    metrics = table(fake, rng.normal(size=(50, 8)), real)
    assert (metrics["precision"], metrics["recall"]) == by_k[3]
