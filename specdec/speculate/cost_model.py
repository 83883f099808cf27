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

import bisect
import math
import time
from collections.abc import Callable

import numpy as np
import torch

PRIOR_ACCEPTANCE = 0.8  # optimistic until measured: a pessimistic prior could keep k = 0 and never learn
PRIOR_WEIGHT = 4.0  # the prior counts as this many tested drafts
ENGINE_EVIDENCE = 16.0  # tested drafts engine-wide after which new requests start from the engine's rate
DECAY = 0.98  # per-step forgetting of old acceptance evidence


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
    what served decode-only steps measured, per batch-size bucket b (GoodputGuard.bucket):

        cost(B, k) = verify_scale[b, k > 0] * t_verify[k](B)
                     + [k > 0] * (draft_scale[b] * k * t_draft(B) + propose_s[b])

    t_verify[k] is the measured verify step of B sequences of k + 1 tokens; where it is missing (k or B past
    the calibration) and for steps that also prefill, t_target(other + B (k + 1)) over tokens fed instead.

    verify_scale is measured step time less the speculator's, over t_target(tokens fed); draft_scale the
    speculator's time over k t_draft(B) for a drafter with a table; propose_s the speculator's time for one
    without (an n-gram lookup, a remote drafter).  Until measured, scales are 1 and the speculating arm's
    verify scale is the plain arm's; the first readings are averaged with that prior (it counts as one
    reading), later ones enter an exponential moving average (weight EMA), so that one outlier (the first step
    at a new shape) moves a scale half way, not all the way.  Example (the reference pair at batch 1 on the H200): the table says a
    draft step costs 0.12 ms, a served one costs 0.24 ms (sampling, host work), so draft_scale -> 2 and k
    falls from 8 to 2-4, where speculation wins."""

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
        b = GoodputGuard.bucket(batch)
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
        b = GoodputGuard.bucket(batch)
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


class AcceptanceTracker:
    """Per-request acceptance rate: accepted / tested drafts with a prior, decayed each update.

    The prior is the engine-wide rate (all requests' evidence, decayed the same way) once there is enough
    of it, and an optimistic PRIOR_ACCEPTANCE before: a drafter that has never been tried gets tried, and
    the evidence then decides."""

    def __init__(self):
        self.accepted: dict[str, float] = {}
        self.tested: dict[str, float] = {}
        self.engine_accepted = 0.0
        self.engine_tested = 0.0
        self.version = 0  # counts updates: a decision taken on older rates is stale

    def prior(self) -> float:
        if self.engine_tested >= ENGINE_EVIDENCE:
            return self.engine_accepted / self.engine_tested
        return PRIOR_ACCEPTANCE

    def rates(self, request_ids: list[str]) -> np.ndarray:
        """[R] the acceptance rates of these requests (the prior computed once for all)."""
        prior = self.prior() * PRIOR_WEIGHT
        accepted, tested = self.accepted, self.tested
        a = np.fromiter((accepted.get(r, 0.0) for r in request_ids), float, len(request_ids))
        t = np.fromiter((tested.get(r, 0.0) for r in request_ids), float, len(request_ids))
        return (a + prior) / (t + PRIOR_WEIGHT)

    def update(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.version += 1
        tested = num_accepted + (1 if num_accepted < num_drafts else 0)  # drafts whose test was run
        self.accepted[request_id] = self.accepted.get(request_id, 0.0) * DECAY + num_accepted
        self.tested[request_id] = self.tested.get(request_id, 0.0) * DECAY + tested
        self.engine_accepted = self.engine_accepted * DECAY + num_accepted
        self.engine_tested = self.engine_tested * DECAY + tested

    def forget(self, request_id: str) -> None:
        self.accepted.pop(request_id, None)
        self.tested.pop(request_id, None)


def expected_tokens(alpha: float, k: int) -> float:
    """1 + alpha + ... + alpha^k: tokens emitted per verify step with k drafts."""
    return sum(alpha**i for i in range(k + 1))


def expected_tokens_each(alphas: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """expected_tokens(alpha, k) elementwise over broadcast arrays of rates in [0, 1] and draft counts.

    The geometric series in closed form, (1 - a^(k+1)) / (1 - a), with a = 1 giving k + 1: the controller
    runs this every step for every decoding request, and a Python loop over R x C x k terms cost 0.2 ms at
    R = 64, a tenth of a host-bound decode step."""
    a = np.minimum(alphas, 1.0 - 1e-9)  # a = 1 (every draft accepted) -> k + 1 within 1e-7
    return (1.0 - a ** (ks + 1)) / (1.0 - a)


def expected_tokens_sum(alphas: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """[C]: for each k in ks [C], the sum over requests (alphas [R]) of expected_tokens(alpha, k)."""
    return expected_tokens_each(alphas[:, None], ks[None, :]).sum(axis=0)


class GoodputGuard:
    """Measured tokens/s with and without speculation per batch bucket; vetoes speculation that loses.

    Now and then PROBE_STEPS steps of a bucket run the arm that is not currently preferred, so both
    estimates stay fresh.  A probe is two steps long because the first step of speculation after plain steps
    also pays the drafter's catch-up on the tokens it missed, which the controller does not count as the
    speculating rate.  Probes start PROBE_EVERY steps apart; each probe that leaves the verdict as it was
    doubles the gap (up to MAX_PROBE_EVERY), and one that flips it resets the gap, so a settled verdict
    costs ever less: with a losing drafter the share of slow steps falls from 2/16 towards 2/128.  The arm
    that only probes sees few steps, so its estimate moves faster (PROBE_EMA): one probe into a changed
    reality is enough to flip the verdict.
    """

    EMA = 0.1
    PROBE_EMA = 0.5
    PROBE_EVERY = 16
    MAX_PROBE_EVERY = 128
    PROBE_STEPS = 2
    # Hysteresis: speculation keeps running while it reaches 97% of plain decoding's goodput, but is switched
    # back on only when it beats plain by 3%.  Switching on costs the drafter a catch-up on every token it
    # skipped, which the rates leave out, so a verdict that flipped on noise would pay it again and again.
    KEEP_MARGIN = 0.97
    SWITCH_ON_MARGIN = 1.03
    # Probing the losing arm costs time; the gap to the next probe is stretched (up to MAX_AFFORDED_GAP steps)
    # until the probes, with the drafter's catch-up in the step that switches speculation on, lose at most
    # this share of the bucket's time.  Example: speculating steps 9x as long as
    # plain ones at 0.32x their goodput lose 2 x 9 x 0.68 = 12 plain steps' time per two-step probe, so the
    # probes come at least 612 steps apart instead of every 16..128 steps (which cost 10-17 %).
    PROBE_BUDGET = 0.02
    MAX_AFFORDED_GAP = 4096
    # Readings of each arm before a verdict: a single step can be an outlier (the first at a new shape).
    MIN_READINGS = 3

    def __init__(self):
        self.rate: dict[tuple[int, bool], float] = {}  # (bucket, speculated) -> tokens/s
        self.step_s: dict[tuple[int, bool], float] = {}  # (bucket, speculated) -> seconds per step
        self.steps: dict[int, int] = {}
        self.gap: dict[int, int] = {}  # steps between probes
        self.next_probe: dict[int, int] = {}  # step at which the bucket's next probe starts
        self.verdict: dict[int, bool] = {}  # the preferred arm when the current probe started
        self.preferred: dict[int, bool] = {}  # the arm the rates last pointed to (the hysteresis state)
        self.switch_on_s: dict[int, float] = {}  # bucket -> seconds of a step that switches speculation on
        self.readings: dict[tuple[int, bool], int] = {}  # (bucket, speculated) -> steps observed

    @staticmethod
    def bucket(batch: int) -> int:
        return max(0, batch - 1).bit_length()  # 1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3, ...

    def update_preference(self, b: int) -> bool | None:
        """Which arm bucket b's rates now point to, through the hysteresis (stored in `preferred`); None until
        both arms have MIN_READINGS readings."""
        if min(self.readings.get((b, True), 0), self.readings.get((b, False), 0)) < self.MIN_READINGS:
            return None
        spec, plain = self.rate[(b, True)], self.rate[(b, False)]
        margin = self.KEEP_MARGIN if self.preferred.get(b, False) else self.SWITCH_ON_MARGIN
        self.preferred[b] = spec >= margin * plain
        return self.preferred[b]

    def allow(self, batch: int, model_prefers_spec: bool = True) -> bool:
        """Whether this step of `batch` decoding requests may speculate.  Where the cost model itself prefers
        plain decoding, that is the verdict, but probes still run speculation now and then: the measured
        costs the model learns from would otherwise never see a speculating step again."""
        b = self.bucket(batch)
        step = self.steps[b] = self.steps.get(b, 0) + 1
        prefer_spec = self.update_preference(b) if model_prefers_spec else False
        if prefer_spec is None:  # too few readings: measure speculation first, then plain decoding
            return self.readings.get((b, True), 0) < self.MIN_READINGS
        start = self.next_probe.get(b)
        if start is None:
            if (b, True) in self.rate and (b, False) not in self.rate:
                return prefer_spec  # plain decoding unmeasured here: measure it before spacing the probes
            start = self.next_probe[b] = step + self.affordable_gap(b, self.PROBE_EVERY)
        if step == start:
            self.verdict[b] = prefer_spec
        if start <= step < start + self.PROBE_STEPS:
            return not prefer_spec
        if step >= start + self.PROBE_STEPS:  # the probe is over: did it change the verdict?
            gap = self.gap.get(b, self.PROBE_EVERY)
            gap = min(2 * gap, self.MAX_PROBE_EVERY) if self.verdict.get(b) == prefer_spec else self.PROBE_EVERY
            self.gap[b], self.next_probe[b] = gap, step + self.affordable_gap(b, gap)
        return prefer_spec

    def prefers_speculation(self, batch: int) -> bool:
        """Whether this batch's bucket has a verdict and it is speculation (for steps that do not count as
        the bucket's steps: those that also prefill)."""
        return self.preferred.get(self.bucket(batch)) is True

    def affordable_gap(self, b: int, gap: int) -> int:
        """gap, or more steps if a probe of the losing arm every `gap` steps would cost over PROBE_BUDGET."""
        prefer_spec = self.preferred.get(b, False)
        rates = self.rate.get((b, prefer_spec)), self.rate.get((b, not prefer_spec))
        seconds = self.step_s.get((b, prefer_spec)), self.step_s.get((b, not prefer_spec))
        if None in rates or None in seconds or rates[1] >= rates[0]:
            return gap
        lost = self.PROBE_STEPS * seconds[1] / seconds[0] * (1 - rates[1] / rates[0])  # preferred steps' time
        # Every probe switches speculation on once (into the probe, or back after a probe of plain decoding),
        # and that step also pays the drafter's catch-up on the tokens it skipped: a 34 ms step against 2 ms
        # plain ones for the reference pair at 64 sequences.
        spec_s = self.step_s[(b, True)]
        lost += max(0.0, self.switch_on_s.get(b, spec_s) - spec_s) / seconds[0]
        return min(max(gap, math.ceil(lost / self.PROBE_BUDGET)), self.MAX_AFFORDED_GAP)

    def observe_switch_on(self, batch: int, seconds: float) -> None:
        """A step that switched speculation on (its time includes the drafter's catch-up)."""
        b = self.bucket(batch)
        old = self.switch_on_s.get(b)
        self.switch_on_s[b] = seconds if old is None else (1 - self.PROBE_EMA) * old + self.PROBE_EMA * seconds

    def observe(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        if batch == 0 or seconds <= 0:
            return
        b = self.bucket(batch)
        key = (b, speculated)
        rate = tokens / seconds
        old = self.rate.get(key)
        weight = self.PROBE_EMA if self.update_preference(b) not in (None, speculated) else self.EMA
        self.rate[key] = rate if old is None else (1 - weight) * old + weight * rate
        self.readings[key] = self.readings.get(key, 0) + 1
        old = self.step_s.get(key)
        self.step_s[key] = seconds if old is None else (1 - weight) * old + weight * seconds


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
