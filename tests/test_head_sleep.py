"""A head asleep while its controller plans k = 0 (speculate/head_sleep.py): steps without drafts keep their feature
rows, fed in one forward when the head next drafts or a request has kept kept_limit of them.  Run on the CPU
with float32 tiny models: greedy output equal to plain decoding (EAGLE-3 and MTP, fixed shapes and not), every
step verifying the drafts an awake head gives (and a head fed the wrong rows would draft others), seeded sampled
replies the same asleep and awake, preemption and chunked prefill, and no head forward at all on a run of
plain steps."""

from __future__ import annotations

import pytest

from specdec import SamplingParams
from specdec.speculate.head_sleep import HeadSleep
from tests import test_eagle3, test_mtp
from tests.test_chain_ahead import record_drafts, staggered_lengths
from tests.test_eagle3 import eagle_llm
from tests.test_mtp import GREEDY as MTP_GREEDY, mtp_llm
from tests.test_observe_ahead import seeded_params, tokens
from tests.test_observe_no_logits import SometimesZero
from tests.test_qwen3_5_engine import PROMPTS
from tests.test_speculative import GREEDY, mixed_prompts

head_dir, plain, target = test_eagle3.head_dir, test_eagle3.plain, test_mtp.target  # their modules' fixtures

# runs of plain steps of 1 to 3 between drafting steps
PATTERN = (0, 1, 0, 0, 1, 0, 0, 0, 1, 1)
LENGTHS = [7, 30, 12, 19, 25, 16]


def sleepy(llm, limit: int = 32, pattern=PATTERN):
    """The LLM with k = 0 on the pattern's steps (SometimesZero) and its head's defer_limit (0: awake)."""
    SometimesZero(llm.engine.controller, pattern)
    llm.engine.speculator.defer_limit = limit
    return llm


def kept(llm) -> int:
    return llm.engine.speculator.stats["head_positions_kept"]


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_a_sleeping_eagle3_head_equals_plain(qwen3_dir, head_dir, plain, k, static):
    llm = sleepy(eagle_llm(qwen3_dir, head_dir, k, static_shapes=static, max_graph_batch=8))
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == plain
    stats = llm.engine.speculator.stats
    assert kept(llm) > 20 and stats["head_wakes"] > 3 and llm.engine.metrics()["accepted_tokens"] > 0
    assert all(not s.pending for s in llm.engine.speculator.states.values())


@pytest.mark.parametrize("static", [True, False])
def test_greedy_with_a_sleeping_mtp_head_equals_plain(target, static):
    path, expected = target
    llm = sleepy(mtp_llm(path, 2, static_shapes=static))
    assert tokens(llm.generate(PROMPTS, MTP_GREEDY)) == expected
    assert kept(llm) > 10 and llm.engine.metrics()["draft_tokens"] > 0


def drafts_and_tokens(llm, params) -> tuple[list, list]:
    """Every forward's drafts (per sequence) and each request's output tokens."""
    seen = record_drafts(llm.engine)
    out = tokens(llm.generate(mixed_prompts(), params))
    return [step for step in seen if any(step)], out


def greedy_staggered() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in LENGTHS]


@pytest.mark.parametrize("static,limit", [(True, 32), (False, 32), (True, 2), (False, 1)])
def test_every_step_verifies_the_drafts_of_an_awake_head(qwen3_dir, head_dir, static, limit):
    """Asleep or awake, every verify step verifies the same drafts: the head fed its kept rows at once is the
    head fed them step by step (limit 1 and 2: fed every step or two, when the kept rows reach the limit)."""
    def engine(limit):
        return sleepy(eagle_llm(qwen3_dir, head_dir, 3, static_shapes=static, max_graph_batch=8), limit)

    want = drafts_and_tokens(engine(0), greedy_staggered())
    llm = engine(limit)
    assert drafts_and_tokens(llm, greedy_staggered()) == want
    assert kept(llm) > 20 and sum(len(d) for step in want[0] for d in step) > 20


def test_a_head_woken_with_the_wrong_rows_drafts_otherwise(qwen3_dir, head_dir, monkeypatch):
    """Negative control: kept rows fed in the wrong order leave the tokens those of plain decoding (the verify
    step is lossless) but change the drafts, so the equality above has power."""
    def engine(limit):
        return sleepy(eagle_llm(qwen3_dir, head_dir, 3, static_shapes=True, max_graph_batch=8), limit)

    want = drafts_and_tokens(engine(0), greedy_staggered())
    kept_row = HeadSleep._kept_row

    def reversed_rows(self, req):
        row = kept_row(self, req)
        return row[:4] + (row[4].flip(0),)

    monkeypatch.setattr(HeadSleep, "_kept_row", reversed_rows)
    drafts, out = drafts_and_tokens(engine(32), greedy_staggered())
    assert out == want[1] and drafts != want[0]


def test_seeded_sampled_replies_are_the_same_asleep_and_awake(qwen3_dir, head_dir):
    params = staggered_lengths(seeded_params(6), LENGTHS)

    def replies(limit):
        llm = sleepy(eagle_llm(qwen3_dir, head_dir, 3, static_shapes=True, max_graph_batch=8), limit)
        return tokens(llm.generate(mixed_prompts(), params)), llm

    want, _ = replies(0)
    out, llm = replies(32)
    assert out == want and kept(llm) > 20


def test_under_preemption_and_chunked_prefill_greedy_stays_exact(qwen3_dir, head_dir, plain):
    tight = sleepy(eagle_llm(qwen3_dir, head_dir, 3, static_shapes=True, max_graph_batch=8, kv_cache_tokens=160,
                             max_num_batched_tokens=24))
    assert tokens(tight.generate(mixed_prompts(), GREEDY)) == plain
    assert tight.engine.scheduler.num_preemptions > 0 and kept(tight) > 0


def test_a_run_of_plain_steps_runs_no_head_forward_and_keeps_at_most_the_limit(qwen3_dir, head_dir, plain):
    """k = 0 on every step: after the prompts' observes the head runs only when a request has kept 8 rows,
    one forward for them, and never holds more."""
    llm = sleepy(eagle_llm(qwen3_dir, head_dir, 3, static_shapes=True, max_graph_batch=8), limit=8, pattern=(0,))
    spec, forwards, most = llm.engine.speculator, [], [0]
    observe = spec._observe

    def counted(rows, with_logits):
        forwards.append(sum(row[2] for row in rows))
        return observe(rows, with_logits)

    spec._observe = counted
    step = llm.engine.step
    llm.engine.step = lambda: (step(), most.__setitem__(0, max([most[0]] + [len(s.pending)
                                                                                for s in spec.states.values()])))[0]
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == plain
    assert most[0] <= 8 and kept(llm) > 50 and llm.engine.metrics()["draft_tokens"] == 0
    # the prompts, then the kept rows 8 at a time; a finished request drops the fewer than 8 it still kept
    prompts_fed, unfed = sum(len(p) for p in mixed_prompts()), sum(forwards) - sum(len(p) for p in mixed_prompts())
    assert forwards[:2] == [30, prompts_fed - 30] and all(n % 8 == 0 for n in forwards[2:])
    assert kept(llm) - 8 * len(mixed_prompts()) < unfed <= kept(llm)
    assert len(forwards) - 2 <= kept(llm) / 8  # one forward for every 8 kept positions of a request at most


def test_the_limit_is_the_widest_observe_the_head_graphs_captured(qwen3_dir, head_dir):
    """By default a request keeps as many rows as the widest observe the head's graphs hold, so that feeding them
    replays a graph: q = k + 1 of the largest k the controller may choose (8 before precapture, or without graphs)."""
    spec = eagle_llm(qwen3_dir, head_dir, 3, static_shapes=True, max_graph_batch=8).engine.speculator
    assert spec.defer_limit is None and spec.kept_limit == 8
    spec.precapture_graphs([1, 2, 3], eager=True)
    assert spec.graphs.q_ladder == [1, 2, 3, 4] and spec.kept_limit == 4
    spec.defer_limit = 0
    assert spec.kept_limit == 0 and not spec._sleeps([])
    assert eagle_llm(qwen3_dir, head_dir, 3).engine.speculator.kept_limit == 8  # no graphs (eager steps)
