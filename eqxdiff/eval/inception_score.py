"""The Inception Score (Salimans et al. 2016) as ADM's evaluator computes it: exp of the mean KL
divergence between each image's class distribution p(y|x) and their mean p(y), per split of
`split_size` consecutive images (5000: 10 splits of 50,000 samples), averaged over the splits.

ADM takes the softmax of the 1008-way logits (eqxdiff.eval.adm_inception) in float32 and the KL in
float32; here both are float64 from log-softmax (log p never underflows to -inf), which agrees with it
to float32 round-off. torch-fidelity's `isc_features_to_metric(splits=10, samples_shuffle=False)` is
the same number when the images split evenly into 10.
"""

import numpy as np
from jaxtyping import Float
from scipy.special import log_softmax

SPLIT_SIZE = 5000  # ADM's compute_inception_score(split_size=5000)


def inception_score(logits: Float[np.ndarray, "n k"], split_size: int = SPLIT_SIZE) -> float:
    """ADM's Inception Score of `logits` [n, k] (rows: images, in order): the mean over splits of
    rows [i, i + split_size) of exp(mean_x KL(p(y|x) ‖ p(y))), the last split shorter if n does not
    divide. Unitless, in [1, k]."""
    logits = np.asarray(logits, np.float64)
    if logits.ndim != 2 or len(logits) < 1 or split_size < 1:
        raise ValueError(
            f"inception_score takes logits [n >= 1, k] and split_size >= 1, got {logits.shape}, {split_size}."
        )
    scores = []
    for start in range(0, len(logits), split_size):
        log_p = log_softmax(logits[start : start + split_size], axis=1)
        p = np.exp(log_p)
        log_mean = np.log(p.mean(axis=0))
        scores.append(np.exp((p * (log_p - log_mean)).sum(axis=1).mean()))
    return float(np.mean(scores))
