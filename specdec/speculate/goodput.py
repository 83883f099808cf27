"""The goodput of each (batch bucket, k): the calibrated prediction, corrected by what served steps measure."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.speculate.step_costs import CalibratedCosts, batch_bucket


@dataclass
class Arm:
    """What the decode-only steps of one (batch bucket, k) measured."""

    readings: int
    time_ratio: float  # a step's measured seconds / the calibrated tables' seconds
    token_share: float  # tokens expected from the drafts really proposed / had every request drafted k


class GoodputEstimate:
    """Tokens per second of a decode-only step of B requests drafting k each, per batch bucket b
    (batch_bucket) and k in ks:

        goodput(B, k) = tokens(k) token_share[b, k] / (t(B, k) time_ratio[b, k])

    The prior is tokens(k) / t(B, k): tokens(k) = sum_r E_r(k), what the acceptance rates expect
    (acceptance.py), t(B, k) the calibrated tables' seconds (CalibratedCosts).  Served decode-only steps
    measure the two corrections: time_ratio, the step's seconds over t(B, k) (host work, the drafter's
    sampling, a lookup's own time: the reference drafter's served steps at batch 1 on the H200 took 2.7x its
    table), and token_share, the tokens the drafts really proposed are expected to emit over tokens(k) (an
    n-gram lookup often finds drafts for few requests; counted as k each, useless verify steps looked like a
    win and ngram kept drafting under a full KV cache).  Tokens expected, not accepted: a single step's
    accepted count swings between 1 and k + 1 per request, the acceptance rates average many drafts.

    An arm's first reading is averaged with its prior, which counts as one reading, the next ones enter
    with weight 1/(n + 1) until that falls to EMA: one outlier (the first step at a new shape) moves an arm
    half way, not all the way.  Once a served arm has TRUSTED readings, each new one enters clipped to within
    CLIP of the arm's estimate: a single slow step (a collection pause, a host hiccup: 17-25 ms steps among
    10 ms ones at batch 1 on the 8B twin) moves it by EMA x 25 % at most, not EMA x 70 %, while a lasting
    change still passes, by up to 6 % a step.  A probe's readings (the arm is not the one served) weigh PROBE_WEIGHT: such
    an arm sees few steps, and one probe into a changed reality should be enough to flip a verdict.  An arm
    not yet measured takes its corrections from the bucket's measured arms, linearly in k between them and
    the nearest beyond them, plain decoding standing at the prior's 1 until measured: a drafter's time grows
    with k, so speculation measured to lose at k = 4 is not tried again at k = 2 and k = 1 as if untried.

    Worked example, batch 8, acceptance 0.7 for every request, tables: plain step 8 ms, k = 4 step 9 ms
    verify + 4 x 0.75 ms drafter = 12 ms.  Prior: plain 8 tokens / 8 ms = 1000 tokens/s, k = 4
    8 x 2.77 = 22.2 tokens / 12 ms = 1849 tokens/s: k = 4.  Served k = 4 steps take 36 ms (3x the table):
    the first reading makes time_ratio (1 + 3) / 2 = 2, 24 ms, 924 tokens/s, and plain decoding's 1000 wins.
    k = 2 (tables 8.5 + 1.5 = 10 ms for 8 x 2.19 = 17.5 tokens), unmeasured, takes the ratio half way
    between plain's 1 and k = 4's 2, 1.5: 15 ms, 1168 tokens/s, so it is tried next, and its own readings
    decide.
    """

    EMA = 0.25
    PROBE_WEIGHT = 0.5
    TRUSTED = 4  # readings after which a served arm's step times enter clipped to within CLIP of its estimate
    CLIP = 1.25

    def __init__(self, costs: CalibratedCosts, ks: list[int]):
        self.costs = costs
        self.ks = ks  # sorted, ks[0] = 0
        self.arms: dict[int, dict[int, Arm]] = {}  # bucket -> k -> its measurements

    def evaluate(self, batch: int, tokens: list[float], other_tokens: int = 0) -> tuple[list[float], list[float]]:
        """(tokens per second, seconds per step) for each k in ks, tokens[i] being tokens(ks[i]); with
        other_tokens of prefill in the step, its seconds by the tables and the decode-only corrections."""
        ratio, share = self.corrections(batch_bucket(batch))
        seconds = [t * r for t, r in zip(self.costs.predict(batch, self.ks, other_tokens), ratio)]
        return [n * s / t for n, s, t in zip(tokens, share, seconds)], seconds

    def corrections(self, b: int) -> tuple[list[float], list[float]]:
        """[time_ratio], [token_share] of bucket b for each k in ks, measured or interpolated."""
        arms = self.arms.get(b)
        if not arms:
            return [1.0] * len(self.ks), [1.0] * len(self.ks)
        xs = sorted(arms) if 0 in arms else [0, *sorted(arms)]
        points = [arms.get(k) or Arm(0, 1.0, 1.0) for k in xs]  # plain decoding at the prior until measured
        return (_interpolate(xs, [a.time_ratio for a in points], self.ks),
                _interpolate(xs, [a.token_share for a in points], self.ks))

    def observe(self, batch: int, k: int, tokens: float, full_tokens: float, seconds: float,
                probe: bool = False) -> None:
        """A decode-only step at k took `seconds`; its drafts are expected to emit `tokens`, full_tokens had
        every request drafted k (the same for a plain step)."""
        b = batch_bucket(batch)
        arm = self.arms.get(b, {}).get(k)
        if arm is None:
            ratio, share = self.corrections(b)
            i = self.ks.index(k)
            arm = self.arms.setdefault(b, {})[k] = Arm(0, ratio[i], share[i])
        arm.readings += 1
        weight = max(self.PROBE_WEIGHT if probe else self.EMA, 1 / (arm.readings + 1))
        ratio = seconds / self.costs.predict(batch, [k])[0]
        if not probe and arm.readings > self.TRUSTED:
            ratio = min(max(ratio, arm.time_ratio / self.CLIP), arm.time_ratio * self.CLIP)
        arm.time_ratio += weight * (ratio - arm.time_ratio)
        arm.token_share += weight * (tokens / full_tokens - arm.token_share)

    def readings(self, batch: int, k: int) -> int:
        arm = self.arms.get(batch_bucket(batch), {}).get(k)
        return arm.readings if arm is not None else 0

    def state(self) -> dict[str, list[float]]:
        """Per arm ("b3-k4": batch bucket 3, k = 4): [readings, time_ratio, token_share] (for the benches)."""
        return {f"b{b}-k{k}": [arm.readings, round(arm.time_ratio, 3), round(arm.token_share, 3)]
                for b, arms in sorted(self.arms.items()) for k, arm in sorted(arms.items())}


def _interpolate(xs: list[int], ys: list[float], at: list[int]) -> list[float]:
    """ys at each point of `at` (sorted): linear between the points xs (sorted), the nearest beyond them; as
    np.interp, without its overhead (~5 us against 1.7) on a handful of points every step."""
    out, j = [], 0
    for x in at:
        while j + 1 < len(xs) and xs[j + 1] <= x:
            j += 1
        if x <= xs[j] or j + 1 == len(xs):
            out.append(ys[j])
        else:
            out.append(ys[j] + (x - xs[j]) / (xs[j + 1] - xs[j]) * (ys[j + 1] - ys[j]))
    return out
