"""The lossless gate: six checks, each computed from both engines' answers, each able to fail.

Every check returns its record entry and a `Check` row (what was measured, the limit, pass/fail) for the
gate table.  A check that cannot be measured (an engine gave nothing to measure) fails, except device
memory of an engine the judge did not start and that exposes none: that row says "not measured".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from specdec.judge import stats
from specdec.judge.client import Reply
from specdec.judge.config import Limits


@dataclasses.dataclass
class Check:
    name: str
    key: str  # the record key it reads from
    measured: str
    limit: str
    ok: bool
    why: str = ""  # for a failed check: one clause for `reason`


@dataclasses.dataclass
class ScoredReply:
    """A reply scored by the stock engine: summed log-probs, token count, tokens that were stock's top-1."""

    logprob_sum: float
    num_tokens: int
    num_top1: int


def interval(gap: float, se: float) -> str:
    return f"[{gap - stats.Z95 * se:+.4f}, {gap + stats.Z95 * se:+.4f}]"


def is_top1(logprob: float, top: dict | None) -> bool:
    if not top:
        return False
    best = max(top.values())
    return logprob >= best - 1e-6 * max(1.0, abs(best))


def score_reply(scored: Reply, prompt_len_chars: int, prompt_num_tokens: int | None = None) -> ScoredReply:
    """The reply part of a scored prompt + reply: tokens at or after the prompt's end."""
    n = len(scored.tokens)
    if scored.text_offset is not None:
        positions = [i for i in range(n) if scored.text_offset[i] >= prompt_len_chars]
    else:
        positions = list(range(prompt_num_tokens or 0, n))
    lps = [(scored.token_logprobs[i], (scored.top_logprobs or [None] * n)[i]) for i in positions
           if scored.token_logprobs[i] is not None]
    return ScoredReply(sum(lp for lp, _ in lps), len(lps), sum(is_top1(lp, top) for lp, top in lps))


def likelihood_and_argmax(candidate: Sequence[ScoredReply], stock: Sequence[ScoredReply],
                          has_top: bool, limits: Limits) -> tuple[dict, dict, list[Check]]:
    """Mean per-token log-likelihood and share of stock top-1 tokens: candidate replies vs stock replies."""
    def pooled(rows, value):
        return stats.ratio_mean_se([value(r) for r in rows], [r.num_tokens for r in rows])

    like = stats.gap_with_se(pooled(candidate, lambda r: r.logprob_sum), pooled(stock, lambda r: r.logprob_sum))
    top = stats.gap_with_se(pooled(candidate, lambda r: r.num_top1), pooled(stock, lambda r: r.num_top1))
    checks = []
    for name, key, figure, bound in (("sampled replies' likelihood", "likelihood", like, limits.likelihood_bound),
                                     ("share of first choices", "argmax", top, limits.argmax_bound)):
        measured = f"gap {figure['gap']:+.4f} ± {stats.Z95 * figure['se']:.4f} (95 %)"
        missing = not math.isfinite(figure["gap"]) or (key == "argmax" and not has_top)
        ok = not missing and not stats.outside_band(figure["gap"], figure["se"], bound)
        why = ("the stock engine's scores carry no top_logprobs" if key == "argmax" and not has_top else
               "no scored tokens" if missing else
               f"95 % interval {interval(figure['gap'], figure['se'])} lies outside ±{bound:g}")
        checks.append(Check(name, key, measured, f"interval overlaps ±{bound:g}", ok, "" if ok else why))
    return like, top, checks


def fidelity(candidate: Sequence[Reply], stock: Sequence[Reply], limits: Limits) -> tuple[float | None, Check]:
    """The largest, over fixed texts, of the mean absolute per-token log-prob difference."""
    worst, why = 0.0, ""
    for i, (c, s) in enumerate(zip(candidate, stock)):
        if c.tokens != s.tokens:
            worst, why = math.inf, f"text {i} is split into different tokens by the two engines"
            break
        diffs = [abs(a - b) for a, b in zip(c.token_logprobs, s.token_logprobs) if a is not None and b is not None]
        worst = max(worst, sum(diffs) / len(diffs) if diffs else 0.0)
    ok = worst <= limits.fidelity_ceiling
    why = why or (f"largest mean |Δ log-prob| {worst:.5f} > {limits.fidelity_ceiling:g}" if not ok else "")
    value = None if math.isinf(worst) else worst
    measured = "tokens differ" if value is None else f"{worst:.6f}"
    return value, Check("fixed texts' log-probabilities", "fidelity", measured, f"≤ {limits.fidelity_ceiling:g}", ok,
                        why)


def greedy_agreement(candidate: Sequence[Sequence], stock: Sequence[Sequence], limits: Limits) -> tuple[float, Check]:
    shares = [stats.common_prefix_share(c, s) for c, s in zip(candidate, stock)]
    value = sum(shares) / len(shares) if shares else 0.0
    floor = limits.greedy_agreement_floor
    ok = floor is None or value >= floor
    return value, Check("greedy agreement", "greedy_agreement", f"{value:.4f}",
                        "reported" if floor is None else f"≥ {floor:g}", ok,
                        "" if ok else f"greedy agreement {value:.4f} < floor {floor:g}")


def lengths(candidate: dict[str, list[float]], stock: dict[str, list[float]], limits: Limits) -> tuple[dict, Check]:
    """Per workload: mean reply length candidate / stock over paired requests, with a bootstrap interval."""
    table = {w: stats.bootstrap_ratio_of_means(candidate[w], stock[w]) for w in candidate}
    low, high = 1 - limits.length_margin, 1 + limits.length_margin
    bad = [w for w, row in table.items() if row["high"] < low or row["low"] > high]
    measured = ", ".join(f"{w} {row['ratio']:.3f} [{row['low']:.3f}, {row['high']:.3f}]" for w, row in table.items())
    why = "; ".join(f"{w} reply-length ratio interval [{table[w]['low']:.3f}, {table[w]['high']:.3f}] lies "
                    f"outside {low:g}–{high:g}" for w in bad)
    return table, Check("reply lengths", "lengths", measured, f"interval overlaps 1 ± {limits.length_margin:g}",
                        not bad, why)


def memory(candidate_peak: float | None, stock_peak: float | None, limits: Limits,
           launched: bool) -> tuple[dict, Check]:
    if limits.memory_budget_mib is not None:
        allowed = limits.memory_budget_mib
        limit = f"≤ {allowed:.0f} MiB (budget)"
    else:
        allowed = None if stock_peak is None else stock_peak + limits.memory_slack_mib
        limit = f"≤ stock + {limits.memory_slack_mib:g} MiB" + ("" if allowed is None else f" = {allowed:.0f} MiB")
    if candidate_peak is None or allowed is None:
        # A URL engine that reports no memory in /metrics: passes when the candidate is one (nothing can be
        # measured), fails when the judge started the candidate but has no stock figure to compare with.
        ok = candidate_peak is None and not launched
        record = {"ok": ok, "peak_mib": candidate_peak, "allowed_mib": allowed, "measured": False}
        why = "" if ok else ("the candidate's peak memory could not be measured" if candidate_peak is None else
                             "stock's peak memory could not be measured: give --memory-budget-mib")
        return record, Check("device memory", "memory", "not measured", limit, ok, why)
    ok = candidate_peak <= allowed
    record = {"ok": ok, "peak_mib": candidate_peak, "allowed_mib": allowed, "measured": True,
              "stock_peak_mib": stock_peak}
    why = "" if ok else f"candidate peak {candidate_peak:.0f} MiB > allowed {allowed:.0f} MiB"
    return record, Check("device memory", "memory", f"{candidate_peak:.0f} MiB (stock {stock_peak or 0:.0f})",
                         limit, ok, why)
