"""Sample-quality metrics: the digits job's scorecard (and its two-digit form for
captioned_digits), the Fréchet distance behind it, and FID's pieces (pytorch-fid's Inception
network, streaming feature statistics in its npz layout, its distance)."""

from eqxdiff.eval.digits import digits_sample_metrics, digits_split, format_metrics, two_digit_accuracy
from eqxdiff.eval.feature_stats import FeatureStats, gather_feature_stats, load_stats, save_stats
from eqxdiff.eval.frechet import fid_from_stats, frechet_distance, frechet_distance_features, gaussian_stats
from eqxdiff.eval.inception import InceptionV3

__all__ = [
    "FeatureStats",
    "InceptionV3",
    "digits_sample_metrics",
    "digits_split",
    "fid_from_stats",
    "format_metrics",
    "frechet_distance",
    "frechet_distance_features",
    "gather_feature_stats",
    "gaussian_stats",
    "load_stats",
    "save_stats",
    "two_digit_accuracy",
]
