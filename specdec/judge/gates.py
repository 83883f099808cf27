"""The lossless gate: six checks, each computed from both engines' answers, each able to fail.

Every check returns its record entry and a `Check` row for the gate table: what was measured, the limit,
its power (for a statistical check, the 95 % interval's half-width against its bound) and a verdict:

  pass            the measurement lies within the limit (a statistical check: its whole interval does)
  fail            it lies outside (a statistical check: its whole interval does); the score becomes 0
  inconclusive    the interval straddles the bound: a candidate within it and one outside fit the data alike
  not measurable  the engines gave nothing to measure it with (e.g. no prompt log-probs and no --scorer)
  reported        greedy agreement without a floor: a figure, not a gate

A log-prob check that cannot be measured zeroes the score (`ok` False); device memory of a URL engine that
exposes none is "not measurable" without doing so (nothing about it can be known from outside).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from specdec.judge import stats
from specdec.judge.client import Reply
from specdec.judge.config import Limits

PASS, FAIL, INCONCLUSIVE = stats.PASS, stats.FAIL, stats.INCONCLUSIVE
NOT_MEASURABLE, REPORTED = "not measurable", "reported"
VERDICTS = (PASS, FAIL, INCONCLUSIVE, NOT_MEASURABLE, REPORTED)
NO_LOGPROBS = ("not measurable on this engine: it returns no prompt log-probs (echo + logprobs); "
               "give --scorer MODEL_DIR to score with a local reference")


@dataclasses.dataclass
class Check:
    name: str
    key: str  # the record key it reads from
    measured: str
    limit: str
    verdict: str
    why: str = ""  # for a verdict other than pass / reported: one clause for `reason` or the record's top
    power: str = ""  # a statistical check's interval half-width against its bound
    ok: bool | None = None  # False: the score becomes 0 (default: only when the verdict is fail)

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}")
        if self.ok is None:
            self.ok = self.verdict != FAIL

    def row(self) -> dict:
        return {"check": self.name, "key": self.key, "measured": self.measured, "limit": self.limit,
                "verdict": self.verdict, "ok": self.ok, "power": self.power, "why": self.why}


def unmeasurable(name: str, key: str, limit: str, why: str = NO_LOGPROBS) -> Check:
    """A log-prob check the engines gave nothing for: its verdict says so and the score becomes 0."""
    return Check(name, key, "–", limit, NOT_MEASURABLE, why, ok=False)


@dataclasses.dataclass
class ScoredReply:
    """A reply scored by the reference (the stock engine or --scorer): summed log-probs, token count, tokens
    that were the reference's top-1."""

    logprob_sum: float
    num_tokens: int
    num_top1: int


def power_text(half_width: float, bound: float) -> str:
    """'±0.83 against ±0.05 (17x: about 280x the replies would resolve it)' or '±0.01 against ±0.05'."""
    text = f"±{half_width:.4f} against ±{bound:g}"
    if not math.isfinite(half_width):
        return text + " (too few replies for an interval)"
    if half_width > bound:
        more = math.ceil((half_width / bound) ** 2)
        text += f" ({half_width / bound:.1f}x the bound: about {more}x the replies would resolve it)"
    return text


def interval_verdict(low: float, high: float, band_low: float, band_high: float, bound_text: str) -> tuple[str, str]:
    """The verdict of an interval against a band and the clause that explains it."""
    verdict = stats.band_verdict(low, high, band_low, band_high)
    where = f"95 % interval [{low:+.4f}, {high:+.4f}]"
    if verdict == FAIL:
        return verdict, f"{where} lies outside {bound_text}"
    if verdict == INCONCLUSIVE:
        return verdict, (f"{where} straddles {bound_text}: a candidate within it and one outside it fit the "
                         "data alike")
    return verdict, ""


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


def sampled_gap(candidate: Sequence[ScoredReply], stock: Sequence[ScoredReply], value) -> dict:
    """Candidate minus stock of a pooled per-token mean: paired by request where the replies pair up (the
    same prompts and seeds in the same order), else as two independent samples."""
    rows = lambda replies: ([value(r) for r in replies], [r.num_tokens for r in replies])  # noqa: E731
    if len(candidate) == len(stock):
        return stats.paired_gap_with_se(*rows(candidate), *rows(stock))
    scored = min(sum(1 for r in replies if r.num_tokens) for replies in (candidate, stock))
    return stats.gap_with_se(stats.ratio_mean_se(*rows(candidate)), stats.ratio_mean_se(*rows(stock)), scored - 1)


def likelihood_and_argmax(candidate: Sequence[ScoredReply], stock: Sequence[ScoredReply],
                          has_top: bool, limits: Limits) -> tuple[dict, dict, list[Check]]:
    """Mean per-token log-likelihood and share of reference top-1 tokens: candidate replies vs stock replies.

    Each gap's 95 % interval is gap ± t·se, t Student's quantile for the standard error's degrees of freedom
    (replies or pairs - 1): the standard error is itself estimated from the replies, and from the 8 of --quick
    gap ± 1.96·se would be a 91 % interval.
    """
    like = sampled_gap(candidate, stock, lambda r: r.logprob_sum)
    top = sampled_gap(candidate, stock, lambda r: r.num_top1)
    checks = []
    for name, key, figure, bound in (("sampled replies' likelihood", "likelihood", like, limits.likelihood_bound),
                                     ("share of first choices", "argmax", top, limits.argmax_bound)):
        half = stats.t95(figure["df"]) * figure["se"] if math.isfinite(figure["se"]) else math.inf
        figure.update(half_width=half, bound=bound)
        limit = f"95 % interval within ±{bound:g}"
        if key == "argmax" and not has_top:
            checks.append(unmeasurable(name, key, limit, "not measurable on this engine: its scores carry no "
                                                         "top_logprobs"))
            continue
        if not math.isfinite(figure["gap"]):
            checks.append(Check(name, key, "no scored tokens", limit, FAIL, "no scored tokens"))
            continue
        verdict, why = interval_verdict(figure["gap"] - half, figure["gap"] + half, -bound, bound, f"±{bound:g}")
        figure["verdict"] = verdict
        checks.append(Check(name, key, f"gap {figure['gap']:+.4f} ± {half:.4f} (95 %)", limit, verdict, why,
                            power_text(half, bound)))
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
    return fidelity_check(worst, why, limits, "")


def fidelity_by_reference(candidate: Sequence[ScoredReply], stock: Sequence[ScoredReply],
                          limits: Limits) -> tuple[float | None, Check]:
    """For engines without prompt log-probs: each fixed text's greedy continuation by each engine, scored by
    the reference; the largest, over texts, of |candidate's mean per-token log-prob - stock's|."""
    worst = 0.0
    for c, s in zip(candidate, stock):
        if c.num_tokens and s.num_tokens:
            worst = max(worst, abs(c.logprob_sum / c.num_tokens - s.logprob_sum / s.num_tokens))
        elif c.num_tokens != s.num_tokens:
            worst = math.inf
    return fidelity_check(worst, "" if math.isfinite(worst) else "one engine continued a fixed text with nothing",
                          limits, " (greedy continuations, by the scorer)")


def fidelity_check(worst: float, why: str, limits: Limits, how: str) -> tuple[float | None, Check]:
    ok = worst <= limits.fidelity_ceiling
    why = why or (f"largest mean |Δ log-prob| {worst:.5f} > {limits.fidelity_ceiling:g}" if not ok else "")
    value = None if math.isinf(worst) else worst
    measured = ("tokens differ" if value is None else f"{worst:.6f}") + how
    return value, Check("fixed texts' log-probabilities", "fidelity", measured, f"≤ {limits.fidelity_ceiling:g}",
                        PASS if ok else FAIL, why)


def greedy_agreement(candidate: Sequence[Sequence], stock: Sequence[Sequence], limits: Limits,
                     divergences: list[dict] | None = None) -> tuple[float, Check]:
    """(the mean share of each stock greedy reply the candidate's repeats from its start, the check); with the
    replies' divergences (greedy_divergences) the measured text says where they split."""
    shares = [stats.common_prefix_share(c, s) for c, s in zip(candidate, stock)]
    value = sum(shares) / len(shares) if shares else 0.0
    measured = f"{value:.4f}" + (f"; {divergence_summary(divergences, len(shares))}" if divergences else "")
    floor = limits.greedy_agreement_floor
    if floor is None:
        return value, Check("greedy agreement", "greedy_agreement", measured, "no floor (not a gate)", REPORTED)
    ok = value >= floor
    return value, Check("greedy agreement", "greedy_agreement", measured, f"≥ {floor:g}", PASS if ok else FAIL,
                        "" if ok else f"greedy agreement {value:.4f} < floor {floor:g}")


def greedy_divergences(candidate: Sequence[Reply], stock: Sequence[Reply]) -> list[dict]:
    """Where each candidate greedy reply first leaves the stock's: {reply, position, stock, candidate: the two
    tokens there (None past a reply's end), stock_margin: the stock's chosen token's log-prob minus its next
    best (from its top log-probs; None where it gave fewer than two)}.  A margin near 0 is a near-tie, which a
    different batch shape's rounding can split in low precision; a wide one is not a tie."""
    out = []
    for index, (cand, ref) in enumerate(zip(candidate, stock)):
        if cand.tokens is None or ref.tokens is None or cand.tokens == ref.tokens:
            continue
        position = stats.common_prefix_length(cand.tokens, ref.tokens)
        top = ref.top_logprobs[position] if ref.top_logprobs and position < len(ref.top_logprobs) else None
        best = sorted((v for v in (top or {}).values() if v is not None), reverse=True)
        out.append({"reply": index, "position": position,
                    "stock": ref.tokens[position] if position < len(ref.tokens) else None,
                    "candidate": cand.tokens[position] if position < len(cand.tokens) else None,
                    "stock_margin": round(best[0] - best[1], 6) if len(best) >= 2 else None})
    return out


def divergence_summary(divergences: list[dict], replies: int) -> str:
    """'3 of 8 replies split, where the stock's top two were within 0.031 nats' (and how many margins are unknown)."""
    margins = [d["stock_margin"] for d in divergences if d["stock_margin"] is not None]
    text = f"{len(divergences)} of {replies} replies split"
    if margins:
        text += f", where the stock's top two were within {max(margins):.3g} nats"
    unknown = len(divergences) - len(margins)
    return text + (f" ({unknown} without the stock's top two)" if unknown else "")


def lengths(candidate: dict[str, list[float]], stock: dict[str, list[float]], limits: Limits) -> tuple[dict, Check]:
    """Per workload: mean reply length candidate / stock over paired requests, with a bootstrap interval."""
    table = {w: stats.bootstrap_ratio_of_means(candidate[w], stock[w]) for w in candidate}
    margin = limits.length_margin
    low, high = 1 - margin, 1 + margin
    verdicts = {w: interval_verdict(row["low"], row["high"], low, high, f"{low:g}–{high:g}") for w, row in table.items()}
    for w, row in table.items():
        row["verdict"] = verdicts[w][0]
    worst = FAIL if any(v == FAIL for v, _ in verdicts.values()) else \
        INCONCLUSIVE if any(v == INCONCLUSIVE for v, _ in verdicts.values()) else PASS
    measured = ", ".join(f"{w} {row['ratio']:.3f} [{row['low']:.3f}, {row['high']:.3f}]" for w, row in table.items())
    why = "; ".join(f"{w} reply-length ratio {text}" for w, (v, text) in verdicts.items() if v == worst != PASS)
    widest = max(((row["high"] - row["low"]) / 2 for row in table.values()), default=0.0)
    return table, Check("reply lengths", "lengths", measured, f"95 % interval within 1 ± {margin:g}", worst, why,
                        power_text(widest, margin))


def memory(candidate_peak: float | None, stock_peak: float | None, limits: Limits,
           launched: bool) -> tuple[dict, Check]:
    if limits.memory_budget_mib is not None:
        allowed = limits.memory_budget_mib
        limit = f"≤ {allowed:.0f} MiB (budget)"
    else:
        allowed = None if stock_peak is None else stock_peak + limits.memory_slack_mib
        limit = f"≤ stock + {limits.memory_slack_mib:g} MiB" + ("" if allowed is None else f" = {allowed:.0f} MiB")
    if candidate_peak is None or allowed is None:
        # A URL engine that reports no memory in /metrics: not measurable, and no reason to refuse the score;
        # refused when the judge started the candidate but has no figure to compare with.
        ok = candidate_peak is None and not launched
        record = {"ok": ok, "peak_mib": candidate_peak, "allowed_mib": allowed, "measured": False}
        why = ("the candidate is a URL that reports no memory in /metrics" if ok else
               "the candidate's peak memory could not be measured" if candidate_peak is None else
               "stock's peak memory could not be measured: give --memory-budget-mib")
        return record, Check("device memory", "memory", "not measured", limit, NOT_MEASURABLE if ok else FAIL, why,
                             ok=ok)
    ok = candidate_peak <= allowed
    record = {"ok": ok, "peak_mib": candidate_peak, "allowed_mib": allowed, "measured": True,
              "stock_peak_mib": stock_peak}
    why = "" if ok else f"candidate peak {candidate_peak:.0f} MiB > allowed {allowed:.0f} MiB"
    return record, Check("device memory", "memory", f"{candidate_peak:.0f} MiB (stock {stock_peak or 0:.0f})",
                         limit, PASS if ok else FAIL, why)
