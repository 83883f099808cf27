"""The goodput guard: measured tokens/s with and without speculation per batch bucket."""

from __future__ import annotations

import math

from specdec.speculate.step_costs import batch_bucket


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

    bucket = staticmethod(batch_bucket)

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
