"""Overlapped steps with a speculator (engine/overlap.py, speculate/speculation.py): a step the controller plans at
k = 0 is a plain decode step left in flight, the head's observe of it queued at once, and the step behind it
launched before its commit where the controller plans k = 0 again.  Run on the CPU, float32 tiny models: greedy
output equal to plain decoding, every step verifying the drafts it verifies without overlap (and a head that
observed the wrong step's features would draft others), seeded sampled replies the same with overlap on and off,
and the controller pricing each step at the k it ran."""

from __future__ import annotations

import pytest

from specdec import SamplingParams
from specdec.speculate import SpecConfig
from specdec.speculate.speculation import Speculation
from tests import test_eagle3
from tests.test_chain_ahead import record_drafts, staggered_lengths
from tests.test_observe_ahead import seeded_params, static_eagle, tokens
from tests.test_observe_no_logits import SometimesZero
from tests.test_overlap_steps import make_llm
from tests.test_speculative import GREEDY, mixed_prompts

head_dir, plain = test_eagle3.head_dir, test_eagle3.plain  # its module's fixtures

# runs of three plain steps (the second and third launched behind the one before), then three drafting steps
MOSTLY_ZERO = (0, 0, 0, 1, 1, 1)
LENGTHS = [7, 30, 12, 19, 25, 16]  # requests finish at different steps, some while a step is in flight


def eagle(qwen3_dir, head_dir, k: int, overlap: bool, pattern=MOSTLY_ZERO):
    """An EAGLE-3 engine on the fixed-shape runner with k = 0 on the pattern's steps (SometimesZero)."""
    llm = static_eagle(qwen3_dir, head_dir, k, overlap_steps=overlap)
    SometimesZero(llm.engine.controller, pattern)
    return llm


def greedy_staggered() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in LENGTHS]


def overlapped(llm) -> int:
    return llm.engine.stats["overlapped_steps"]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_an_eagle3_head_and_overlapped_k0_steps_equals_plain(qwen3_dir, head_dir, plain, k):
    llm = eagle(qwen3_dir, head_dir, k, overlap=True)
    assert tokens(llm.generate(mixed_prompts(), greedy_staggered())) == [p[:n] for p, n in zip(plain, LENGTHS)]
    assert overlapped(llm) > 3 and llm.engine.metrics()["accepted_tokens"] > 0
    assert llm.engine.speculator.stats["head_observed_ahead"] > overlapped(llm)
    assert llm.engine.in_flight is None and llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_greedy_with_ngram_and_overlapped_k0_steps_equals_plain(qwen3_dir, plain):
    """A speculator that reads no features (n-gram) flies its k = 0 steps too."""
    llm = make_llm(qwen3_dir, overlap=True, kv_cache_tokens=4096,
                   speculator=SpecConfig("ngram", num_draft_tokens=3, adaptive=False))
    SometimesZero(llm.engine.controller, MOSTLY_ZERO)
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == plain
    assert overlapped(llm) > 3 and llm.engine.metrics()["accepted_tokens"] > 0


def drafts_and_tokens(llm, params) -> tuple[list, list]:
    """Every forward's drafts (per sequence) and each request's output tokens."""
    seen = record_drafts(llm.engine)
    out = tokens(llm.generate(mixed_prompts(), params))
    return [step for step in seen if any(step)], out


def test_every_step_verifies_the_drafts_it_would_without_overlap(qwen3_dir, head_dir):
    """The head's observe of a plain step in flight, queued at its launch, leaves the head as the observe after
    the commit does: every verify step, in turn, verifies the same drafts as without overlap."""
    want = drafts_and_tokens(eagle(qwen3_dir, head_dir, 3, overlap=False), greedy_staggered())
    llm = eagle(qwen3_dir, head_dir, 3, overlap=True)
    assert drafts_and_tokens(llm, greedy_staggered()) == want
    assert overlapped(llm) > 3 and sum(len(d) for step in want[0] for d in step) > 20


def test_a_head_that_observed_the_step_behind_drafts_otherwise(qwen3_dir, head_dir, monkeypatch):
    """Negative control: where the observe of a step in flight is not queued at its launch, the one after its
    commit reads the features of the step launched behind it; the tokens stay those of plain decoding (the
    verify step is lossless), but the drafts differ, so the equality above has power.  (Requests of one length:
    the step behind then feeds as many sequences, whose features the late observe reads.)"""
    want = drafts_and_tokens(eagle(qwen3_dir, head_dir, 3, overlap=False), GREEDY)
    monkeypatch.setattr(Speculation, "observe_in_flight", lambda self, *args: True)
    llm = eagle(qwen3_dir, head_dir, 3, overlap=True)
    drafts, out = drafts_and_tokens(llm, GREEDY)
    assert out == want[1] and drafts != want[0] and overlapped(llm) > 3


def test_seeded_sampled_replies_are_the_same_with_overlap_on_and_off(qwen3_dir, head_dir):
    params = staggered_lengths(seeded_params(6), LENGTHS)
    want = tokens(eagle(qwen3_dir, head_dir, 3, overlap=False).generate(mixed_prompts(), params))
    llm = eagle(qwen3_dir, head_dir, 3, overlap=True)
    assert tokens(llm.generate(mixed_prompts(), params)) == want
    assert overlapped(llm) > 3 and llm.engine.metrics()["accepted_tokens"] > 0


def test_the_controller_prices_each_step_at_the_k_it_ran(qwen3_dir, head_dir):
    """A plain step committed after the controller chose drafts for the next one is priced at k = 0: the steps
    the controller learns from run the same k, in order, as without overlap.  (Their batch may differ by the
    requests that finish at the commit of a step in flight: the step behind it still fed them.)"""
    def observed_ks(llm) -> list[int]:
        controller, seen = llm.engine.controller, []
        controller.observe_step = lambda batch, k, seconds, probe=None: seen.append(k)
        llm.generate(mixed_prompts(), greedy_staggered())
        return seen

    want = observed_ks(eagle(qwen3_dir, head_dir, 3, overlap=False))
    llm = eagle(qwen3_dir, head_dir, 3, overlap=True)
    assert observed_ks(llm) == want and overlapped(llm) > 3
    assert set(want) == {0, 3}


def test_a_head_without_a_graph_for_the_shape_commits_the_step_at_once(qwen3_dir, head_dir, plain):
    """Where the head cannot observe a plain step ahead (here: early observes off), the step is committed before
    another is launched, and the output stays exact."""
    llm = eagle(qwen3_dir, head_dir, 3, overlap=True)
    llm.engine.speculator.early_observe = False
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == plain
    assert overlapped(llm) == 0 and llm.engine.speculator.stats["head_observed_ahead"] == 0
