"""Sample-quality metrics: the digits job's scorecard and the Fréchet distance behind it."""

from eqxdiff.eval.digits import digits_sample_metrics, digits_split, format_metrics
from eqxdiff.eval.frechet import frechet_distance, frechet_distance_features, gaussian_stats

__all__ = [
    "digits_sample_metrics",
    "digits_split",
    "format_metrics",
    "frechet_distance",
    "frechet_distance_features",
    "gaussian_stats",
]
