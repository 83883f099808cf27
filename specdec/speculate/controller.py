"""Choosing k each step so that speculation pays: measured step costs and running acceptance rates.

A step that verifies k drafts for each of B decoding requests feeds T = B (k + 1) tokens (plus any
prefill) to the target and costs t_target(T) + k t_draft(B).  Request r then emits on average
E_r(k) = 1 + a_r + a_r^2 + ... + a_r^k tokens, a_r being its acceptance rate.  The controller picks
the k in 0..k_max with the most tokens per second, sum_r E_r(k) / cost(k); k = 0 is plain decoding,
so when the target is compute-bound (a busy engine) speculation switches itself off.

The cost tables are measured once at start, on bare forwards; what a served step costs also holds host
work, the drafter's sampling, the n-gram lookup.  So every decode-only step served corrects them
(`MeasuredCosts`): per batch-size bucket, the ratio of the target's measured time to the table's (with and
without drafts), of the drafter's measured time to k t_draft(B), and a speculator's own time when it has
no table (a lookup, a remote drafter).  The controller also keeps, per bucket, the measured tokens per
second of steps that speculated and of steps that did not, and turns speculation off for a bucket where
it measurably loses (`GoodputGuard`), probing now and then so that the verdict can change.

Only decode-only steps teach either: a step that also prefills costs what the prefill costs, whichever
arm it ran (on the H200, prefill steps of 20-30 ms taught the guard that speculation ran at a tenth of
plain decoding's rate, and it stayed off where fixed-k n-gram speculation won by 15 %).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from specdec.speculate.acceptance import AcceptanceTracker, expected_tokens_each, expected_tokens_sum
from specdec.speculate.guard import GoodputGuard
from specdec.speculate.step_costs import MeasuredCosts


class KController:
    """Picks the number of drafts per request for the coming step.

    A decode-only step reuses the last decision while the batch size holds and no acceptance evidence came
    in (so while steps run plain), re-deciding every REDECIDE_EVERY steps: the decision's arithmetic (~25 us
    warm, 140 us after a forward has flushed the CPU caches) was a tenth of a plain step at 16 requests.  A
    step that also prefills is decided afresh (its cost depends on the prefill) and leaves the cached
    decision be."""

    REDECIDE_EVERY = 8

    def __init__(self, k_max: int, target_cost: Callable[[int], float] | None,
                 draft_cost: Callable[[int], float] | None, adaptive: bool = True):
        self.k_max = k_max
        self.adaptive = adaptive and target_cost is not None
        self.costs = MeasuredCosts(target_cost, draft_cost) if target_cost is not None else None
        self.acceptance = AcceptanceTracker()
        self.guard = GoodputGuard()
        self.last_k = k_max
        self.last_expected = 0.0  # tokens the acceptance estimates expect from the last chosen step
        self._speculated = False  # did the previous observed step speculate?
        self._mixed = False  # did the step being chosen also prefill?
        self._rates = np.zeros(0)  # [R] acceptance rates behind the step's decision
        self._cached: tuple | None = None  # (batch, evidence version, best k, its tokens, best k > 0, its tokens,
        #                                      rates)
        self._cached_age = 0
        # the k values to pick from: 0, powers of two, k_max (few distinct verify shapes: few CUDA graphs)
        self._candidates = sorted({0, k_max} | {2**i for i in range(6) if 2**i < k_max})
        self._candidate_array = np.asarray(self._candidates)  # the same, for expected_tokens_sum

    def calibrate(self, target_cost: Callable[[int], float], draft_cost: Callable[[int], float] | None,
                  verify_cost: dict[int, Callable[[int], float]] | None = None) -> None:
        """Choose k from these measured costs from now on (until then every step drafts k_max)."""
        self.costs = MeasuredCosts(target_cost, draft_cost, verify_cost)
        self.adaptive = True
        self._cached = None

    def candidates(self) -> list[int]:
        """The k values the controller picks from: 0, powers of two, k_max (few distinct verify shapes,
        so few CUDA graphs to capture)."""
        return self._candidates

    def observe_step(self, batch: int, k: int, tokens: int, seconds: float, fed: int | None = None,
                     propose_seconds: float = 0.0) -> None:
        """A finished step: `batch` decoding requests at `k` drafts emitted `tokens` in `seconds`, having fed
        the target `fed` tokens (default batch (k + 1)), the speculator's work taking propose_seconds.

        The guard gets the measured time but, for a speculating step, the tokens the acceptance estimates
        expected (`last_expected`): a single step's accepted count swings between 1 and k + 1 per request,
        the estimates average many drafts, and the time is what the guard is there to check.  Steps that also
        prefilled teach nothing (their cost is the prefill's), nor does the step that switches speculation on
        (it pays the drafter's catch-up: the guard keeps that cost apart)."""
        switch_on = k > 0 and not self._speculated
        self._speculated = k > 0
        if not self.adaptive or self._mixed:
            return
        if switch_on:
            self.guard.observe_switch_on(batch, seconds)
            return
        self.costs.observe(batch, k, fed if fed is not None else batch * (k + 1), seconds, propose_seconds)
        self.guard.observe(batch, k > 0, self.last_expected if k > 0 else tokens, seconds)

    def choose(self, request_ids: list[str], other_tokens: int) -> int:
        """k for this step, given the decoding requests and the prefill tokens sharing the step."""
        if not request_ids:
            return 0
        if not self.adaptive:
            self.last_k = self.k_max
            return self.k_max
        batch = len(request_ids)
        self._mixed = other_tokens > 0
        if self._mixed:
            # Speculation only where it is on and measured to win: switching it on here would add the drafter's
            # catch-up to a prefill (36 ms against 18 at 64 requests on the H200), and a probe that runs into
            # such a step paid the same (35 ms steps at 8f8c2bf).
            k, tokens, _, _, self._rates = self._decide(request_ids, other_tokens)
            if k and not (self._speculated and self.guard.prefers_speculation(batch)):
                k, tokens = 0, float(batch)
        else:
            version = self.acceptance.version
            if self._cached is None or self._cached[:2] != (batch, version) or self._cached_age >= self.REDECIDE_EVERY:
                self._cached, self._cached_age = (batch, version, *self._decide(request_ids, 0)), 0
            self._cached_age += 1
            _, _, best_k, best_tokens, spec_k, spec_tokens, self._rates = self._cached
            if self.guard.allow(batch, model_prefers_spec=best_k > 0):
                k, tokens = spec_k, spec_tokens  # the model's choice, or a probe where it prefers plain
            else:
                k, tokens = 0, float(batch)
        self.last_k = k
        self.last_expected = tokens  # until drafted() says what was really proposed
        return k

    def _decide(self, request_ids: list[str], other_tokens: int) -> tuple[int, float, int, float, np.ndarray]:
        """The k with the most expected tokens per predicted second and its expected tokens, the same among
        k > 0 (what a probe runs), and the acceptance rates used."""
        rates = self.acceptance.rates(request_ids)
        expected = expected_tokens_sum(rates, self._candidate_array).tolist()  # [C], candidates[0] = 0
        seconds = self.costs.predict(len(request_ids), self._candidates, other_tokens)
        spec = 1
        for i in range(2, len(expected)):
            if expected[i] / seconds[i] > expected[spec] / seconds[spec] * 1.0001:
                spec = i
        best = spec if expected[spec] / seconds[spec] > expected[0] / seconds[0] * 1.0001 else 0
        return self._candidates[best], expected[best], self._candidates[spec], expected[spec], rates

    def drafted(self, request_ids: list[str], counts: list[int]) -> None:
        """The drafts the speculator really proposed this step (an n-gram lookup often finds none): the
        expected tokens the guard is given count those, not k for every request."""
        rates = self._rates if len(self._rates) == len(counts) else self.acceptance.rates(request_ids)
        self.last_expected = float(expected_tokens_each(rates, np.asarray(counts)).sum())
