"""The judge's arithmetic: medians and geometric means of speed ratios, standard errors, bootstrap intervals."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from specdec.sequences import common_prefix_length

Z95 = 1.96


def geometric_mean(values: Sequence[float]) -> float:
    """exp(mean(log v)); 0 if any value is 0 (a workload that produced nothing scores nothing)."""
    if not values:
        raise ValueError("geometric mean of nothing")
    if any(v <= 0 for v in values):
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def pass_ratios(candidate_speeds: Sequence[float], stock_speeds: Sequence[float]) -> list[float]:
    """Pass i's ratio = candidate speed / stock speed of pass i."""
    if len(candidate_speeds) != len(stock_speeds):
        raise ValueError(f"{len(candidate_speeds)} candidate passes but {len(stock_speeds)} stock passes")
    return [c / s if s > 0 else 0.0 for c, s in zip(candidate_speeds, stock_speeds)]


def specscore(ratios_by_workload: dict[str, Sequence[float]]) -> tuple[dict[str, dict], float]:
    """{workload: {"passes", "ratio" (median of passes)}} and the geometric mean of those medians."""
    table = {name: {"passes": [float(r) for r in passes], "ratio": float(statistics.median(passes))}
             for name, passes in ratios_by_workload.items()}
    return table, geometric_mean([row["ratio"] for row in table.values()])


def ratio_mean_se(sums: Sequence[float], counts: Sequence[float]) -> tuple[float, float]:
    """Pooled mean sum(sums) / sum(counts) over clusters (replies), with its delta-method standard error.

    Tokens of one reply are not independent, so the error is computed over replies, not tokens.
    """
    y = np.asarray(sums, dtype=float)
    n = np.asarray(counts, dtype=float)
    keep = n > 0
    y, n = y[keep], n[keep]
    if len(n) == 0:
        return math.nan, math.nan
    mean = y.sum() / n.sum()
    k = len(n)
    if k < 2:
        return float(mean), math.inf
    residual = (y - mean * n) / n.mean()
    return float(mean), float(math.sqrt((residual ** 2).sum() / (k * (k - 1))))


def gap_with_se(candidate: tuple[float, float], stock: tuple[float, float]) -> dict:
    """{"gap", "se", "candidate", "stock"} from two independent (mean, se) pairs."""
    (c_mean, c_se), (s_mean, s_se) = candidate, stock
    return {"gap": c_mean - s_mean, "se": math.sqrt(c_se ** 2 + s_se ** 2), "candidate": c_mean, "stock": s_mean}


def outside_band(gap: float, se: float, bound: float) -> bool:
    """True when the 95 % interval gap ± 1.96·se lies wholly outside [-bound, +bound]."""
    if not (math.isfinite(gap) and math.isfinite(se)):
        return not math.isfinite(gap)
    return gap - Z95 * se > bound or gap + Z95 * se < -bound


def bootstrap_ratio_of_means(candidate: Sequence[float], stock: Sequence[float], resamples: int = 2000,
                             seed: int = 0) -> dict:
    """mean(candidate) / mean(stock) over paired items (prompts), with a 95 % percentile bootstrap interval."""
    c = np.asarray(candidate, dtype=float)
    s = np.asarray(stock, dtype=float)
    if len(c) != len(s) or len(c) == 0:
        raise ValueError("need the same, non-zero number of candidate and stock items")
    ratio = c.mean() / s.mean() if s.mean() > 0 else math.inf
    idx = np.random.default_rng(seed).integers(0, len(c), size=(resamples, len(c)))
    with np.errstate(divide="ignore", invalid="ignore"):
        boot = c[idx].mean(axis=1) / s[idx].mean(axis=1)
    boot = np.where(np.isfinite(boot), boot, np.inf)
    low, high = np.quantile(boot, [0.025, 0.975])
    return {"ratio": float(ratio), "low": float(low), "high": float(high)}


def common_prefix_share(candidate: Sequence, stock: Sequence) -> float:
    """Length of the common prefix / length of the stock reply (1 when both are empty)."""
    if not stock:
        return 1.0 if not candidate else 0.0
    return common_prefix_length(candidate, stock) / len(stock)
