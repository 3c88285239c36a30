"""Write tests/data/adm_eval/reference.npz: the references for ADM's evaluation suite in eqxdiff
(eqxdiff/eval/adm_inception.py, inception_score.py, adm_batches.py, train/evaluate.py).

The references are ADM's evaluator math (openai/guided-diffusion, evaluations/evaluator.py, MIT
License, Copyright (c) 2021 OpenAI: `FIDStatistics.frechet_distance`, `compute_statistics`,
`compute_inception_score`, `ManifoldEstimator` and `DistanceBlock`, copied below with TensorFlow's
parts rewritten in numpy) and torch-fidelity's (its Inception Score, its TF-exact Inception features
and TF1 bilinear resize), and pytorch-fid's network, all on the random weights of
tests/data/inception/weights.json (tools/make_fid_fixtures.py's recipe, replayed here):

- network: `images` uint8 [3, 40, 56, 3] -> for each preprocessing ("adm": torch-fidelity's
  FeatureExtractorInceptionV3, the TF graph's TF1 resize and (x - 128)/128; "pfid": pytorch-fid's
  InceptionV3) pool3 [3, 2048], spatial [3, 2023] (a forward hook on Mixed_6d.branch1x1, NCHW -> NHWC,
  first 7 channels, flattened) and the unbiased logits [3, 1008]; TF1 resizes of `images[0]` to 23×71
  in full and to 299×299 on the rows and columns `resize_index`.
- metrics on random arrays: IS of `is_logits` [20, 1008] (ADM's with split_size 2 and 5000,
  torch-fidelity's with 10 splits unshuffled), FID of `fid_x` [80, 24] and `fid_y` [100, 24] and of a
  rank-deficient `fid_x[:10]`, precision/recall of `pr_real` [120, 64], `pr_fake` [150, 64] with
  ADM's float16 distances and with float32 ones (row/column blocks of 50).
- end to end: `e2e_ref` uint8 [8, 32, 32, 3] and `e2e_samples` [10, 32, 32, 3] through ADM's table
  (IS, FID, sFID, precision, recall) on the "adm" features, once against statistics recomputed from
  `e2e_ref` and once against statistics "stored" from the features of `e2e_ref` flipped left-right
  (`e2e_stored_pool3`, `e2e_stored_spatial`: the test writes the reference batch's mu/sigma from them).

Run in the tools venv (requirements-adm-eval.txt); torchvision's compiled ops do not load against this
CPU torch, so as tools/make_fid_fixtures.py does, torchvision's Python inception file comes from a wheel:

    tools/.venv/bin/pip install --no-deps pytorch-fid==0.3.0 torch-fidelity==0.4.0
    tools/.venv/bin/pip download --no-deps torchvision==0.28.0 -d /tmp/tv
    tools/.venv/bin/python tools/make_adm_eval_fixtures.py --torchvision /tmp/tv/torchvision-0.28.0-*.whl
"""

import argparse
import importlib.metadata
import importlib.util
import json
import sys
import tempfile
import types
import warnings
from pathlib import Path

import numpy as np
import torch
from scipy import linalg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fid_fixtures import digest, draw, images, import_torchvision_inception, stub_package, to_torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = ROOT / "tests" / "data" / "inception" / "weights.json"
OUT = ROOT / "tests" / "data" / "adm_eval"
RESIZE_INDEX = np.r_[0:299:10, 297, 298]
SPATIAL = "Mixed_6d.branch1x1"  # TF's mixed_6/conv (eqxdiff/eval/adm_inception.py says why)


# ---- ADM's evaluator math (guided-diffusion evaluations/evaluator.py, MIT), TF parts in numpy ----


def frechet_distance(mu1, sigma1, mu2, sigma2, eps=1e-6):
    """FIDStatistics.frechet_distance, as ADM has it."""
    mu1, mu2 = np.atleast_1d(mu1), np.atleast_1d(mu2)
    sigma1, sigma2 = np.atleast_2d(sigma1), np.atleast_2d(sigma2)
    diff = mu1 - mu2
    covmean, _ = linalg.sqrtm(sigma1.dot(sigma2), disp=False)
    if not np.isfinite(covmean).all():
        warnings.warn(f"fid calculation produces singular product; adding {eps} to diagonal of cov estimates")
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"Imaginary component {np.max(np.abs(covmean.imag))}")
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def compute_statistics(activations):
    """Evaluator.compute_statistics: (mu, sigma) of float32 activations."""
    return np.mean(activations, axis=0), np.cov(activations, rowvar=False)


def softmax32(logits):
    """TF's tf.nn.softmax in float32 (of pool3 @ softmax/logits/MatMul's weight, no bias)."""
    x = np.asarray(logits, np.float32)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def compute_inception_score(logits, split_size=5000):
    """Evaluator.compute_inception_score on the softmax of the logits."""
    preds = softmax32(logits)
    scores = []
    for i in range(0, len(preds), split_size):
        part = preds[i : i + split_size]
        kl = part * (np.log(part) - np.log(np.expand_dims(np.mean(part, 0), 0)))
        kl = np.mean(np.sum(kl, 1))
        scores.append(np.exp(kl))
    return float(np.mean(scores))


def batch_pairwise_distances(u, v, dtype):
    """_batch_pairwise_distances in `dtype`: squared distances from the expanded form, clipped at 0."""
    u, v = u.astype(dtype), v.astype(dtype)
    norm_u = np.sum(np.square(u), 1).reshape(-1, 1)
    norm_v = np.sum(np.square(v), 1).reshape(1, -1)
    return np.maximum(norm_u - 2 * np.matmul(u, v.T) + norm_v, dtype(0))


def distance_block(u, v, half=True):
    """DistanceBlock.distance_block: float16 distances, float32 where float16 overflows (or always)."""
    if half:
        d16 = batch_pairwise_distances(u, v, np.float16)
        if np.isfinite(d16).all():
            return d16.astype(np.float32)
    return batch_pairwise_distances(u, v, np.float32)


def manifold_radii(features, k=3, batch=50, half=True):
    """ManifoldEstimator.manifold_radii (nhood_sizes=(k,)): the k-th smallest squared distance in each
    row, its own zero included at index 0."""
    n = len(features)
    radii = np.zeros([n, 1], np.float32)
    distance_batch = np.zeros([batch, n], np.float32)
    for b1 in range(0, n, batch):
        e1 = min(b1 + batch, n)
        for b2 in range(0, n, batch):
            e2 = min(b2 + batch, n)
            distance_batch[0 : e1 - b1, b2:e2] = distance_block(features[b1:e1], features[b2:e2], half)
        radii[b1:e1, :] = np.partition(distance_batch[0 : e1 - b1, :], np.arange(k + 1), axis=1)[:, [k]]
    return radii


def evaluate_pr(f1, r1, f2, r2, batch=50, half=True):
    """ManifoldEstimator.evaluate_pr with DistanceBlock.less_thans: (precision, recall)."""
    s1 = np.zeros([len(f1), 1], bool)
    s2 = np.zeros([len(f2), 1], bool)
    for b1 in range(0, len(f1), batch):
        for b2 in range(0, len(f2), batch):
            d = distance_block(f1[b1 : b1 + batch], f2[b2 : b2 + batch], half)[..., None]
            s1[b1 : b1 + batch] |= np.any(d <= r2[b2 : b2 + batch], axis=1)
            s2[b2 : b2 + batch] |= np.any(d <= r1[b1 : b1 + batch][:, None], axis=0)
    return float(np.mean(s2.astype(np.float64))), float(np.mean(s1.astype(np.float64)))


def compute_prec_recall(ref, sample, half=True):
    """Evaluator.compute_prec_recall."""
    return evaluate_pr(ref, manifold_radii(ref, half=half), sample, manifold_radii(sample, half=half), half=half)


# ---- the networks ----


def torch_fidelity_parts():
    """torch-fidelity's feature extractor, TF1 resize and IS without its package __init__ (which
    imports torchvision's compiled ops): the package stubbed, `utils` (datasets; torchvision) stood in
    for by the four names metric_isc imports and never calls in isc_features_to_metric."""
    spec = importlib.util.find_spec("torch_fidelity")
    stub_package("torch_fidelity", spec.submodule_search_locations[0])
    utils = types.ModuleType("torch_fidelity.utils")
    for name in (
        "extract_featuresdict_from_input_id_cached",
        "create_feature_extractor",
        "resolve_feature_extractor",
        "resolve_feature_layer_for_metric",
    ):
        setattr(utils, name, None)
    sys.modules["torch_fidelity.utils"] = utils
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
    from torch_fidelity.interpolate_compat_tensorflow import interpolate_bilinear_2d_like_tensorflow1x
    from torch_fidelity.metric_isc import isc_features_to_metric

    return FeatureExtractorInceptionV3, interpolate_bilinear_2d_like_tensorflow1x, isc_features_to_metric


def spatial_hook(inception, store: list):
    """Keep Mixed_6d.branch1x1's output of `inception` (a torchvision-named network), as ADM flattens it:
    NHWC, first 7 channels, [b, 2023]."""
    return inception.get_submodule(SPATIAL).register_forward_hook(
        lambda m, i, out: store.append(out.permute(0, 2, 3, 1)[..., :7].reshape(len(out), -1).numpy())
    )


def adm_features(extractor, u8: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pool3, spatial, unbiased logits) of torch-fidelity's extractor on uint8 NHWC images."""
    store: list = []
    handle = spatial_hook(extractor, store)
    with torch.no_grad():
        pool3, logits = extractor(torch.from_numpy(u8).permute(0, 3, 1, 2).contiguous())
    handle.remove()
    return pool3.numpy(), store[0], logits.numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchvision", type=Path, required=True, help="a torchvision wheel (its .py files are read)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared 2-core box

    meta = json.loads(WEIGHTS.read_text())
    state = draw(meta["entries"], meta["seed"])
    assert digest(state) == meta["sha256"], "weights.json does not replay to its sha256"
    tensors = {k: torch.from_numpy(v) for k, v in state.items()}

    built: list = []
    tv_version = import_torchvision_inception(args.torchvision.resolve(), built)
    import pytorch_fid.inception as fid

    fid.load_state_dict_from_url = lambda url, progress=True: tensors
    pfid = fid.InceptionV3([fid.InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).eval()
    Extractor, resize_tf1, isc_features_to_metric = torch_fidelity_parts()
    with tempfile.TemporaryDirectory() as tmp:
        pth = Path(tmp) / "random_fid_inception.pth"
        torch.save(tensors, pth)
        extractor = Extractor(
            "inception-v3-compat", ["2048", "logits_unbiased"], feature_extractor_weights_path=str(pth)
        ).eval()

    ref: dict[str, np.ndarray] = {"images": images((3, 40, 56, 3), seed=4), "resize_index": RESIZE_INDEX}
    ref["adm_pool3"], ref["adm_spatial"], ref["adm_logits"] = adm_features(extractor, ref["images"])
    store: list = []
    handle = spatial_hook(built[-1], store)  # the torchvision network inside pytorch-fid's blocks
    with torch.no_grad():
        pool3 = pfid(to_torch(ref["images"]))[0][:, :, 0, 0]
        ref["pfid_pool3"], ref["pfid_spatial"] = pool3.numpy(), store[0]
        ref["pfid_logits"] = (pool3 @ tensors["fc.weight"].T).numpy()
        x = torch.from_numpy(ref["images"]).permute(0, 3, 1, 2).float()
        x = x[:1]  # one image's resizes: the fixture stays small
        ref["tf1_23x71"] = resize_tf1(x, size=(23, 71), align_corners=False).permute(0, 2, 3, 1).numpy()
        full = resize_tf1(x, size=(299, 299), align_corners=False).permute(0, 2, 3, 1).numpy()
        ref["tf1_299"] = full[:, RESIZE_INDEX][:, :, RESIZE_INDEX]
    handle.remove()

    rng = np.random.RandomState(30)
    ref["is_logits"] = (3 * rng.randn(20, 1008)).astype(np.float32)
    ref["is_adm_split2"] = compute_inception_score(ref["is_logits"], split_size=2)
    ref["is_adm_5000"] = compute_inception_score(ref["is_logits"])
    fidelity = isc_features_to_metric(torch.from_numpy(ref["is_logits"]), splits=10, shuffle=False)
    ref["is_fidelity_10"] = fidelity["inception_score_mean"]

    ref["fid_x"] = (rng.randn(80, 24) @ rng.randn(24, 24) / 5 + 1).astype(np.float32)
    ref["fid_y"] = (rng.randn(100, 24) @ rng.randn(24, 24) / 5 + 1.2).astype(np.float32)
    ref["fid_adm"] = frechet_distance(*compute_statistics(ref["fid_x"]), *compute_statistics(ref["fid_y"]))
    ref["fid_adm_few"] = frechet_distance(*compute_statistics(ref["fid_x"][:10]), *compute_statistics(ref["fid_y"]))

    ref["pr_real"] = np.maximum(rng.randn(120, 64) * 0.6 + 0.3, 0).astype(np.float32)  # pool3-like: ReLU'd means
    ref["pr_fake"] = np.maximum(rng.randn(150, 64) * 0.5 + 0.35, 0).astype(np.float32)
    ref["pr_adm16"] = np.array(compute_prec_recall(ref["pr_real"], ref["pr_fake"], half=True))
    ref["pr_adm32"] = np.array(compute_prec_recall(ref["pr_real"], ref["pr_fake"], half=False))

    ref["e2e_ref"], ref["e2e_samples"] = images((8, 32, 32, 3), seed=5), images((10, 32, 32, 3), seed=6)
    real, fake = adm_features(extractor, ref["e2e_ref"]), adm_features(extractor, ref["e2e_samples"])
    stored = adm_features(extractor, np.ascontiguousarray(ref["e2e_ref"][:, :, ::-1]))
    ref["e2e_stored_pool3"], ref["e2e_stored_spatial"] = stored[0], stored[1]
    ref["e2e_is"] = compute_inception_score(fake[2])
    for name, i in (("fid", 0), ("sfid", 1)):
        ref[f"e2e_{name}_recomputed"] = frechet_distance(*compute_statistics(fake[i]), *compute_statistics(real[i]))
        ref[f"e2e_{name}_stored"] = frechet_distance(*compute_statistics(fake[i]), *compute_statistics(stored[i]))
    ref["e2e_precision"], ref["e2e_recall"] = compute_prec_recall(real[0], fake[0])

    for key in sorted(ref):
        if np.ndim(ref[key]) <= 1 and np.size(ref[key]) <= 2:
            print(f"{key}: {ref[key]}")
    print("pr float16 vs float32:", ref["pr_adm16"], ref["pr_adm32"])
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / "reference.npz", **{k: np.asarray(v) for k, v in ref.items()})
    versions = {p: importlib.metadata.version(p) for p in ("torch", "pytorch-fid", "torch-fidelity", "numpy", "scipy")}
    versions["torchvision (Python files)"] = tv_version
    (OUT / "versions.json").write_text(json.dumps(versions, indent=1) + "\n")
    print(f"{OUT / 'reference.npz'}: {(OUT / 'reference.npz').stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
