"""The speculation controller: k by the goodput estimate (calibrated prior, measured steps), one exploration rule."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.speculate.acceptance import expected_tokens, expected_tokens_sum
from specdec.speculate.controller import KController
from specdec.speculate.step_costs import CalibratedCosts, StepCostTable, batch_bucket

FLAT = StepCostTable({1: 1.0, 4096: 1.0})  # verification is free: the tables say "always draft"
BUSY = StepCostTable({1: 1.0, 2: 2.0})  # compute-bound: every extra token costs as much as the first


def arm(ctl: KController, batch: int, k: int):
    return ctl.estimate.arms.get(batch_bucket(batch), {}).get(k)


def test_controller_picks_k_by_expected_goodput():
    ctl = KController(8, FLAT, lambda b: 0.0)
    assert ctl.choose(["a"], 0) == 8  # free verification: draft as much as allowed
    ctl = KController(8, BUSY, lambda b: 0.0)
    assert ctl.choose(["a"] * 64, 0) == 0  # compute-bound: speculation would only slow it down
    ctl = KController(8, FLAT, lambda b: 0.5)
    for _ in range(50):
        ctl.acceptance.update("a", 4, 0)  # a request whose drafts are always rejected
    assert ctl.choose(["a"], 0) == 0
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)


def test_the_prior_alone_chooses_as_the_calibrated_tables_say():
    """No step measured yet: the choice is argmax_k tokens(k) / t(B, k) over the tables (verify steps from
    their own tables, the drafter's k forwards from its), batch by batch."""
    verify = {0: StepCostTable({1: 1.0, 64: 4.0}), 1: StepCostTable({1: 1.05, 64: 7.0}),
              2: StepCostTable({1: 1.1, 64: 10.0}), 4: StepCostTable({1: 1.2, 64: 16.0})}
    draft = StepCostTable({1: 0.05, 64: 0.3})
    costs = CalibratedCosts(StepCostTable({1: 1.0, 512: 30.0}), draft, verify)
    ks = [0, 1, 2, 4]
    chosen = {}
    for batch in (1, 4, 16, 64):
        ctl = KController(4, None, None)
        ctl.calibrate(costs.target, costs.draft, costs.verify)
        tokens = [batch * expected_tokens(0.8, k) for k in ks]  # the acceptance prior
        seconds = [verify[k](batch) + k * draft(batch) for k in ks]
        want = ks[int(np.argmax(np.divide(tokens, seconds)))]
        chosen[batch] = ctl.choose([f"r{i}" for i in range(batch)], 0)
        assert chosen[batch] == want
    assert chosen[1] == 4 and chosen[64] == 0 and len(set(chosen.values())) >= 3  # the tables decide all along


def test_closed_form_expected_tokens_matches_the_series():
    alphas = np.array([0.0, 0.3, 0.5, 0.999999, 1.0, 1.0 - 1e-12])
    ks = np.array([0, 1, 2, 4, 8])
    want = [sum(expected_tokens(float(a), int(k)) for a in alphas) for k in ks]
    assert expected_tokens_sum(alphas, ks) == pytest.approx(want, rel=1e-6)


def test_an_untried_drafter_is_tried_and_the_evidence_then_decides():
    """Before any evidence the acceptance prior is optimistic, so a drafter whose worth depends on its
    acceptance gets tried; once the engine has measured it, new requests start from the engine's rate."""
    ctl = KController(4, FLAT, lambda b: 0.4)  # pays only if acceptance is high (k=1 needs a > 0.4)
    assert ctl.choose(["a"], 0) > 0  # untried: try it
    for _ in range(40):
        ctl.acceptance.update("a", 4, 0)  # every first draft rejected
    assert ctl.choose(["a"], 0) == 0
    assert ctl.choose(["new"], 0) == 0  # a new request inherits the engine's measured rate
    ctl = KController(4, FLAT, lambda b: 0.4)
    for _ in range(20):
        ctl.acceptance.update("a", 4, 4)
    assert ctl.choose(["new"], 0) == 4  # ... which here says: draft all the way


def test_first_speculating_step_after_plain_ones_is_not_the_measured_rate():
    """It also pays the drafter's catch-up on the tokens it skipped: kept apart as the price of a switch."""
    ctl = KController(4, FLAT, lambda b: 0.0)
    ctl.choose(["a"], 0)
    ctl.observe_step(1, ctl.last_k, 30.0)  # switch-on: catch-up included
    assert arm(ctl, 1, 4) is None and ctl.catch_up_s[0] == pytest.approx(29.0)  # 30 s against the table's 1
    ctl.choose(["a"], 0)
    ctl.observe_step(1, ctl.last_k, 1.2)
    assert arm(ctl, 1, 4).readings == 1 and arm(ctl, 1, 4).time_ratio == pytest.approx(1.1)  # with the prior 1
    # the tokens are what the acceptance estimates expect (prior 0.8 here), over the measured time
    goodput, _ = ctl.estimate.evaluate(1, [1.0, 0.0, 0.0, expected_tokens(0.8, 4)])
    assert goodput[3] == pytest.approx(expected_tokens(0.8, 4) / 1.1)


def test_the_estimate_counts_the_drafts_really_proposed():
    """An n-gram lookup finds drafts for few requests; the estimate must expect tokens from those drafts only,
    or useless verify steps would look like a win (they did: ngram kept drafting under a full KV cache)."""
    ctl = KController(4, FLAT, lambda b: 0.0)
    ids = ["a", "b", "c"]
    k = ctl.choose(ids, 0)
    assert k == 4 and ctl.last_expected == pytest.approx(3 * expected_tokens(0.8, 4))
    ctl.drafted(ids, [0, 0, 2])
    assert ctl.last_expected == pytest.approx(2 + expected_tokens(0.8, 2))
    ctl._speculated = True  # (not a switch-on step)
    ctl.observe_step(3, k, 1.0)
    share = (2 + expected_tokens(0.8, 2)) / (3 * expected_tokens(0.8, 4))
    assert arm(ctl, 3, 4).token_share == pytest.approx((1 + share) / 2)  # the prior 1 counts as one reading


def test_served_step_times_correct_the_calibrated_costs():
    """The table says a draft step costs 0.05 s; served ones take 0.3 s (sampling, host work).  The measured
    step times teach the estimate so, and k falls from 8 to where speculation still pays."""
    ctl = KController(8, FLAT, lambda b: 0.05)
    ctl.choose(["a"], 0)
    ctl.observe_step(1, 0, 1.0)  # a plain step: the tables were right about it
    ks = []
    for _ in range(40):
        k = ctl.choose(["a"], 0)
        ks.append(k)
        ctl.acceptance.update("a", k, int(0.8 * k)) if k else None
        ctl.observe_step(1, k, 1.0 + 0.3 * k)
    assert ks[0] == 8 and 0 < ks[-1] < 8
    k = ks[-1]  # its steps take (1 + 0.3 k) / (1 + 0.05 k) of the tables' time, and the estimate knows
    assert arm(ctl, 1, k).time_ratio == pytest.approx((1.0 + 0.3 * k) / (1.0 + 0.05 * k), rel=0.02)


def test_verify_steps_are_priced_from_their_own_measured_shapes():
    """A verify step of B sequences of k + 1 tokens is one captured graph: priced by its own table, not as
    B (k + 1) tokens of the tokens-fed table (eager past the graph batch); a step that also prefills is."""
    eager_past_16 = StepCostTable({1: 1.0, 16: 1.0, 32: 5.0, 256: 8.0})
    verify = {0: StepCostTable({1: 1.0, 16: 1.0}), 4: StepCostTable({1: 1.2, 16: 1.5})}
    costs = CalibratedCosts(eager_past_16, None, verify)
    assert costs.predict(16, [0, 4], 0) == pytest.approx([1.0, 1.5])
    assert costs.predict(16, [2], 0) == pytest.approx([eager_past_16(48)])  # no table for k = 2
    assert costs.predict(16, [4], 100) == pytest.approx([eager_past_16(180)])  # with a prefill: tokens fed
    ctl = KController(4, None, None)
    ctl.calibrate(eager_past_16, None, verify)
    ctl.estimate.observe(16, 4, 10.0, 10.0, 3.0)  # a verify step at 2x its table: the ratio says so
    assert arm(ctl, 16, 4).time_ratio == pytest.approx((1.0 + 2.0) / 2)


def test_one_outlier_reading_moves_an_arm_half_way():
    estimate = KController(4, FLAT, None).estimate
    estimate.observe(1, 0, 1.0, 1.0, 5.0)  # the first plain step at a new shape: 5x the table
    assert estimate.arms[0][0].time_ratio == pytest.approx(3.0)  # the prior 1 counts as one reading
    for _ in range(20):
        estimate.observe(1, 0, 1.0, 1.0, 1.0)
    assert estimate.arms[0][0].time_ratio == pytest.approx(1.0, abs=0.02)


def test_a_trusted_arm_shrugs_off_one_slow_step_but_follows_a_lasting_change():
    estimate = KController(4, FLAT, None).estimate
    for _ in range(10):
        estimate.observe(1, 4, 1.0, 1.0, 1.0)
    estimate.observe(1, 4, 1.0, 1.0, 1.8)  # one step at 1.8x (a collection pause)
    assert estimate.arms[0][4].time_ratio == pytest.approx(1.0625)  # EMA 0.25 of the clipped 1.25
    for _ in range(40):  # the drafter really became 2x slower
        estimate.observe(1, 4, 1.0, 1.0, 2.0)
    assert estimate.arms[0][4].time_ratio == pytest.approx(2.0, rel=0.02)
    estimate.observe(1, 4, 1.0, 1.0, 10.0, probe=True)  # a probe's reading is not clipped (it must flip verdicts)
    assert estimate.arms[0][4].time_ratio == pytest.approx(6.0, rel=0.02)


def test_an_unmeasured_arm_takes_its_neighbours_corrections():
    """Linearly in k between measured arms (plain decoding at the prior's 1 until measured), the nearest's
    beyond them: a drafter's time grows with k."""
    estimate = KController(8, FLAT, None).estimate  # candidates 0, 1, 2, 4, 8
    assert estimate.corrections(0)[0] == [1.0] * 5
    for _ in range(30):
        estimate.observe(1, 4, 1.0, 1.0, 3.0)  # k = 4 steps take 3x the table
    ratio, share = estimate.corrections(0)
    assert ratio == pytest.approx([1.0, 1.5, 2.0, 3.0, 3.0], abs=1e-3) and share == pytest.approx([1.0] * 5)


def test_steps_that_also_prefill_teach_nothing():
    """Their time is the prefill's whichever arm ran: counted, they made speculation look 10x slower."""
    ctl = KController(4, FLAT, lambda b: 0.0)
    ctl.serving[0] = 0  # plain decoding is served
    assert ctl.choose(["a"], other_tokens=500) == 0  # (speculation is off: it stays off here)
    ctl.observe_step(1, 0, 30.0)  # with a prefill: not learned
    assert arm(ctl, 1, 0) is None and not ctl.probe_credit
    ctl.choose(["a"], 0)
    ctl.observe_step(1, 0, 1.0)
    assert arm(ctl, 1, 0).readings == 1


def test_a_step_that_also_prefills_speculates_only_where_speculation_is_on_and_wins():
    """After plain steps, switching on pays the drafter's catch-up on every skipped token; on top of a
    prefill that made 36 ms steps against 18 ms plain ones at 64 requests on the H200.  A probe of a losing
    drafter that runs into such a step paid the same."""
    def run(spec_seconds: float, steps: int) -> tuple[KController, list[int]]:
        ctl = KController(4, FLAT, lambda b: 0.0)  # the tables: always draft
        ks = []
        for _ in range(steps):
            k = ctl.choose(["a", "b"], 0)
            ks.append(k)
            ctl.observe_step(2, k, spec_seconds if k else 1.0)
        return ctl, ks

    ctl, ks = run(1.0, 1)
    assert ks == [4] and ctl.choose(["a", "b"], other_tokens=100) == 0  # on, but not measured yet
    ctl, ks = run(1.0, 20)  # speculation wins 3x: the verdict is speculation
    assert ks[-1] > 0 and ctl.choose(["a", "b"], other_tokens=100) > 0
    ctl, ks = run(10.0, 60)  # it loses 3x: plain, but for probes
    assert ks[-1] == 0 and ctl.choose(["a", "b"], other_tokens=100) == 0
    while ctl.choose(["a", "b"], 0) == 0:  # the next probe ...
        ctl.observe_step(2, 0, 1.0)
    ctl.observe_step(2, ctl.last_k, 10.0)
    assert ctl.choose(["a", "b"], other_tokens=100) == 0  # ... does not carry into a step that prefills


def test_plain_decisions_are_reused_until_evidence_or_the_batch_changes():
    ctl = KController(4, BUSY, lambda b: 0.0)  # compute-bound: plain
    decided = []
    decide = ctl._decide
    ctl._decide = lambda ids, other: decided.append(len(ids)) or decide(ids, other)
    for _ in range(KController.REDECIDE_EVERY):
        assert ctl.choose(["a", "b"], 0) == 0
    assert decided == [2]  # once for REDECIDE_EVERY steps
    ctl.choose(["a", "b", "c"], 0)
    ctl.acceptance.update("a", 4, 2)
    ctl.choose(["a", "b", "c"], 0)
    ctl.choose(["a", "b", "c"], 100)  # a step that also prefills: decided afresh, the cache kept
    ctl.choose(["a", "b", "c"], 0)
    assert decided == [2, 3, 3, 3]


def serve(ctl: KController, batch: int, steps: int, seconds, tokens_accepted=None, seed: int = 0):
    """Run `steps` decode-only steps of `batch` requests; seconds(k, switch_on) is a step's measured time,
    tokens_accepted(k, rng) (if given) the drafts each request's verification accepts.  Returns per step
    (k, seconds, was a probe)."""
    rng = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(batch)]
    out, previous = [], 0
    for _ in range(steps):
        k = ctl.choose(ids, 0)
        if k and tokens_accepted is not None:
            for r in ids:
                ctl.acceptance.update(r, k, tokens_accepted(k, rng))
        s = seconds(k, k > 0 and previous == 0)
        ctl.observe_step(batch, k, s)
        out.append((k, s, ctl._probe))
        previous = k
    return out


def time_share(steps, which) -> float:
    return sum(s for k, s, probe in steps if which(k, probe)) / sum(s for _, s, _ in steps)


def test_speculation_that_measurably_loses_is_turned_off_and_probed_within_the_budget():
    ctl = KController(4, FLAT, lambda b: 0.0)  # the tables say: always draft
    # measured reality: a speculating step takes 4x as long as a plain one, for 3.4x the tokens
    steps = serve(ctl, 8, 3000, lambda k, on: 4.0 if k else 1.0)
    late = steps[200:]
    assert time_share(late, lambda k, probe: k > 0) <= KController.PROBE_SHARE  # plain wins; probes stay cheap
    assert any(k > 0 for k, _, _ in late)  # ... but it keeps probing
    ctl = KController(4, FLAT, lambda b: 0.0)
    serve(ctl, 1, 100, lambda k, on: 1.2 if k else 1.0)  # speculation pays: keep it
    assert sum(ctl.choose(["r0"], 0) > 0 for _ in range(32)) >= 28
    assert batch_bucket(1) == 0 and batch_bucket(8) == 3 and batch_bucket(9) == 4


def test_a_changed_reality_flips_the_verdict_within_a_bounded_number_of_steps():
    """The probes' budget bounds how long a verdict outlives the reality it was measured in: a probe of an arm
    costs PROBE_STEPS of its steps, paid by PROBE_SHARE of the served arm's time, and the arms next to the
    served one take turns (here k = 1 and the best speculating arm)."""
    ctl = KController(4, FLAT, lambda b: 0.0)
    steps = serve(ctl, 1, 3000, lambda k, on: 4.0 if k else 1.0)  # speculation loses (3.4 tokens in 4 s)
    late = [k > 0 for k, _, _ in steps[1000:]]
    assert 0 < sum(late) <= 0.02 * len(late)  # still probing, rarely
    bound = 2 * int(KController.PROBE_STEPS * 4.0 / KController.PROBE_SHARE)  # two probes of 4 s arms
    steps = serve(ctl, 1, bound + 10, lambda k, on: 1.0)  # now speculation wins 3x
    assert sum(ctl.choose(["r0"], 0) > 0 for _ in range(32)) >= 28
    steps = serve(ctl, 1, bound + 10, lambda k, on: 4.0 if k else 1.0)  # ... and loses again
    assert sum(ctl.choose(["r0"], 0) > 0 for _ in range(32)) <= 4


def test_measurements_override_a_wrong_prior():
    """The tables say compute-bound (plain), but served speculating steps cost what plain ones do: the probes
    measure it, and speculation is served."""
    ctl = KController(4, BUSY, lambda b: 0.0)
    assert ctl.choose(["r0", "r1"], 0) == 0  # the prior's verdict
    steps = serve(ctl, 2, 2000, lambda k, on: 2.0)  # every step takes 2 s, speculating or not
    assert steps[-1][0] > 0 and time_share(steps[-200:], lambda k, probe: k > 0) > 0.9
    first = next(i for i, (k, _, probe) in enumerate(steps) if k > 0 and not probe)
    assert first <= 3 * KController.PROBE_STEPS * 2 * 5 / KController.PROBE_SHARE  # within three probes


def test_exploration_costs_at_most_its_budget():
    """Probes (steps run on an arm other than the served one, the switch-on steps they cause included) take
    at most PROBE_SHARE of the time, whichever arm wins, with the drafter's catch-up counted."""
    for alpha, spec_s, switch_on_s in ((0.68, 9.0, 9.0), (0.68, 4.0, 30.0), (0.7, 1.15, 1.15), (0.5, 1.94, 1.94)):
        ctl = KController(4, FLAT, lambda b: 0.0)

        def accepted(k, rng):
            n = 0
            while n < k and rng.random() < alpha:
                n += 1
            return n
        steps = serve(ctl, 1, 3000, lambda k, on: (switch_on_s if on else spec_s) if k else 1.0, accepted)
        late = steps[300:]
        probes = time_share(late, lambda k, probe: probe)
        assert probes <= 1.2 * KController.PROBE_SHARE, (alpha, spec_s, switch_on_s, probes)


def simulate(alpha: float, spec_seconds: float, steps: int = 3000, seed: int = 0,
             switch_on_seconds: float | None = None) -> tuple[int, int]:
    """One request, k <= 4, each draft accepted with probability alpha, plain steps 1 s, speculating steps
    spec_seconds (switch_on_seconds for one that follows a plain step: the drafter's catch-up; default the
    same); returns (speculating steps, times speculation was switched back on)."""
    rng = np.random.default_rng(seed)
    ctl = KController(4, FLAT, lambda b: 0.0)
    speculated = switch_ons = previous = 0
    for _ in range(steps):
        k = ctl.choose(["a"], 0)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        if k:
            ctl.acceptance.update("a", k, accepted)
        seconds = (switch_on_seconds or spec_seconds) if k and not previous else spec_seconds if k else 1.0
        ctl.observe_step(1, k, seconds)
        speculated += k > 0
        switch_ons += k > 0 and previous == 0
        previous = k
    return speculated, switch_ons


def test_the_verdict_holds_through_noise():
    """Every switch back on costs the drafter a catch-up, so the verdict must not flip on single lucky or
    unlucky steps: where speculation is clearly better it keeps running, where it only breaks even it stays
    off but for its probes.  Either way speculation is switched on about once per probe, and a probe of a
    1-2 s arm comes once PROBE_SHARE of the time has paid PROBE_STEPS of its steps."""
    def probes(step_s: float, probe_s: float) -> int:
        return int(3000 * step_s * KController.PROBE_SHARE / (KController.PROBE_STEPS * probe_s)) + 3
    speculated, switch_ons = simulate(0.7, 1.15)  # 2.77 tokens in 1.15 s against 1 in 1 s
    assert speculated > 0.95 * 3000 and switch_ons <= probes(1.15, 1.0)  # back on only after probing plain
    break_even = expected_tokens(0.5, 4)  # 1.94 tokens in 1.94 s: the same goodput as plain decoding
    speculated, switch_ons = simulate(0.5, break_even)
    assert switch_ons <= probes(1.0, break_even) and speculated < 0.15 * 3000


def test_a_much_slower_arm_is_probed_rarely():
    """Probes of a speculating step that costs 9x a plain one (2.9 tokens for 9 s against 1 in 1 s: 0.32x the
    goodput) are spaced out so that they lose at most ~2 % of the time; every 16..128 steps they lost 10-17 %."""
    for steps, floor in ((300, 0.95), (3000, 0.97)):
        speculated, _ = simulate(0.68, 9.0, steps=steps)
        tokens = speculated * expected_tokens(0.68, 4) + steps - speculated
        assert tokens / (speculated * 9.0 + steps - speculated) >= floor  # goodput against plain decoding's
    speculated, _ = simulate(0.68, 2.0)  # speculation that pays is still kept
    assert speculated > 0.95 * 3000


def test_each_probe_pays_the_drafters_catch_up():
    """Each probe switches speculation on once, and that step pays the drafter's catch-up: 30 s here against
    4 s steady speculating steps (0.73x plain's goodput) and 1 s plain ones.  Spacing probes by the steady
    steps alone lost 18 % to them; counting the catch-up, little (mostly the first measurements)."""
    steps = 3000
    speculated, switch_ons = simulate(0.68, 4.0, steps=steps, switch_on_seconds=30.0)
    seconds = switch_ons * 30.0 + (speculated - switch_ons) * 4.0 + steps - speculated
    tokens = speculated * expected_tokens(0.68, 4) + steps - speculated
    assert tokens / seconds >= 0.95  # goodput against plain decoding's


def test_the_state_names_each_measured_arm():
    ctl = KController(4, FLAT, lambda b: 0.0)
    serve(ctl, 8, 20, lambda k, on: 2.0 if k else 1.0)
    state = ctl.state()
    assert "b3-k4" in state and state["b3-k4"][0] > 0 and state["b3-k4"][1] == pytest.approx(2.0, rel=0.2)
    assert KController(4, None, None, adaptive=False).state() == {}
