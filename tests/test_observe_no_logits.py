"""A head's observe of a step that drafted nothing (k = 0) skips its outputs' logits (speculate/eagle3.py,
head_graphs.py `with_logits`): the chain that drafts next computes them from the head's last output.  Run on the
CPU with float32 tiny models: greedy output equal to plain decoding, seeded sampled replies and every step's
drafts the same as with the logits computed in the observe (`observe_logits_always`), and the q = 1 shapes
without logits precaptured."""

from __future__ import annotations

import pytest
import torch

from specdec import SamplingParams
from tests import test_eagle3, test_mtp
from tests.test_chain_ahead import record_drafts
from tests.test_eagle3 import eagle_llm
from tests.test_mtp import GREEDY as MTP_GREEDY, mtp_llm
from tests.test_observe_ahead import seeded_params, static_eagle, tokens
from tests.test_qwen3_5_engine import PROMPTS
from tests.test_speculative import GREEDY, mixed_prompts

head_dir, plain, target = test_eagle3.head_dir, test_eagle3.plain, test_mtp.target  # their modules' fixtures


class SometimesZero:
    """Replaces a controller's choose: k = 0 on the steps where `pattern` (taken in turn) says 0, else the
    controller's own k.  The default pattern gives k = 0 after a drafting step, twice in a row, a drafting step
    after k = 0, and two drafting steps in a row.  chosen: each step's k."""

    def __init__(self, controller, pattern=(0, 1, 0, 0, 1, 1)):
        self.controller, self.own, self.pattern = controller, controller.choose, pattern
        self.chosen: list[int] = []
        controller.choose = self

    def __call__(self, request_ids: list[str], other_tokens: int) -> int:
        k = self.own(request_ids, other_tokens)
        if request_ids and not self.pattern[len(self.chosen) % len(self.pattern)]:
            k = self.controller.last_k = 0  # as the controller itself leaves it when it chooses 0
        self.chosen.append(k)
        return k


def sometimes_zero(llm, always: bool = False):
    """The LLM with k = 0 on some steps (SometimesZero), its head observing every step (not asleep at k = 0,
    speculate/head_sleep.py: the observes checked here) with logits always or not."""
    SometimesZero(llm.engine.controller)
    llm.engine.speculator.observe_logits_always = always
    llm.engine.speculator.defer_limit = 0
    return llm


def without_logits(llm) -> int:
    return llm.engine.speculator.stats["head_observes_without_logits"]


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_an_eagle3_head_and_some_k0_steps_equals_plain(qwen3_dir, head_dir, plain, k, static):
    llm = sometimes_zero(eagle_llm(qwen3_dir, head_dir, k, static_shapes=static, max_graph_batch=8))
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == plain
    assert without_logits(llm) > 0 and llm.engine.metrics()["accepted_tokens"] > 0
    assert 0 in llm.engine.controller.choose.chosen and k in llm.engine.controller.choose.chosen


@pytest.mark.parametrize("static", [True, False])
def test_greedy_with_mtp_and_some_k0_steps_equals_plain(target, static):
    path, expected = target
    llm = sometimes_zero(mtp_llm(path, 2, static_shapes=static))
    assert tokens(llm.generate(PROMPTS, MTP_GREEDY)) == expected
    assert without_logits(llm) > 0 and llm.engine.metrics()["draft_tokens"] > 0  # (its random head rarely hits)


def test_with_the_switch_on_every_observe_computes_logits(qwen3_dir, head_dir, plain):
    llm = sometimes_zero(static_eagle(qwen3_dir, head_dir, 3), always=True)
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == plain
    assert without_logits(llm) == 0


# ---------------------------------------------------------------------------------------------- sampled


def test_seeded_sampled_replies_are_the_same_with_the_logits_always_and_not(qwen3_dir, head_dir):
    """T = 1 and T = 0.7 with top-p 0.9, seeded: the next chain's logits, computed from the same last output,
    draw the same drafts whether the observe or the chain computed them."""
    prompts = mixed_prompts()
    params = seeded_params(len(prompts))
    runs = []
    for always in (True, False):
        llm = sometimes_zero(static_eagle(qwen3_dir, head_dir, 3), always)
        runs.append(tokens(llm.generate(prompts, params)))
        assert (without_logits(llm) > 0) != always
    assert runs[0] == runs[1]


def test_seeded_sampled_mtp_replies_are_the_same_with_the_logits_always_and_not(target):
    path, _ = target
    params = seeded_params(len(PROMPTS))
    runs = []
    for always in (True, False):
        llm = sometimes_zero(mtp_llm(path, 2, static_shapes=True), always)
        runs.append(tokens(llm.generate(PROMPTS, params)))
        assert (without_logits(llm) > 0) != always
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------------------------- step by step


def never_logits(llm):
    """Every head forward skips its logits: observes as after k = 0, and (a CPU runs no captured graph, so the
    switch may flip) the graphs with logits too, so that every chain computes them from the head's last output:
    the ones launched ahead (propose_ahead), and, step by step, each draw outside the chain graph."""
    spec = llm.engine.speculator
    spec._observe_with_logits = lambda seqs: False
    spec.graphs.with_logits = False
    return llm


@pytest.mark.parametrize("skip", ["after k = 0", "always", "always, step by step"])
def test_every_step_drafts_what_it_would_with_the_logits_from_the_observe(qwen3_dir, head_dir, skip):
    """Two engines stepped in lockstep over the same greedy requests, one computing the logits in every observe:
    after a decoding step without drafts (every step, when skipping always) the other's head holds last_logits
    None and the same last output, and every step verifies the same drafts.  (Without overlapped steps, so that
    each step() commits the step it ran: test_overlap_speculative checks the head's state with them.)"""
    pair = [static_eagle(qwen3_dir, head_dir, 3, overlap_steps=False) for _ in range(2)]
    if skip == "after k = 0":
        skipping, always = (sometimes_zero(llm, always).engine for llm, always in zip(pair, (False, True)))
    else:
        skipping, always = never_logits(pair[0]).engine, pair[1].engine
        always.speculator.observe_logits_always = True
        skipping.speculator.step_by_step = always.speculator.step_by_step = skip.endswith("step by step")
    drafts_skipping, drafts_always = record_drafts(skipping), record_drafts(always)
    reqs = [(skipping.add_request(p, GREEDY), always.add_request(p, GREEDY)) for p in mixed_prompts()]
    without = 0
    while skipping.has_work() or always.has_work():
        before = [a.num_computed for a, _ in reqs]
        skipping.step()
        always.step()
        assert drafts_skipping == drafts_always
        decoding_only = all(a.num_computed - n <= 1 for (a, _), n in zip(reqs, before))
        skipped = skip != "after k = 0" or (skipping.controller.choose.chosen[-1] == 0 and decoding_only)
        for a, b in reqs:
            assert a.output_token_ids == b.output_token_ids
            sa, sb = skipping.speculator.states.get(a.request_id), always.speculator.states.get(b.request_id)
            if sa is None or sa.last is None or a.finished:
                continue
            torch.testing.assert_close(sa.last, sb.last, rtol=1e-4, atol=1e-5)
            if skipped:
                assert sa.last_logits is None
                without += 1
    assert without > 10 and sum(len(d) for step in drafts_skipping for d in step) > 20
    assert without_logits(pair[0]) > 0 and without_logits(pair[1]) == 0
    if skip == "always":
        assert skipping.speculator.stats["head_chains_ahead"] > 0  # chains launched ahead computed the logits
    assert skipping.metrics()["accepted_tokens"] == always.metrics()["accepted_tokens"] > 0


# ---------------------------------------------------------------------------------------------- precapture


def test_precapture_runs_the_q1_shapes_without_logits_and_serving_uses_them(qwen3_dir, head_dir, plain):
    """precapture_graphs (run on a CPU with eager=True) records every (batch, 1, context) bucket without logits
    beside the ones with; observes after k = 0 steps then run on those shapes, and no other."""
    llm = sometimes_zero(static_eagle(qwen3_dir, head_dir, 3))
    spec = llm.engine.speculator
    bare = spec.graphs_without_logits
    assert spec.precapture_graphs([0, 1, 2, 3]) == 0  # nothing to capture on a CPU
    count = spec.precapture_graphs([0, 1, 2, 3], eager=True)
    batches, contexts = {b for b, _, _ in spec.graphs.shapes}, {c for _, _, c in spec.graphs.shapes}
    assert bare.frozen and bare.shapes == {(b, 1, c) for b in batches for c in contexts}
    assert count == len(spec.graphs.shapes) + len(bare.shapes) + len(spec.chain_graphs.shapes)
    used, run_layout = [], bare.run_layout

    def spy(layout, shape, ids, states):
        used.append(shape)
        out, logits = run_layout(layout, shape, ids, states)
        assert logits is None and out.shape == (len(layout), spec.head.config.layer.hidden_size)
        return out, logits

    bare.run_layout = spy
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == plain
    assert used and set(used) <= bare.shapes
    assert without_logits(llm) >= len(used)  # (the others: prefills' observes, eager)


def test_the_graphs_without_logits_return_the_same_outputs(qwen3_dir, head_dir):
    """A HeadGraphs forward without logits gives the outputs the one with logits gives, and logits None."""
    spec = static_eagle(qwen3_dir, head_dir, 3).engine.speculator
    layout = [([1, 2], 5, 1), ([3, 4], 2, 1), ([5, 6], 7, 1)]  # three sequences, one position each
    states = torch.randn(3, spec.head.config.layer.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = [4, 9, 11]
    outs = []
    for graphs in (spec.graphs, spec.graphs_without_logits):
        outs.append(graphs.run_layout(layout, graphs.layout_shape(layout), ids, states))
    (out, logits), (bare_out, bare_logits) = outs
    assert bare_logits is None and logits.shape == (3, spec.head.config.draft_vocab_size)
    torch.testing.assert_close(bare_out, out)
    torch.testing.assert_close(spec.head.logits(bare_out), logits, rtol=1e-5, atol=1e-5)


def test_max_tokens_finishing_requests_with_k0_steps_stay_exact(qwen3_dir, head_dir, plain):
    """Requests finishing at different steps between k = 0 and drafting steps."""
    lengths = [7, 30, 12, 3, 21, 16]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    llm = sometimes_zero(static_eagle(qwen3_dir, head_dir, 4))
    assert tokens(llm.generate(mixed_prompts(), params)) == [p[:n] for p, n in zip(plain, lengths)]
    assert without_logits(llm) > 0
