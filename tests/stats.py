"""Shared statistics for the distribution tests."""

from __future__ import annotations

import numpy as np
from scipy import stats


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of counts against probs, pooling cells with expected count < 5.

    A sample in a cell of probability 0 gives p = 0 outright.
    """
    expected = probs * counts.sum()
    if counts[expected == 0].sum() > 0:
        return 0.0
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
