"""Sample-quality metrics: the digits job's scorecard (and its two-digit form for
captioned_digits), the Fréchet distance behind it, and FID's pieces (pytorch-fid's Inception
network, streaming feature statistics in its npz layout, its distance), FID of a model's samples
streamed chunk by chunk, and improved precision/recall in the same features; FD-DINOv2's detector (EDM2's),
which that machinery takes in place of Inception; CLIP score as torchmetrics computes it."""

from eqxdiff.eval.adm_eval import BatchFeatures, adm_metrics, batch_features
from eqxdiff.eval.adm_inception import ADMInception
from eqxdiff.eval.clip_score import CLIPScorer, clip_score
from eqxdiff.eval.fd_dinov2 import DINOv2Features
from eqxdiff.eval.digits import digits_sample_metrics, digits_split, format_metrics, two_digit_accuracy
from eqxdiff.eval.feature_stats import FeatureStats, gather_feature_stats, load_stats, save_stats
from eqxdiff.eval.fid import (
    FIDReference,
    KeptFeatures,
    fid_of_samples,
    fids_of_samples,
    frechet_distance_of_few,
    load_reference,
    open_fid,
    save_reference,
)
from eqxdiff.eval.frechet import fid_from_stats, frechet_distance, frechet_distance_features, gaussian_stats
from eqxdiff.eval.inception import InceptionV3
from eqxdiff.eval.inception_score import inception_score
from eqxdiff.eval.precision_recall import knn_radii, precision_recall, within_manifold

__all__ = [
    "ADMInception",
    "BatchFeatures",
    "CLIPScorer",
    "DINOv2Features",
    "FIDReference",
    "FeatureStats",
    "InceptionV3",
    "KeptFeatures",
    "adm_metrics",
    "batch_features",
    "clip_score",
    "digits_sample_metrics",
    "digits_split",
    "fid_from_stats",
    "fid_of_samples",
    "fids_of_samples",
    "format_metrics",
    "frechet_distance",
    "frechet_distance_features",
    "frechet_distance_of_few",
    "gather_feature_stats",
    "gaussian_stats",
    "inception_score",
    "knn_radii",
    "load_reference",
    "load_stats",
    "open_fid",
    "precision_recall",
    "save_reference",
    "save_stats",
    "two_digit_accuracy",
    "within_manifold",
]
