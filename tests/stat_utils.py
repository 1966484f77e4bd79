"""Goodness-of-fit helpers for the statistical sampler tests."""

import numpy as np
from scipy import stats


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Chi-square p-value of observed ``counts`` against ``probs`` (bins with small
    expected counts are pooled into one, so the test's approximation holds).
    An observation in a bin of probability 0 gives p = 0."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = counts.sum()
    if (counts[probs <= 0] > 0).any():
        return 0.0
    expected = probs / probs.sum() * n
    keep = expected >= min_expected
    obs, exp = list(counts[keep]), list(expected[keep])
    if (~keep).any() and expected[~keep].sum() > 0:
        obs.append(counts[~keep].sum())
        exp.append(expected[~keep].sum())
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)
