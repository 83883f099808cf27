"""Choosing k each step: the k with the highest estimated goodput, and one exploration rule.

A step that verifies k drafts for each of B decoding requests emits on average sum_r E_r(k) tokens,
E_r(k) = 1 + a_r + a_r^2 + ... + a_r^k, a_r being request r's acceptance rate (acceptance.py); the goodput
estimate (goodput.py) turns that into tokens per second for each k in 0..k_max, from the calibrated tables
until served steps have measured it.  k = 0 is plain decoding, so speculation switches itself off where the
target is compute-bound (a busy engine) and where it measurably loses.

Per batch bucket the controller serves the arm (k) with the highest estimate, replaced only by one that beats
it by SWITCH_MARGIN: switching speculation on costs the drafter a catch-up on every token it skipped, so a
verdict that flipped on noise would pay it again and again.  The one exploration rule keeps the other
estimates fresh, so that a verdict changes when reality does: probes of PROBE_STEPS steps run, in turn, the
arms next to the served one, plain decoding and the best speculating arm, each as soon as the bucket's
probe budget, PROBE_SHARE of its decode-only time, covers the probe's estimated time (with the drafter's
catch-up where the probe switches speculation on or back on: a 34 ms step against 2 ms plain ones for the
reference pair at 64 sequences).  A probe is two steps long because the first step of speculation after
plain steps pays that catch-up, which is not the arm's rate and is not counted as such.  Example: plain steps of
1 s and speculating ones of 9 s; a probe costs 18 s of which 2 % of plain decoding's time pays in 900 steps,
where probing every 16..128 steps had lost 10-17 % of the time.

Only decode-only steps teach: a step that also prefills costs what the prefill costs, whichever arm it ran
(on the H200, prefill steps of 20-30 ms taught an earlier controller that speculation ran at a tenth of plain
decoding's rate, and it stayed off where fixed-k n-gram speculation won by 15 %).
"""

from __future__ import annotations

import numpy as np

from specdec.speculate.acceptance import AcceptanceTracker, expected_tokens_each, expected_tokens_sum
from specdec.speculate.goodput import GoodputEstimate
from specdec.speculate.step_costs import CalibratedCosts, batch_bucket


class KController:
    """Picks the number of drafts per request for the coming step.

    A decode-only step reuses the last estimates while the batch size holds and no acceptance evidence came
    in (so while steps run plain), re-deciding every REDECIDE_EVERY steps: the estimate's arithmetic (~25 us
    warm, 140 us after a forward has flushed the CPU caches) was a tenth of a plain step at 16 requests.  A
    step that also prefills is decided afresh (its cost depends on the prefill) and leaves the cached
    decision be."""

    REDECIDE_EVERY = 8
    SWITCH_MARGIN = 1.03
    PROBE_SHARE = 0.02
    PROBE_STEPS = 2
    MIN_READINGS = 3  # of the served speculating arm before a step that also prefills may speculate

    def __init__(self, k_max: int, target_cost=None, draft_cost=None, adaptive: bool = True):
        self.k_max = k_max
        # the k values to pick from: 0, powers of two, k_max (few distinct verify shapes: few CUDA graphs)
        self._candidates = sorted({0, k_max} | {2**i for i in range(6) if 2**i < k_max})
        self._candidate_array = np.asarray(self._candidates)  # the same, for expected_tokens_sum
        self.acceptance = AcceptanceTracker()
        self.costs: CalibratedCosts | None = None
        self.estimate: GoodputEstimate | None = None
        self.adaptive = False
        if target_cost is not None:
            self.calibrate(target_cost, draft_cost)
            self.adaptive = adaptive
        self.last_k = k_max
        self.last_expected = 0.0  # tokens the acceptance rates expect from the drafts of the last step
        self._speculated = False  # did the previous observed step speculate?
        self._mixed = False  # did the step being chosen also prefill?
        self._probe = False  # is the step being chosen a probe?
        self._rates = np.zeros(0)  # [R] acceptance rates behind the step's decision
        self._decision: tuple[list[float], list[float], list[float]] = ([], [], [])  # goodput, seconds, tokens
        self._cached: tuple | None = None  # (batch, evidence version, goodput, seconds, tokens, rates)
        self._cached_age = 0

    def calibrate(self, target_cost, draft_cost, verify_cost=None) -> None:
        """Choose k from these calibrated tables (the goodput estimate's prior) from now on; until then every
        step drafts k_max."""
        self.costs = CalibratedCosts(target_cost, draft_cost, verify_cost)
        self.estimate = GoodputEstimate(self.costs, self._candidates)
        self.adaptive = True
        self._cached = None  # and, per batch bucket, what was learned starts over:
        self.serving: dict[int, int] = {}  # bucket -> index of the arm served
        self.probe_credit: dict[int, float] = {}  # bucket -> seconds of probing its budget has saved up
        self.probe_turn: dict[int, int] = {}  # bucket -> probes started (whose turn is next)
        self.probes: dict[int, list[int]] = {}  # bucket -> [arm index, steps left] of the probe under way
        self.catch_up_s: dict[int, float] = {}  # bucket -> a switch-on step's seconds beyond its arm's

    def candidates(self) -> list[int]:
        """The k values the controller picks from: 0, powers of two, k_max (few distinct verify shapes,
        so few CUDA graphs to capture)."""
        return self._candidates

    def choose(self, request_ids: list[str], other_tokens: int) -> int:
        """k for this step, given the decoding requests and the prefill tokens sharing the step."""
        if not request_ids:
            return 0
        if not self.adaptive:
            self.last_k = self.k_max
            return self.k_max
        batch = len(request_ids)
        b = batch_bucket(batch)
        self._mixed = other_tokens > 0
        if self._mixed:
            # Speculation only where it is on and measured to win: switching it on here would add the drafter's
            # catch-up to a prefill (36 ms against 18 at 64 requests on the H200), and a probe that runs into
            # such a step paid the same (35 ms steps at 8f8c2bf).
            *self._decision, self._rates = self._decide(request_ids, other_tokens)
            i = _argmax(self._decision[0])
            served = self.serving.get(b, 0)
            verdict = served > 0 and self.estimate.readings(batch, self._candidates[served]) >= self.MIN_READINGS
            if i and not (self._speculated and verdict):
                i = 0
            self._probe = False
        else:
            version = self.acceptance.version
            if self._cached is None or self._cached[:2] != (batch, version) or self._cached_age >= self.REDECIDE_EVERY:
                self._cached, self._cached_age = (batch, version, *self._decide(request_ids, 0)), 0
            self._cached_age += 1
            *self._decision, self._rates = self._cached[2:]
            i, self._probe = self._arm(b, *self._decision[:2])
        self.last_k = self._candidates[i]
        self.last_expected = self._decision[2][i]  # until drafted() says what was really proposed
        return self.last_k

    def _decide(self, request_ids: list[str], other_tokens: int) -> tuple[list[float], list[float], list[float],
                                                                           np.ndarray]:
        """For each candidate k: estimated tokens per second, seconds per step and tokens expected; and the
        acceptance rates used."""
        rates = self.acceptance.rates(request_ids)
        tokens = expected_tokens_sum(rates, self._candidate_array).tolist()
        goodput, seconds = self.estimate.evaluate(len(request_ids), tokens, other_tokens)
        return goodput, seconds, tokens, rates

    def _arm(self, b: int, goodput: list[float], seconds: list[float]) -> tuple[int, bool]:
        """(index of the arm this decode-only step of bucket b runs, whether it is a probe)."""
        served, best = self.serving.get(b), _argmax(goodput)
        if served is None or goodput[best] > self.SWITCH_MARGIN * goodput[served]:
            served = self.serving[b] = best
        probe = self.probes.get(b) or self._start_probe(b, served, goodput, seconds)
        if probe is None:
            return served, False
        probe[1] -= 1
        if probe[1] == 0:
            del self.probes[b]
        return probe[0], True

    def _start_probe(self, b: int, served: int, goodput: list[float], seconds: list[float]) -> list[int] | None:
        """The probe whose turn it is, if bucket b's budget covers it."""
        credit = self.probe_credit.get(b, 0.0)
        if credit < self.PROBE_STEPS * min(seconds):  # no probe affordable yet (most steps: answered cheaply)
            return None
        best_speculating = 1 + _argmax(goodput[1:])
        others = sorted({0, best_speculating, served - 1, served + 1} - {served, -1, len(goodput)})
        turn = self.probe_turn.get(b, 0)
        arm = others[turn % len(others)]
        cost = self.PROBE_STEPS * seconds[arm]
        if (arm > 0) != (served > 0):  # it switches speculation on, or back on after it
            cost += self.catch_up_s.get(b, 0.0)
        if credit < cost:
            return None
        self.probe_credit[b] = credit - cost
        self.probe_turn[b] = turn + 1
        self.probes[b] = [arm, self.PROBE_STEPS]
        return self.probes[b]

    def drafted(self, request_ids: list[str], counts: list[int]) -> None:
        """The drafts the speculator really proposed this step (an n-gram lookup often finds none): the tokens
        the step is expected to emit count those, not k for every request."""
        rates = self._rates if len(self._rates) == len(counts) else self.acceptance.rates(request_ids)
        self.last_expected = float(expected_tokens_each(rates, np.asarray(counts)).sum())

    @property
    def probing(self) -> bool:
        """Whether the step chosen last is a probe."""
        return self._probe

    def observe_step(self, batch: int, k: int, seconds: float, probe: bool | None = None) -> None:
        """A finished step: `batch` decoding requests at `k` drafts took `seconds`; probe: whether it was a probe
        (default: the step chosen last, as it is unless a step was chosen behind one in flight, engine/overlap.py).

        Steps that also prefilled teach nothing (their cost is the prefill's); the step that switches
        speculation on pays the drafter's catch-up, which is kept apart as the price of a probe's switch."""
        switch_on = k > 0 and not self._speculated
        self._speculated = k > 0
        _, predicted, tokens = self._decision
        if not self.adaptive or self._mixed or not tokens or batch == 0 or seconds <= 0:
            return
        b = batch_bucket(batch)
        self.probe_credit[b] = self.probe_credit.get(b, 0.0) + self.PROBE_SHARE * seconds
        i = self._candidates.index(k)
        if switch_on:
            extra, old = max(0.0, seconds - predicted[i]), self.catch_up_s.get(b)
            self.catch_up_s[b] = extra if old is None else (old + extra) / 2
            return
        expected = self.last_expected if k else tokens[i]
        self.estimate.observe(batch, k, expected, tokens[i], seconds,
                              probe=self._probe if probe is None else probe)

    def state(self) -> dict[str, list[float]]:
        """The goodput estimate's arms (GoodputEstimate.state), for the benches."""
        return self.estimate.state() if self.estimate is not None else {}


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)
