"""Sample-quality metrics: the digits job's scorecard (and its two-digit form for
captioned_digits) and the Fréchet distance behind it."""

from eqxdiff.eval.digits import digits_sample_metrics, digits_split, format_metrics, two_digit_accuracy
from eqxdiff.eval.frechet import frechet_distance, frechet_distance_features, gaussian_stats
from eqxdiff.eval.inception import InceptionV3

__all__ = [
    "InceptionV3",
    "digits_sample_metrics",
    "digits_split",
    "format_metrics",
    "frechet_distance",
    "frechet_distance_features",
    "gaussian_stats",
    "two_digit_accuracy",
]
