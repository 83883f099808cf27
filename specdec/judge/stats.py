"""The judge's arithmetic: medians and geometric means of speed ratios, standard errors, bootstrap intervals."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from specdec.sequences import common_prefix_length

Z95 = 1.96
# The two-sided 95 % quantile of Student's t for 1-30 degrees of freedom (beyond, t95 expands around Z95).
T95 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
       2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
       2.0518, 2.0484, 2.0452, 2.0423)


def t95(df: float) -> float:
    """The half-width, in standard errors, of a 95 % interval whose standard error has `df` degrees of freedom.

    A standard error estimated from k replies (or k pairs) has k - 1: with 8 replies Z95 (1.96) would give a
    91 % interval, Student's t (2.36) a 95 % one.  No degrees of freedom: an infinite width (no interval).
    """
    if not df >= 1:
        return math.inf
    if df <= len(T95) and df == int(df):
        return T95[int(df) - 1]
    z = Z95  # Cornish-Fisher expansion of t's quantile in 1 / df (error < 1e-4 from 30 on)
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2) \
        + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3)


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


def gap_with_se(candidate: tuple[float, float], stock: tuple[float, float], df: float = math.inf) -> dict:
    """{"gap", "se", "df", "candidate", "stock"} from two independent (mean, se) pairs; `df`: the standard
    error's degrees of freedom (at least the smaller side's replies - 1 is safe)."""
    (c_mean, c_se), (s_mean, s_se) = candidate, stock
    return {"gap": c_mean - s_mean, "se": math.sqrt(c_se ** 2 + s_se ** 2), "df": df, "candidate": c_mean,
            "stock": s_mean}


def paired_gap_with_se(candidate_sums: Sequence[float], candidate_counts: Sequence[float],
                       stock_sums: Sequence[float], stock_counts: Sequence[float]) -> dict:
    """The gap of two pooled means over paired replies (pair i: the same prompt and seed on both engines).

    The standard error comes from the per-pair differences of the two ratio estimators' linearized residuals,
    so what the prompts share (some prompts are simply likelier than others) cancels out of it; it has pairs - 1
    degrees of freedom (`df`).  Pairs where either reply has no tokens are dropped.
    """
    c_y, c_n, s_y, s_n = (np.asarray(v, dtype=float) for v in (candidate_sums, candidate_counts, stock_sums,
                                                                stock_counts))
    if not len(c_y) == len(c_n) == len(s_y) == len(s_n):
        raise ValueError("paired replies need the same number of candidate and stock rows")
    keep = (c_n > 0) & (s_n > 0)
    c_y, c_n, s_y, s_n = c_y[keep], c_n[keep], s_y[keep], s_n[keep]
    if len(c_n) == 0:
        return {"gap": math.nan, "se": math.nan, "df": 0, "candidate": math.nan, "stock": math.nan}
    c_mean, s_mean = c_y.sum() / c_n.sum(), s_y.sum() / s_n.sum()
    k = len(c_n)
    se = math.inf
    if k >= 2:
        diff = (c_y - c_mean * c_n) / c_n.mean() - (s_y - s_mean * s_n) / s_n.mean()
        se = float(math.sqrt((diff ** 2).sum() / (k * (k - 1))))
    return {"gap": float(c_mean - s_mean), "se": se, "df": k - 1, "candidate": float(c_mean), "stock": float(s_mean)}


PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


def band_verdict(low: float, high: float, band_low: float, band_high: float) -> str:
    """pass: the interval [low, high] lies inside the band; fail: wholly outside it; inconclusive: it straddles
    an edge, so the data fit a candidate inside the band and one outside it alike."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return INCONCLUSIVE
    if high < band_low or low > band_high:
        return FAIL
    if band_low <= low and high <= band_high:
        return PASS
    return INCONCLUSIVE


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


CANNOT_TELL = "cannot tell"


def paired_rounds(ratios: dict[str, dict]) -> dict:
    """What the paired rounds say about speed.

    Round i is pass i of every workload, stock and candidate measured close together; its score is the
    geometric mean of the workloads' pass-i ratios.  `spread` is the highest round's score minus the lowest;
    `effect` is SpecScore - 1.  A speedup (or slowdown) is claimed only when every round lies on the same
    side of 1 and the spread is narrower than the effect; otherwise the verdict is "cannot tell".
    """
    passes = [row["passes"] for row in ratios.values()]
    count = min((len(p) for p in passes), default=0)
    rounds = [geometric_mean([p[i] for p in passes]) for i in range(count)]
    score = geometric_mean([row["ratio"] for row in ratios.values()]) if ratios else math.nan
    if not rounds:
        return {"rounds": [], "low": None, "high": None, "spread": None, "effect": None, "verdict": CANNOT_TELL,
                "spread_wider_than_effect": True}
    low, high, effect = min(rounds), max(rounds), score - 1.0
    spread = high - low
    wide = spread >= abs(effect)
    one_side = low > 1.0 or high < 1.0
    verdict = CANNOT_TELL if wide or not one_side or count < 2 else ("faster" if effect > 0 else "slower")
    return {"rounds": rounds, "low": low, "high": high, "spread": spread, "effect": effect, "verdict": verdict,
            "spread_wider_than_effect": wide}


def workload_spread(passes: Sequence[float], ratio: float) -> dict:
    """One workload's pass-to-pass spread (highest pass ratio - lowest) against its effect (ratio - 1)."""
    spread = max(passes) - min(passes) if passes else math.nan
    return {"spread": spread, "effect": ratio - 1.0, "spread_wider_than_effect": not spread < abs(ratio - 1.0)}
