"""Step costs for the speculation controller: calibrated tables of a forward's seconds, corrected by what
served steps measure (`MeasuredCosts`), per batch-size bucket."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch


def batch_bucket(batch: int) -> int:
    """The bucket whose statistics a step of `batch` decoding requests uses: 1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3."""
    return max(0, batch - 1).bit_length()


class StepCostTable:
    """Seconds per forward as a function of tokens fed: measured points, linear in between and beyond."""

    def __init__(self, points: dict[int, float]):
        self.tokens = sorted(points)
        self.seconds = [points[t] for t in self.tokens]

    def __call__(self, tokens: int) -> float:
        xs, ys = self.tokens, self.seconds
        if tokens <= xs[0]:
            return ys[0]
        if tokens >= xs[-1]:  # beyond the table: cost grows in proportion (compute-bound)
            return ys[-1] * tokens / xs[-1]
        i = bisect.bisect_left(xs, tokens)
        w = (tokens - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + w * (ys[i] - ys[i - 1])


def measure_forward_cost(forward: Callable[[int], None], sizes: list[int], device: torch.device,
                         repeats: int = 3) -> StepCostTable:
    """Time forward(n) for each n (median of `repeats`, after one warm-up call)."""
    points = {}
    for n in sizes:
        forward(n)
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            forward(n)
            _sync(device)
            times.append(time.perf_counter() - t0)
        points[n] = sorted(times)[len(times) // 2]
    return StepCostTable(points)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MeasuredCosts:
    """Seconds a decode step of B requests with k drafts each should take: the calibrated tables, corrected by
    what served decode-only steps measured, per batch-size bucket b (batch_bucket):

        cost(B, k) = verify_scale[b, k > 0] * t_verify[k](B)
                     + [k > 0] * (draft_scale[b] * k * t_draft(B) + propose_s[b])

    t_verify[k] is the measured verify step of B sequences of k + 1 tokens; where it is missing (k or B past
    the calibration) and for steps that also prefill, t_target(other + B (k + 1)) over tokens fed instead.

    verify_scale is measured step time less the speculator's, over that calibrated base; draft_scale the
    speculator's time over k t_draft(B) for a drafter with a table; propose_s the speculator's time for one
    without (an n-gram lookup, a remote drafter).  Until measured, scales are 1 and the speculating arm's
    verify scale is the plain arm's; the first readings are averaged with that prior (it counts as one
    reading), later ones enter an exponential moving average (weight EMA), so that one outlier (the first
    step at a new shape) moves a scale half way, not all the way.  Example: the reference drafter's served
    steps at batch 1 on the H200 took 2.7x its table (sampling, host work), which the table alone hid."""

    EMA = 0.25

    def __init__(self, target: Callable[[int], float], draft: Callable[[int], float] | None,
                 verify: dict[int, Callable[[int], float]] | None = None):
        self.target = target
        self.draft = draft or (lambda batch: 0.0)
        self.verify = verify or {}
        self.verify_scale: dict[tuple[int, bool], float] = {}
        self.draft_scale: dict[int, float] = {}
        self.propose_s: dict[int, float] = {}
        self.readings: dict[tuple[str, object], int] = {}  # (table's name, key) -> readings so far

    def predict(self, batch: int, ks: list[int], other_tokens: int) -> list[float]:
        """Seconds for each k in ks, with other_tokens of prefill sharing the step."""
        b = batch_bucket(batch)
        plain_scale = self.verify_scale.get((b, False), 1.0)
        spec_scale = self.verify_scale.get((b, True), plain_scale)
        draft_step = self.draft_scale.get(b, 1.0) * self.draft(batch)
        propose = self.propose_s.get(b, 0.0)
        return [self.base(batch, k, other_tokens) * (spec_scale if k else plain_scale)
                + (k * draft_step + propose if k else 0.0) for k in ks]

    def base(self, batch: int, k: int, other_tokens: int = 0) -> float:
        """The calibrated seconds of the target's part of the step, before the measured scale."""
        table = self.verify.get(k)
        if other_tokens == 0 and table is not None:
            return table(batch)
        return self.target(other_tokens + batch * (k + 1))

    def observe(self, batch: int, k: int, fed: int, seconds: float, propose_seconds: float) -> None:
        """A decode-only step: `fed` tokens verified in `seconds`, of which the speculator took propose_seconds."""
        b = batch_bucket(batch)
        prior = self.verify_scale.get((b, False), 1.0) if k else 1.0
        base = self.base(batch, k) if k in self.verify else self.target(fed)
        self._mix("verify_scale", (b, k > 0), (seconds - propose_seconds) / base, prior)
        if k == 0:
            return
        predicted = k * self.draft(batch)
        if predicted > 0:
            self._mix("draft_scale", b, propose_seconds / predicted, 1.0)
        else:
            self._mix("propose_s", b, propose_seconds, propose_seconds)  # no prior for a lookup's time

    def _mix(self, name: str, key, value: float, prior: float) -> None:
        table = getattr(self, name)
        n = self.readings[name, key] = self.readings.get((name, key), 0) + 1
        weight = max(self.EMA, 1 / (n + 1))  # 1/2, 1/3: the mean of the prior and the readings; then EMA
        table[key] = (1 - weight) * table.get(key, prior) + weight * value
