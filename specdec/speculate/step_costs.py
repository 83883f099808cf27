"""Step costs for the speculation controller: calibrated tables of a forward's seconds (`CalibratedCosts`),
measured once at start-up; the batch buckets that served steps' measurements are kept by."""

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


class CalibratedCosts:
    """Seconds a decode step of B requests with k drafts each takes by the calibrated tables, the goodput
    estimate's prior (goodput.py):

        t(B, k) = t_verify[k](B) + k t_draft(B)        (k = 0: t_verify[0](B), a plain decode step)

    t_verify[k] is the measured verify step of B sequences of k + 1 tokens; where it is missing (k or B past
    the calibration) and for steps that also prefill, t_target(other + B (k + 1)) over tokens fed instead.
    The tables time bare forwards; what served steps add (host work, the drafter's sampling, a lookup's own
    time) the goodput estimate measures."""

    def __init__(self, target: Callable[[int], float], draft: Callable[[int], float] | None,
                 verify: dict[int, Callable[[int], float]] | None = None):
        self.target = target
        self.draft = draft or (lambda batch: 0.0)
        self.verify = verify or {}

    def predict(self, batch: int, ks: list[int], other_tokens: int = 0) -> list[float]:
        """Seconds for each k in ks, with other_tokens of prefill sharing the step."""
        draft_step = self.draft(batch)
        return [self.base(batch, k, other_tokens) + k * draft_step for k in ks]

    def base(self, batch: int, k: int, other_tokens: int = 0) -> float:
        """The target's part of the step."""
        table = self.verify.get(k)
        if other_tokens == 0 and table is not None:
            return table(batch)
        return self.target(other_tokens + batch * (k + 1))
