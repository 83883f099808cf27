"""A head's observe launched before the host reads the step's acceptance (Eagle3Speculator.observe_ahead, issue 21),
run on the CPU where every copy is synchronous: the same tokens as plain decoding and as the observe after the
commit, the same head state, and whole-step fallbacks where a step does not qualify."""

from __future__ import annotations

import pytest
import torch

from specdec import SamplingParams
from tests import test_eagle3, test_mtp
from tests.test_eagle3 import eagle_llm
from tests.test_mtp import GREEDY as MTP_GREEDY, mtp_llm
from tests.test_qwen3_5_engine import PROMPTS
from tests.test_speculative import GREEDY, mixed_prompts

head_dir, plain, target = test_eagle3.head_dir, test_eagle3.plain, test_mtp.target  # their modules' fixtures


def static_eagle(qwen3_dir, head_dir, k: int, early: bool = True, **kw):
    kw.setdefault("max_graph_batch", 8)
    llm = eagle_llm(qwen3_dir, head_dir, k, static_shapes=True, **kw)
    llm.engine.speculator.early_observe = early
    return llm


def observed_ahead(llm) -> int:
    return llm.engine.speculator.stats["head_observed_ahead"]


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_an_eagle3_head_equals_plain(qwen3_dir, head_dir, plain, k):
    llm = static_eagle(qwen3_dir, head_dir, k)
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == plain
    assert observed_ahead(llm) > 0 and llm.engine.metrics()["accepted_tokens"] > 0


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_with_mtp_on_a_hybrid_target_equals_plain(target, k):
    path, expected = target
    llm = mtp_llm(path, k, static_shapes=True)
    assert tokens(llm.generate(PROMPTS, MTP_GREEDY)) == expected
    assert observed_ahead(llm) > 0 and llm.engine.metrics()["accepted_tokens"] > 0


# ---------------------------------------------------------------------------------------------- sampled


def seeded_params(n: int) -> list[SamplingParams]:
    """Seeded requests at temperature 1, and at 0.7 with top-p, in turn."""
    return [SamplingParams(max_tokens=30, temperature=1.0, seed=i, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True) for i in range(n)]


def test_seeded_sampled_replies_are_the_same_with_the_early_observe_on_and_off(qwen3_dir, head_dir):
    prompts = mixed_prompts()
    params = seeded_params(len(prompts))
    early, late = (static_eagle(qwen3_dir, head_dir, 3, early=on) for on in (True, False))
    assert tokens(early.generate(prompts, params)) == tokens(late.generate(prompts, params))
    assert observed_ahead(early) > 0 and observed_ahead(late) == 0


def test_seeded_sampled_mtp_replies_are_the_same_with_the_early_observe_on_and_off(target):
    path, _ = target
    params = seeded_params(len(PROMPTS))
    runs = []
    for on in (True, False):
        llm = mtp_llm(path, 2, static_shapes=True)
        llm.engine.speculator.early_observe = on
        runs.append(tokens(llm.generate(PROMPTS, params)))
        assert (observed_ahead(llm) > 0) == on
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------------------------- the head's state


def test_the_heads_state_after_each_step_is_what_the_late_observe_leaves(qwen3_dir, head_dir):
    """Two engines stepped in lockstep over the same greedy requests, one observing ahead: after every step each
    request's head holds as many positions and (allclose) the same last output and logits."""
    early, late = (static_eagle(qwen3_dir, head_dir, 3, early=on).engine for on in (True, False))
    prompts = mixed_prompts()
    pairs = [(early.add_request(p, GREEDY), late.add_request(p, GREEDY)) for p in prompts]
    compared = 0
    while early.has_work() or late.has_work():
        early.step()
        late.step()
        for a, b in pairs:
            assert a.output_token_ids == b.output_token_ids
            sa, sb = early.speculator.states.get(a.request_id), late.speculator.states.get(b.request_id)
            assert (sa is None) == (sb is None)
            if sa is None or sa.last is None:
                continue
            assert sa.computed == sb.computed == a.num_computed
            # the two heads run at different batch shapes: float32 sums round apart by ~2e-5 on some CPUs
            torch.testing.assert_close(sa.last, sb.last, rtol=1e-4, atol=1e-4)
            assert (sa.last_logits is None) == (sb.last_logits is None)
            if sa.last_logits is not None:
                torch.testing.assert_close(sa.last_logits, sb.last_logits, rtol=1e-4, atol=1e-4)
            compared += 1
    assert early.speculator.stats["head_observed_ahead"] > 5 and compared > 20
    assert late.speculator.stats["head_observed_ahead"] == 0
    assert early.speculator.stats["head_tokens_observed"] == late.speculator.stats["head_tokens_observed"]


# ---------------------------------------------------------------------------------------------- fallbacks


def run_staggered(engine, prompts, params, joining_at: int) -> list[list[int]]:
    """Half the requests from the start, the rest added after `joining_at` steps (their prefills join decoding
    steps); each request's output tokens."""
    half = len(prompts) // 2
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts[:half], params[:half])]
    for _ in range(joining_at):
        engine.step()
    reqs += [engine.add_request(p, sp) for p, sp in zip(prompts[half:], params[half:])]
    while engine.has_work():
        engine.step()
    return [r.output_token_ids for r in reqs]


def test_steps_with_a_prefill_joining_or_a_request_near_max_tokens_fall_back_and_stay_exact(qwen3_dir, head_dir,
                                                                                           plain):
    """Prefills joining decoding steps make those steps observe after the commit; requests whose k is cut by their
    max_tokens feed fewer drafts than the others (a ragged layout observed ahead)."""
    llm = static_eagle(qwen3_dir, head_dir, 5)
    lengths = [7, 30, 12, 3, 21, 16]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    outputs = run_staggered(llm.engine, mixed_prompts(), params, joining_at=3)
    assert outputs == [p[:n] for p, n in zip(plain, lengths)]
    verify_steps = llm.engine.stats["steps"]
    assert 0 < observed_ahead(llm) < verify_steps



def test_under_preemption_and_chunked_prefill_greedy_stays_exact(qwen3_dir, head_dir, plain):
    tight = static_eagle(qwen3_dir, head_dir, 4, kv_cache_tokens=160, max_num_batched_tokens=24)
    assert tokens(tight.generate(mixed_prompts(), GREEDY)) == plain
    assert tight.engine.scheduler.num_preemptions > 0 and observed_ahead(tight) > 0
