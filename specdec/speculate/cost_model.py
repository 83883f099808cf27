"""Choosing k each step so that speculation pays: measured step costs and running acceptance rates.

A step that verifies k drafts for each of B decoding requests feeds T = B (k + 1) tokens (plus any
prefill) to the target and costs t_target(T) + k t_draft(B).  Request r then emits on average
E_r(k) = 1 + a_r + a_r^2 + ... + a_r^k tokens, a_r being its acceptance rate.  The controller picks
the k in 0..k_max with the most tokens per second, sum_r E_r(k) / cost(k); k = 0 is plain decoding,
so when the target is compute-bound (a busy engine) speculation switches itself off.

The cost tables are measured once at start; what a step really costs also holds host overhead, the
drafter's sampling, graph captures.  So the controller also keeps, per batch-size bucket, the measured
tokens per second of steps that speculated and of steps that did not (exponential moving averages),
and turns speculation off for a bucket where it measurably loses (`GoodputGuard`), probing now and
then so that the verdict can change.
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

    def __init__(self):
        self.rate: dict[tuple[int, bool], float] = {}  # (bucket, speculated) -> tokens/s
        self.step_s: dict[tuple[int, bool], float] = {}  # (bucket, speculated) -> seconds per step
        self.steps: dict[int, int] = {}
        self.gap: dict[int, int] = {}  # steps between probes
        self.next_probe: dict[int, int] = {}  # step at which the bucket's next probe starts
        self.verdict: dict[int, bool] = {}  # the preferred arm when the current probe started
        self.preferred: dict[int, bool] = {}  # the arm the rates last pointed to (the hysteresis state)
        self.switch_on_s: dict[int, float] = {}  # bucket -> seconds of a step that switches speculation on

    @staticmethod
    def bucket(batch: int) -> int:
        return max(0, batch - 1).bit_length()  # 1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3, ...

    def update_preference(self, b: int) -> bool | None:
        """Which arm bucket b's rates now point to, through the hysteresis (stored in `preferred`); None until
        both arms are measured."""
        spec, plain = self.rate.get((b, True)), self.rate.get((b, False))
        if spec is None or plain is None:
            return None
        margin = self.KEEP_MARGIN if self.preferred.get(b, False) else self.SWITCH_ON_MARGIN
        self.preferred[b] = spec >= margin * plain
        return self.preferred[b]

    def allow(self, batch: int) -> bool:
        b = self.bucket(batch)
        step = self.steps[b] = self.steps.get(b, 0) + 1
        prefer_spec = self.update_preference(b)
        if prefer_spec is None:  # unmeasured: alternate until both arms have a reading
            return self.rate.get((b, True)) is None
        start = self.next_probe.setdefault(b, step + self.affordable_gap(b, self.PROBE_EVERY))
        if step == start:
            self.verdict[b] = prefer_spec
        if start <= step < start + self.PROBE_STEPS:
            return not prefer_spec
        if step >= start + self.PROBE_STEPS:  # the probe is over: did it change the verdict?
            gap = self.gap.get(b, self.PROBE_EVERY)
            gap = min(2 * gap, self.MAX_PROBE_EVERY) if self.verdict.get(b) == prefer_spec else self.PROBE_EVERY
            self.gap[b], self.next_probe[b] = gap, step + self.affordable_gap(b, gap)
        return prefer_spec

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
        old = self.step_s.get(key)
        self.step_s[key] = seconds if old is None else (1 - weight) * old + weight * seconds


class KController:
    """Picks the number of drafts per request for the coming step."""

    def __init__(self, k_max: int, target_cost: Callable[[int], float] | None,
                 draft_cost: Callable[[int], float] | None, adaptive: bool = True):
        self.k_max = k_max
        self.target_cost = target_cost
        self.draft_cost = draft_cost or (lambda batch: 0.0)
        self.adaptive = adaptive and target_cost is not None
        self.acceptance = AcceptanceTracker()
        self.guard = GoodputGuard()
        self.last_k = k_max
        self.last_expected = 0.0  # tokens the acceptance estimates expect from the last chosen step
        self._speculated = False  # did the previous observed step speculate?
        # the k values to pick from: 0, powers of two, k_max (few distinct verify shapes: few CUDA graphs)
        self._candidates = sorted({0, k_max} | {2**i for i in range(6) if 2**i < k_max})
        self._candidate_array = np.asarray(self._candidates)  # the same, for expected_tokens_sum

    def calibrate(self, target_cost: Callable[[int], float], draft_cost: Callable[[int], float] | None) -> None:
        """Choose k from these measured costs from now on (until then every step drafts k_max)."""
        self.target_cost = target_cost
        self.draft_cost = draft_cost or (lambda batch: 0.0)
        self.adaptive = True

    def candidates(self) -> list[int]:
        """The k values the controller picks from: 0, powers of two, k_max (few distinct verify shapes,
        so few CUDA graphs to capture)."""
        return self._candidates

    def observe_step(self, batch: int, k: int, tokens: int, seconds: float) -> None:
        """A finished step: `batch` decoding requests at `k` drafts emitted `tokens` in `seconds`.

        The guard gets the measured time but, for a speculating step, the tokens the acceptance estimates
        expected (`last_expected`): a single step's accepted count swings between 1 and k + 1 per request,
        the estimates average many drafts, and the time is what the guard is there to check."""
        switch_on = k > 0 and not self._speculated  # includes the drafter's catch-up: not the steady rate
        self._speculated = k > 0
        if self.adaptive and switch_on:
            self.guard.observe_switch_on(batch, seconds)
        elif self.adaptive:
            self.guard.observe(batch, k > 0, self.last_expected if k > 0 else tokens, seconds)

    def choose(self, request_ids: list[str], other_tokens: int) -> int:
        """k for this step, given the decoding requests and the prefill tokens sharing the step."""
        if not request_ids:
            return 0
        if not self.adaptive:
            self.last_k = self.k_max
            return self.k_max
        batch = len(request_ids)
        ks = self.candidates()
        expected = expected_tokens_sum(self.acceptance.rates(request_ids), self._candidate_array)  # [C]
        best_k, best_rate, best_tokens = 0, 0.0, float(batch)
        for k, tokens in zip(ks, expected.tolist()):
            cost = self.target_cost(other_tokens + batch * (k + 1)) + k * self.draft_cost(batch)
            if tokens / cost > best_rate * 1.0001:
                best_k, best_rate, best_tokens = k, tokens / cost, tokens
        if best_k > 0 and not self.guard.allow(batch):
            best_k, best_tokens = 0, float(batch)
        self.last_k = best_k
        self.last_expected = best_tokens  # until drafted() says what was really proposed
        return best_k

    def drafted(self, request_ids: list[str], counts: list[int]) -> None:
        """The drafts the speculator really proposed this step (an n-gram lookup often finds none): the
        expected tokens the guard is given count those, not k for every request."""
        self.last_expected = float(expected_tokens_each(self.acceptance.rates(request_ids), np.asarray(counts)).sum())
